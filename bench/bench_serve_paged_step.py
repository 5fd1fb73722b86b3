"""One 32-row decode step of the serve engine (no HTTP, no scheduler) on serve's paged KV pool against the static
cache, at the row positions of a step recorded inside `tensorpar serve` under bench_serve's load.

`bench/bench_serve_step.py` times the static cache (one block of ``max_len`` per row, read through views);
`tensorpar serve` pages the cache in blocks of 16 (``--block-size``), so each decode step gathers every row's blocks
per layer. This script runs both layouts at the same positions (``STARTS``: the 32 rows of a step rank 0 ran
under the load, 11 to 86 cached positions) with the block tables scattered over a 1024-block pool (as after the
allocator has served many requests), and prints per rank the median wall time and main-thread CPU time
(``time.thread_time``, less disturbed by other jobs) of ``--steps`` steps, and with ``--profile`` rank 0's
``torch.profiler`` table of one step. The cache holds zeros (the timing does not depend on the values).

    PYTHONPATH=. python bench/bench_serve_paged_step.py --steps 12 --profile
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: cached positions of the 32 decode rows of one step rank 0 ran under bench_serve's load (tp=2, fp32)
STARTS = [86, 66, 60, 55, 43, 66, 55, 59, 54, 42, 65, 55, 54, 59, 42, 52, 41, 32, 45, 30, 16, 19, 38, 28, 19, 30, 23,
          11, 14, 34, 23, 40]


def rank_main(folder: str, steps: int, profile: bool, layouts: list[str]) -> int:
    import torch

    from tensorpar.hf.load import build_parallel_model
    from tensorpar.parallel import ParallelConfig, init_parallel
    from tensorpar.serve.engine import Engine
    from tensorpar.serve.plan import Row, StepPlan

    ctx = init_parallel(ParallelConfig(tp=int(os.environ["WORLD_SIZE"])), timeout_s=300, fast_collectives="auto")
    try:
        model, _ = build_parallel_model(folder, ctx.tp, dtype=torch.float32, device=ctx.device)
        n = len(STARTS)
        for name in layouts:
            paged = name == "paged16"
            engine = Engine(model, ctx.tp, max_batch=n, max_len=512,
                            **(dict(block_size=16, num_blocks=1024) if paged else {}))
            perm = list(range(1024))
            random.Random(0).shuffle(perm)
            ts, cs = [], []
            for k in range(steps):
                plan = StepPlan("step", [Row(i, [100 + i], STARTS[i] + k,
                                             blocks=[perm[i * 32 + j] for j in range(32)] if paged else None)
                                         for i in range(n)])
                t0, c0 = time.perf_counter(), time.thread_time()
                if profile and k == steps - 2 and ctx.tp.rank == 0:
                    from torch.profiler import ProfilerActivity, profile as prof
                    with prof(activities=[ProfilerActivity.CPU]) as p:
                        engine.step(plan, None)
                    print(name, p.key_averages().table(sort_by="self_cpu_time_total", row_limit=10), flush=True)
                else:
                    engine.step(plan, None)
                ts.append(time.perf_counter() - t0)
                cs.append(time.thread_time() - c0)
            print(f"rank {ctx.tp.rank} {name}: wall median {statistics.median(ts[2:]) * 1e3:.1f} ms, main thread "
                  f"CPU median {statistics.median(cs[2:]) * 1e3:.1f} ms (min {min(cs[2:]) * 1e3:.1f})", flush=True)
            del engine
    finally:
        ctx.destroy()
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12, help="steps per layout (the first two not counted)")
    ap.add_argument("--layouts", nargs="+", choices=["paged16", "static"], default=["paged16", "static"])
    ap.add_argument("--profile", action="store_true", help="rank 0's torch.profiler table of one step per layout")
    args = ap.parse_args()
    if args.steps < 3:
        ap.error(f"--steps must be >= 3 (the first two are warm-up), got {args.steps}")
    from tensorpar.hub import resolve_model
    from tensorpar.launch import run_ranks
    return run_ranks(rank_main, args.tp, str(resolve_model(args.model)), args.steps, args.profile, args.layouts)


if __name__ == "__main__":
    sys.exit(main())
