"""Resident memory per tensorpar rank (issue 28, item 4) and the decode speed of two code trees, on the CPU.

Memory (default): for each ``--model`` / ``--dtypes`` / ``--tp``, the lean decode of ``bench_decode.job_tp`` with its
memory rows: each rank's RSS and PSS (/proc/self/smaps_rollup) before the model is built (the baseline), after load,
and after a greedy decode of 32 tokens, against 1.1 x shard bytes + baseline; and the bytes of the distinct tensors
the model holds (``resident_weight_bytes``, oneDNN-packed tensors included).

Speed (``--speed``): the one decode-step change of the packed layout, in one process: SmolLM2's tied LM head on
the plain table (now) against a packed copy (before), the rest of the step the same (:func:`speed`).

    PYTHONPATH=. python bench/bench_memory.py --model smollm2 tinyllama-random
    PYTHONPATH=. python bench/bench_memory.py --speed --out bench/results/memory_speed.json
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


def speed(dtypes, rounds: int, steps: int) -> list[dict]:
    """The one decode-step change of the packed layout, timed in one process: SmolLM2 (tied LM head) at tp=1, 1
    thread, the lean decoder's LM head on the plain table (``F.linear``, now: one copy) against a packed copy of it
    (``packed_linear``, as before: a second copy of the table); every other matmul of the step is the same call on
    the same packed tensors in both. Blocks of ``steps`` decode steps, the two alternating (ABAB, then BABA)."""
    import torch

    from tensorpar.decode.kernels import pack, packed_linear
    from tensorpar.decode.lean import LeanDecoder
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.hub import resolve_model
    from tensorpar.parallel import ParallelContext
    torch.set_num_threads(1)
    ctx = ParallelContext.single()
    out = []
    for dtype in dtypes:
        model, _ = build_parallel_model(str(resolve_model("smollm2")), ctx.tp, dtype=getattr(torch, dtype))
        for batch in (1, 8):
            lean = LeanDecoder(model, ctx.tp, max_batch=batch, max_len=12 + 2 * rounds * steps)
            heads = {"plain head (now)": (lean.lm_w, lean.linear),
                     "packed head (before)": (pack(lean.lm_w), packed_linear)}
            ids = torch.randint(0, 1000, (batch, 8), generator=torch.Generator().manual_seed(0))
            tok = lean.prefill(ids, torch.ones_like(ids), torch.arange(8).expand(batch, 8)).argmax(-1, keepdim=True)
            t, times = 8, {k: [] for k in heads}
            for r in range(rounds):
                for name in (list(heads) if r % 2 == 0 else list(heads)[::-1]):
                    lean.lm_w, lean.linear = heads[name]
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        tok = lean.decode(tok, torch.full((batch, 1), t), t).argmax(-1, keepdim=True)
                        times[name].append(time.perf_counter() - t0)
                        t += 1
            for name, v in times.items():
                out.append({"dtype": dtype, "batch": batch, "head": name, "steps": len(v),
                            "median_ms": statistics.median(v) * 1e3, "min_ms": min(v) * 1e3})
                print(f"{dtype} batch {batch} {name}: median {out[-1]['median_ms']:.1f} ms, min "
                      f"{out[-1]['min_ms']:.1f} ms", flush=True)
            del lean, heads
        del model
    return out


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
    lines = ["# SmolLM2 decode step: tied LM head plain (one copy) against packed (a second copy)", "", head, "",
             "`bench/bench_memory.py --speed`: " + " ".join(speed.__doc__.split()), "",
             "| dtype | batch | LM head | steps | median ms/step | fastest ms/step |", "|---|---|---|---|---|---|"]
    for r in res["speed"]:
        lines.append(f"| {r['dtype']} | {r['batch']} | {r['head']} | {r['steps']} | {r['median_ms']:.1f} | "
                     f"{r['min_ms']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["smollm2"], help="smollm2 and/or tinyllama-random")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--speed", action="store_true", help="time the tied LM head plain against packed instead")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6, help="decode steps per block (--speed)")
    ap.add_argument("--out", default=None, help="JSON file to write")
    a = ap.parse_args()
    import torch
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "torch": torch.__version__,
            "cpu": _cpu(), "cpus": os.cpu_count(), "load_start": os.getloadavg()}
    if a.speed:
        res = {"speed": speed(a.dtypes, a.rounds, a.steps)}
    else:
        res = {"memory": memory(a.model, a.dtypes, a.tp)}
    meta["load_end"] = os.getloadavg()
    res["meta"] = meta
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
        Path(a.out).with_suffix(".md").write_text(render(res))


if __name__ == "__main__":
    main()
