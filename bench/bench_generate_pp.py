"""Memory per rank and decode speed of ``generate`` with pipeline stages (``--pp``) against one stage.

    PYTHONPATH=. python bench/bench_generate_pp.py [--model smollm2] [--tokens 32]   # bench/results/generate_pp.md

Each layout (tp, pp) runs on a fresh pool of gloo ranks on this host (shared-memory collectives on, one thread per
rank). Each rank records its resident set after the imports, loads its stage (:func:`tensorpar.job.load_model`:
only its layers' weights are read), generates once to warm up, then greedily generates ``--tokens`` tokens for one
prompt (fp32). Reported per rank: the resident set above the post-import baseline once loaded and at the end (KV
cache and the lean path's buffers included), its parameter bytes, the decode milliseconds per token (rank 0), and
the share of the run it spent waiting on the pipeline group (the residual stream from the stage before, the tokens
from the last stage): the measured bubble, (pp - 1) / pp with one micro-batch in flight when the stages cost the
same.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

PROMPT = "The capital of France is"
LAYOUTS = [(1, 1), (1, 2), (2, 1), (2, 2)]      # (tp, pp)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def job(ctx, folder: str, n: int) -> dict:
    from transformers import AutoConfig, AutoTokenizer

    from tensorpar.generate import SamplingConfig, generate_tokens
    from tensorpar.job import Job, load_model
    torch.set_num_threads(1)
    base = _rss()
    j = Job(parallel=ctx.config, timeout_s=120.0, folder=folder, model_config=AutoConfig.from_pretrained(folder))
    model, _ = load_model(j, ctx)
    loaded = _rss()
    ids = AutoTokenizer.from_pretrained(folder)(PROMPT, return_tensors="pt")["input_ids"]
    generate_tokens(model, ctx.tp, ids, sampling=SamplingConfig(max_new_tokens=2), pp=ctx.pp)      # warm-up
    from tensorpar import comm
    with comm.counting(ctx.pp) as c:     # the seconds this rank waited on the pipeline group: its bubble
        res = generate_tokens(model, ctx.tp, ids, sampling=SamplingConfig(max_new_tokens=n), pp=ctx.pp)
    total = res.ttft_s + res.decode_s
    return {"pp_wait_fraction": sum(c.exposed_seconds().values()) / total,
            "loaded_rss": loaded - base, "end_rss": _rss() - base,
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "ms_per_token": 1e3 / res.decode_tokens_per_s, "ttft_ms": res.ttft_s * 1e3,
            "tokens": res.tokens[0].tolist()}


def run(folder: str, n: int) -> list[dict]:
    from tensorpar.parallel import ParallelConfig
    from tensorpar.shm import enable_fast_collectives  # noqa: F401  (the pool's ranks enable it below)
    from tensorpar.testing import WorkerPool

    rows = []
    for tp, pp in LAYOUTS:
        cfg = ParallelConfig(tp=tp, pp=pp)
        pool = WorkerPool(cfg.world_size, cfg, collective_timeout_s=120.0, job_timeout_s=900.0)
        try:
            if cfg.world_size > 1:
                pool.run(_fast)
            res = pool.run(job, folder, n)
        finally:
            pool.close()
        rows.append({"tp": tp, "pp": pp, "ranks": res})
        print(f"tp={tp} pp={pp}: {res[0]['ms_per_token']:.1f} ms/token, loaded RSS/rank "
              f"{[round(r['loaded_rss'] / 2**20) for r in res]} MiB", flush=True)
    return rows


def _fast(ctx) -> None:
    from tensorpar.shm import enable_fast_collectives
    for g in (ctx.tp, ctx.pp):
        if g.size > 1:
            enable_fast_collectives(g, "on")


def write(rows: list[dict], out: Path, n: int, load_before: tuple, load_after: tuple) -> None:
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.startswith("Model name")), "?")
    cores = os.cpu_count()
    mib = 2 ** 20
    lines = [
        "# generate with pipeline stages: memory per rank and decode speed", "",
        f"SmolLM2-135M (fp32), one prompt, {n} greedy tokens, one thread per rank, shared-memory collectives on. "
        f"CPU: {model_name}, {cores} cores ({platform.machine()}); load average (1, 5, 15 min) "
        f"{', '.join(f'{x:.1f}' for x in load_before)} before, {', '.join(f'{x:.1f}' for x in load_after)} after "
        "(the machine was shared with other jobs: the timings are noisy, the memory is not).", "",
        "Per rank, in rank order (rank = stage x tp + tp rank): parameter bytes, resident set above the post-import "
        "baseline once loaded and at the end of the run (KV cache and decode buffers included).", "",
        "| tp | pp | params MiB/rank | loaded RSS MiB/rank | end RSS MiB/rank | decode ms/token | waiting on the "
        "pipeline group (share of the run), per rank | same tokens |",
        "|---:|---:|---|---|---|---:|---|---|",
    ]
    ref = rows[0]["ranks"][0]["tokens"]
    for r in rows:
        rk = r["ranks"]
        lines.append(f"| {r['tp']} | {r['pp']} | {[round(x['param_bytes'] / mib, 1) for x in rk]} | "
                     f"{[round(x['loaded_rss'] / mib) for x in rk]} | {[round(x['end_rss'] / mib) for x in rk]} | "
                     f"{rk[0]['ms_per_token']:.1f} | {[round(x['pp_wait_fraction'], 2) for x in rk]} | "
                     f"{all(x['tokens'] == ref for x in rk)} |")
    lines += ["", "Raw: generate_pp.json (bench/bench_generate_pp.py)."]
    (out / "generate_pp.md").write_text("\n".join(lines) + "\n")
    (out / "generate_pp.json").write_text(json.dumps({"tokens": n, "cpu": model_name, "load_before": load_before,
                                                      "load_after": load_after, "rows": rows}, indent=1) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    a = p.parse_args()
    from tensorpar.hub import resolve_model
    folder = str(resolve_model(a.model, progress=False))
    before = os.getloadavg()
    t0 = time.time()
    rows = run(folder, a.tokens)
    print(f"{time.time() - t0:.0f} s")
    write(rows, Path(a.out), a.tokens, before, os.getloadavg())


if __name__ == "__main__":
    main()
