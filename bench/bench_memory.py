"""Resident memory per tensorpar rank (issue 28, item 4) and the decode speed of two code trees, on the CPU.

Memory (default): for each ``--model`` / ``--dtypes`` / ``--tp``, the lean decode of ``bench_decode.job_tp`` with its
memory rows: each rank's RSS and PSS (/proc/self/smaps_rollup) before the model is built (the baseline), after load,
and after a greedy decode of 32 tokens, against 1.1 x shard bytes + baseline; and the bytes of the distinct tensors
the model holds (``resident_weight_bytes``, oneDNN-packed tensors included).

Speed (``--speed OLD NEW``): decode ms/token of SmolLM2 at tp=1 (1 thread) for two checkouts of ``tensorpar`` (e.g.
``git archive HEAD tensorpar bench | tar -x -C /tmp/old``), each in its own process, interleaved over ``--rounds``.

    PYTHONPATH=. python bench/bench_memory.py --model smollm2 tinyllama-random
    PYTHONPATH=. python bench/bench_memory.py --speed /tmp/old . --rounds 4
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def model_and_prompt(name: str) -> tuple[str, list[int]]:
    """The folder and prompt ids of ``smollm2`` or ``tinyllama-random`` (the 1.1B random Llama of bench_llamacpp)."""
    if name == "tinyllama-random":
        from bench_hf_tp import model_folder, prompt_ids
        from bench_llamacpp import TINYLLAMA, TINYLLAMA_SEED
        return str(model_folder(None, TINYLLAMA, TINYLLAMA_SEED)), prompt_ids()
    from transformers import AutoTokenizer

    from bench_decode import PROMPT
    from tensorpar.hub import resolve_model
    folder = resolve_model(name)
    return str(folder), AutoTokenizer.from_pretrained(str(folder))(PROMPT)["input_ids"]


def memory(models, dtypes, tps) -> list[dict]:
    from bench_decode import MEMORY_STEPS, job_tp
    from bench_llamacpp import _memory_rows

    from tensorpar.testing import WorkerPool
    rows = []
    for name in models:
        folder, ids = model_and_prompt(name)
        for dtype in dtypes:
            for tp in tps:
                load = os.getloadavg()[0]
                with WorkerPool(tp, collective_timeout_s=600, job_timeout_s=3600) as pool:
                    res = pool.run(job_tp, folder, MEMORY_STEPS, dtype, "lean", 1, False, "none", ids, True)
                row = {"config": f"{name} {dtype} tp={tp}", "memory_by_rank": [r["memory"] for r in res]}
                for e, mem in zip(_memory_rows([row]), row["memory_by_rank"]):
                    e["load"] = load
                    e["rss_before_model_code"] = mem["baseline_before_model_code"]["rss"]
                    rows.append(e)
                    print(f"{e['config']} rank {e['rank']}: shard {e['shard_bytes'] / 1e6:.0f} MB, RSS "
                          f"{e['rss_baseline'] / 1e6:.0f} / {e['rss_after_load'] / 1e6:.0f} / "
                          f"{e['rss_after_decode'] / 1e6:.0f} MB ({e['rss_ratio_after_decode']:.2f}x), PSS "
                          f"{e['pss_ratio_after_decode']:.2f}x, tensors {e['model_tensor_bytes_after_decode'] / 1e6:.0f}"
                          f" MB", flush=True)
    return rows


_SPEED_JOB = r"""
import json, sys
sys.path.insert(0, "bench")
from bench_decode import job_tp
from tensorpar.testing import WorkerPool
folder, ids, dtype, n = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
with WorkerPool(1, collective_timeout_s=600, job_timeout_s=3600) as pool:
    r = pool.run(job_tp, folder, n, dtype, "lean", 1, False, "none", ids)[0]
