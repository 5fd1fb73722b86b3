"""--tp-comm int8 vs fp32 across two namespace hosts on a capped link (:mod:`tensorpar.nshosts`, needs root).

    .venv/bin/python bench/bench_tp_comm_hosts.py [--rate 1gbit] [--repeats 2]   # writes tp_comm_hosts.{json,md}

1. ``generate --tp 2`` of SmolLM2-135M (fp32, greedy, ``--new-tokens``) with one rank on each of two hosts, a
   prompt of ``--prompt-tokens`` (512) tokens of the held-out Shakespeare slice, ``--tp-comm fp32`` and ``int8``
   interleaved ``--repeats`` times: the time to first token and decode tokens/s that ``generate`` prints (median);
   ``int8-torch`` is int8 with ``TENSORPAR_COMM_KERNEL=0``: the quantization and the sum in PyTorch ops instead of
   our C kernel (csrc/q8_comm.cpp, the same bits), the A/B of that kernel; ``fp32-uncapped`` is fp32 on the same
   two hosts with no rate cap on their link (the veth pair at its own speed): what the TTFT would be if the link
   cost nothing, so ``fp32-uncapped / fp32`` bounds what any compression of the all-reduces can reach from below
   (compression shortens the link's share of the TTFT, never the compute's);
2. one tp all-reduce of fp32 ``[1, n]`` partials (576 = SmolLM2's hidden size, 4096 = 16 KB; median of
   ``--iters`` calls, each after a barrier) over the same link, exact, int8 and int8 through PyTorch ops
   (:func:`tensorpar.comm.reduce_partial` with ``compression="int8"``), on the tp group as generate makes it
   (``--fast-collectives auto``: across hosts the leaders' TCP mesh, tensorpar/comm/tcp.py): run by this file as
   the rank job (``--rank-job``).

The results record the CPU model, core count and load average before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SIZES = (576, 4096)


def rank_job(out: str, iters: int) -> None:
    import torch
    import torch.distributed as dist

    from tensorpar import comm
    from tensorpar.parallel import ParallelConfig, init_parallel
    torch.set_num_threads(1)
    ctx = init_parallel(ParallelConfig(tp=int(os.environ["WORLD_SIZE"])), timeout_s=120, fast_collectives="auto")
    tp = ctx.tp
    from tensorpar.comm import compress
    kernel = compress._lib
    rec = {}
    for n in SIZES:
        x = torch.randn(1, n, generator=torch.Generator().manual_seed(tp.rank))
        for mode in ("fp32", "int8", "int8-torch"):
            tp.compression = mode[:4]
            compress._lib = (lambda: None) if mode == "int8-torch" else kernel
            for _ in range(5):
                comm.reduce_partial(x, tp)
            times = []
            for _ in range(iters):
                dist.barrier(group=tp.pg)
                t0 = time.perf_counter()
                comm.reduce_partial(x, tp)
                times.append(time.perf_counter() - t0)
            rec[f"{mode}_{n}"] = statistics.median(times)
    tp.compression = "fp32"
    if tp.rank == 0:
        Path(out).write_text(json.dumps(rec))
    ctx.destroy()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank-job", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()
    if a.rank_job:
        return rank_job(a.rank_job, a.iters)
    from bench_hosts import cpu_model, env
    from bench_tp_comm import _ppl_ids
    from transformers import AutoTokenizer

    from tensorpar.hub import resolve_model
    from tensorpar.nshosts import NamespaceHosts
    folder = str(resolve_model("smollm2"))
    ids, work = _ppl_ids(folder, a.prompt_tokens)
    tok = AutoTokenizer.from_pretrained(folder)
    prompt = tok.decode(ids[0])
    n_prompt = len(tok(prompt)["input_ids"])
    load0 = os.getloadavg()
    from machine import cpu_account, describe, other_work
    cpu0 = cpu_account()
    modes = ("fp32", "int8", "int8-torch", "fp32-uncapped")
    runs: dict[str, list] = {m: [] for m in modes}
    for rep in range(a.repeats):
        for mode in (modes if rep % 2 == 0 else modes[::-1]):
            cmd = ["-m", "tensorpar", "generate", "--model", folder, "--tp", "2", "--max-new-tokens",
                   str(a.new_tokens), "--prompt", prompt, "--tp-comm", mode[:4]]
            e = dict(env(), **({"TENSORPAR_COMM_KERNEL": "0"} if mode == "int8-torch" else {}))
            with NamespaceHosts(2, None if mode == "fp32-uncapped" else a.rate) as h:
                res = h.run_torchrun(cmd, nproc=1, timeout_s=600, env=e)
            if any(rc for rc, _, _ in res):
                raise RuntimeError("generate failed: " + " | ".join(err[-1500:] for _, _, err in res))
            out = "\n".join(o for _, o, _ in res)
            m = re.search(r"time to first token ([\d.]+) ms, decode ([\d.]+) tokens/s", out)
            text = next(ln for ln in out.splitlines() if ln.strip())
            runs[mode].append({"ttft_ms": float(m.group(1)), "tokens_per_s": float(m.group(2)), "text": text[-200:]})
    with tempfile.TemporaryDirectory() as d, NamespaceHosts(2, a.rate) as h:
        path = os.path.join(d, "r.json")
        res = h.run_torchrun([str(Path(__file__).resolve()), "--rank-job", path, "--iters", str(a.iters)],
                             nproc=1, timeout_s=600, env=env())
        if any(rc for rc, _, _ in res):
            raise RuntimeError("collective job failed: " + " | ".join(err[-1500:] for _, _, err in res))
        coll = json.loads(Path(path).read_text())
    load1 = os.getloadavg()
    work_other = other_work(cpu0, cpu_account())
    med = {k: {"ttft_ms": statistics.median(r["ttft_ms"] for r in v),
               "tokens_per_s": statistics.median(r["tokens_per_s"] for r in v)} for k, v in runs.items()}
    meta = {"cpu": cpu_model(), "cores": os.cpu_count(), "load_start": load0, "load_end": load1, "rate": a.rate,
            "prompt_tokens": n_prompt, "prompt_work": work, "new_tokens": a.new_tokens, "other_work": work_other}
    outdir = Path(a.out)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "tp_comm_hosts.json").write_text(json.dumps({"meta": meta, "runs": runs, "median": med,
                                                           "collective_s": coll}, indent=1))
    la = lambda t: ", ".join(f"{v:.1f}" for v in t)  # noqa: E731
    lines = [f"# --tp-comm int8 vs fp32 across two namespace hosts at {a.rate} (one rank each)", "",
             f"{meta['cpu']}, {meta['cores']} cores; load average {la(load0)} at start, {la(load1)} at end "
             f"({'loaded, shared machine: indicative only' if max(load0[0], load1[0]) > 2.5 else 'quiet: its own two ranks'})"
             f"; {describe(work_other)}.", "",
             f"SmolLM2-135M generate --tp 2, fp32 weights, greedy, prompt of {n_prompt} tokens ({work}), "
             f"{a.new_tokens} new tokens; median of {a.repeats} interleaved runs:", "",
             "| --tp-comm | time to first token (ms) | decode tokens/s | runs (ttft ms / tok/s) |", "|---|---|---|---|"]
    for k in modes:
        lines.append(f"| {k} | {med[k]['ttft_ms']:.0f} | {med[k]['tokens_per_s']:.1f} | "
                     + ", ".join(f"{r['ttft_ms']:.0f} / {r['tokens_per_s']:.1f}" for r in runs[k]) + " |")
    lines += ["", f"TTFT int8 / fp32: {med['int8']['ttft_ms'] / med['fp32']['ttft_ms']:.2f} (int8 through PyTorch ops: "
              f"{med['int8-torch']['ttft_ms'] / med['fp32']['ttft_ms']:.2f}); the bound for a free link (fp32 "
              f"uncapped / fp32): {med['fp32-uncapped']['ttft_ms'] / med['fp32']['ttft_ms']:.2f}", "",
              "| one tp all-reduce of [1, n] fp32 over the link | fp32 ms | int8 ms | int8, PyTorch ops, ms |",
              "|---|---|---|---|"]
    for n in SIZES:
        lines.append(f"| n={n} ({4 * n} B) | {coll[f'fp32_{n}'] * 1e3:.3f} | {coll[f'int8_{n}'] * 1e3:.3f} | "
                     f"{coll[f'int8-torch_{n}'] * 1e3:.3f} |")
    (outdir / "tp_comm_hosts.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