print("RESULT", json.dumps({"tok_s": r["decode_tok_s"], "best_tok_s": r["best_step_tok_s"]}))
"""


def speed(trees, dtypes, rounds: int, n: int) -> list[dict]:
    """Decode ms/token of SmolLM2 at tp=1 for each tree and dtype, the trees alternating (ABAB, then BABA)."""
    folder, ids = model_and_prompt("smollm2")
    out = {(t, d): [] for t in trees for d in dtypes}
    loads = [os.getloadavg()]
    for rnd in range(rounds):
        for dtype in dtypes:
            for tree in (trees if rnd % 2 == 0 else trees[::-1]):
                env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
                p = subprocess.run([sys.executable, "-c", _SPEED_JOB, folder, json.dumps(ids), dtype, str(n)],
                                   cwd=os.path.abspath(tree), env=env, capture_output=True, text=True, timeout=1800)
                line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
                if p.returncode != 0 or not line:
                    raise RuntimeError(f"{tree} {dtype}: {p.stderr[-2000:]}")
                r = json.loads(line[0][7:])
                out[(tree, dtype)].append(r)
                print(f"round {rnd + 1} {tree} {dtype}: {1e3 / r['tok_s']:.1f} ms/token (best step "
                      f"{1e3 / r['best_tok_s']:.1f})", flush=True)
                loads.append(os.getloadavg())
    return [{"tree": t, "dtype": d, "tokens": n, "ms_per_token": [1e3 / r["tok_s"] for r in rs],
             "best_step_ms": [1e3 / r["best_tok_s"] for r in rs],
             "median_ms": statistics.median(1e3 / r["tok_s"] for r in rs),
             "median_best_step_ms": statistics.median(1e3 / r["best_tok_s"] for r in rs), "loads": loads}
            for (t, d), rs in out.items()]


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(x.split(":", 1)[1].strip() for x in out.splitlines() if x.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def render(res: dict) -> str:
    """The markdown page of a memory or a speed run."""
    m = res["meta"]
    head = (f"{m['cpu']}, {m['cpus']} CPUs, torch {m['torch']}, {m['date']}; load average (1 min) "
            f"{m['load_start'][0]:.1f} at start, {m['load_end'][0]:.1f} at end (the machine is shared: other "
            f"processes ran beside these).")
    mb = lambda x: f"{x / 1e6:.0f}"  # noqa: E731
    if "memory" in res:
        lines = ["# Resident memory per tensorpar rank (issue 28, item 4)", "", head, "",
                 "`bench/bench_memory.py`: each row a fresh set of rank processes (1 thread each, shared-memory "
                 "collectives) running `bench_decode.job_tp`: load, a 3-token warm-up generate, then a greedy decode "
                 "of 32 tokens on the lean path. RSS / PSS from /proc/self/smaps_rollup. Baseline = the rank's "
                 "process before the model is built, with the family's transformers modeling code imported (the "
                 "RSS before that import in the last column); bound = 1.1 x shard + baseline; shard = this rank's "
                 "parameters in its dtype; model tensors = `resident_weight_bytes` (distinct storages, oneDNN-packed "
                 "tensors included). MB = 10^6 bytes.", "",
                 "| configuration | rank | shard MB | model tensors MB (load / decode) | RSS baseline | RSS after load "
                 "| RSS after decode | (RSS - baseline) / shard | PSS after decode | (PSS - baseline) / shard | "
                 "within bound (RSS / PSS) | RSS before model code |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for e in res["memory"]:
            lines.append(f"| {e['config']} | {e['rank']} | {mb(e['shard_bytes'])} | "
                         f"{mb(e['model_tensor_bytes_after_load'])} / {mb(e['model_tensor_bytes_after_decode'])} | "
                         f"{mb(e['rss_baseline'])} | {mb(e['rss_after_load'])} | {mb(e['rss_after_decode'])} | "
                         f"{e['rss_ratio_after_decode']:.2f} | {mb(e['pss_after_decode'])} | "
                         f"{e['pss_ratio_after_decode']:.2f} | {'yes' if e['rss_met'] else 'no'} / "
                         f"{'yes' if e['pss_met'] else 'no'} | {mb(e['rss_before_model_code'])} |")
        return "\n".join(lines) + "\n"
    lines = ["# Decode speed before / after the packed weights replaced the plain ones", "", head, "",
             "`bench/bench_memory.py --speed OLD NEW`: SmolLM2-135M, tp=1, 1 thread, lean path, greedy, "
             f"{res['speed'][0].get('tokens', 32)} new tokens after a 3-token warm-up; each measurement a fresh process, "
             "the two trees alternating (ABAB, then BABA). ms/token = the decode's mean; best step = the fastest "
             "step (least disturbed by the load).", "",
             "| tree | dtype | ms/token per round | median ms/token | median best step ms |", "|---|---|---|---|---|"]
    for r in res["speed"]:
        lines.append(f"| {r['tree']} | {r['dtype']} | {', '.join(f'{x:.1f}' for x in r['ms_per_token'])} | "
                     f"{r['median_ms']:.1f} | {r['median_best_step_ms']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["smollm2"], help="smollm2 and/or tinyllama-random")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--speed", nargs=2, metavar=("OLD", "NEW"), help="two checkouts to time instead")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", default=None, help="JSON file to write")
    a = ap.parse_args()
    import torch
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "torch": torch.__version__,
            "cpu": _cpu(), "cpus": os.cpu_count(), "load_start": os.getloadavg()}
    if a.speed:
        res = {"speed": speed(a.speed, a.dtypes, a.rounds, a.tokens)}
    else:
        res = {"memory": memory(a.model, a.dtypes, a.tp)}
    meta["load_end"] = os.getloadavg()
    res["meta"] = meta
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
        Path(a.out).with_suffix(".md").write_text(render(res))


if __name__ == "__main__":
    main()
