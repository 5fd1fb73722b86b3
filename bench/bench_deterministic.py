"""The throughput cost of ``tensorpar serve --deterministic`` (batch-invariant results), engine only (no HTTP).

Per mode (``off``: the default engine; ``on``: ``Engine(deterministic=True)``), interleaved over ``--rounds``:
``--requests`` greedy requests of ``--max-tokens`` tokens (log-probabilities on) over bench_serve's 8 prompts,
submitted at once to the serve scheduler with ``--max-batch`` slots (a burst: one prefill step, then decode steps
of up to ``--max-batch`` rows), then each of the 8 prompts alone. Measured on rank 0: output tokens/s over the
burst, median prefill and decode step times of the burst, median decode step time alone, each also as rank 0's
CPU time (``time.thread_time`` of the scheduler thread: on a machine shared with other jobs the wall times
include waiting for a core, the CPU times much less so; the collectives are gloo's by default, whose waits
block); and how many of the 8 prompts get, in the burst, bitwise the tokens and log-probabilities they get alone
(``same bits``). The load average at start and end is recorded. Results:
bench/results/serve_deterministic.{md,json} (atomic writes).

    PYTHONPATH=. TENSORPAR_THREADS=1 python bench/bench_deterministic.py --tp 2 --rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_serve import PROMPTS  # noqa: E402
from bench.machine import machine, write_results  # noqa: E402


def _run(engine, ctx, prompts, max_tokens):
    """The requests ``prompts`` submitted at once; rank 0 returns (outputs [(token, logprob)], step times)."""
    from tensorpar.serve.engine import follow
    from tensorpar.serve.scheduler import Request, Scheduler
    if ctx.tp.rank != 0:
        follow(engine)
        return None
    times = {"prefill": [], "decode": [], "prefill_cpu": [], "decode_cpu": []}
    inner = engine.step

    def step(plan, samplers):
        t0, c0 = time.perf_counter(), time.thread_time()
        out = inner(plan, samplers)
        kind = "prefill" if any(r.start == 0 for r in plan.rows) else "decode"
        times[kind].append(time.perf_counter() - t0)
        times[kind + "_cpu"].append(time.thread_time() - c0)
        return out
    engine.step = step
    sched = Scheduler(engine, eos=set(), max_waiting=len(prompts) + 1)
    outs = [[] for _ in prompts]
    left = [len(prompts)]

    def make_emit(i):
        def emit(ev):
            if ev[0] == "token":
                outs[i].append((ev[1], ev[2]))
            elif ev[0] in ("done", "error"):
                left[0] -= 1
                if not left[0]:
                    sched.stop()
        return emit
    t0, c0 = time.perf_counter(), time.thread_time()
    for i, p in enumerate(prompts):
        sched.submit(Request(list(p), max_tokens, make_emit(i), logprobs=0))
    sched.run()
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    engine.step = inner
    return outs, times, wall, cpu


def _job(folder, args, modes, path):
    import torch
    from transformers import AutoTokenizer

    from tensorpar.hf.load import build_parallel_model
    from tensorpar.parallel import ParallelConfig, init_parallel
    from tensorpar.serve.engine import Engine

    world = int(os.environ.get("WORLD_SIZE", "1"))
    ctx = init_parallel(ParallelConfig(tp=world), timeout_s=300, fast_collectives=args.fast_collectives)
    model, _ = build_parallel_model(folder, ctx.tp, dtype=torch.float32, device=ctx.device)
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    burst = [prompts[i % len(prompts)] for i in range(args.requests)]
    med = lambda xs: 1e3 * statistics.median(xs) if xs else float("nan")   # noqa: E731
    rows = []
    for mode in modes:
        engine = Engine(model, ctx.tp, max_batch=args.max_batch, max_len=args.max_len,
                        block_size=16, num_blocks=args.max_batch * -(-args.max_len // 16),
                        deterministic=mode == "on")
        got = _run(engine, ctx, burst, args.max_tokens)
        alone = [_run(engine, ctx, [p], args.max_tokens) for p in prompts]
        if ctx.tp.rank != 0:
            continue
        outs, times, wall, cpu = got
        n = sum(len(o) for o in outs)
        same = sum(outs[i] == alone[i][0][0] for i in range(len(prompts)))
        rows.append(dict(mode=mode, tokens=n, wall_s=wall, out_tok_per_s=n / wall, cpu_s=cpu,
                         out_tok_per_cpu_s=n / cpu,
                         prefill_step_ms_median=med(times["prefill"]), decode_step_ms_median=med(times["decode"]),
                         prefill_step_cpu_ms_median=med(times["prefill_cpu"]),
                         decode_step_cpu_ms_median=med(times["decode_cpu"]),
                         alone_decode_step_ms_median=med([t for a in alone for t in a[1]["decode"]]),
                         alone_decode_step_cpu_ms_median=med([t for a in alone for t in a[1]["decode_cpu"]]),
                         same_bits=same, prompts=len(prompts)))
        print(json.dumps(rows[-1]), flush=True)
    ctx.destroy()
    if ctx.tp.rank == 0:
        with open(path, "w") as f:
            json.dump(rows, f)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of (off, on)")
    ap.add_argument("--fast-collectives", choices=["auto", "on", "off"], default="off",
                    help="off (default): gloo, whose waits block instead of spinning, so rank 0's CPU time is its "
                         "own work")
    ap.add_argument("--out", default="bench/results/serve_deterministic")
    args = ap.parse_args()

    from tensorpar.hub import resolve_model
    from tensorpar.launch import run_ranks
    folder = str(resolve_model(args.model))
    m0 = machine()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    rc = run_ranks(_job, args.tp, folder, args, ["off", "on"] * args.rounds, path)
    if rc != 0:
        raise SystemExit(f"the ranks failed (exit {rc})")
    with open(path) as f:
        rows = json.load(f)
    os.unlink(path)
    load1 = os.getloadavg()
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M:%S"), model=args.model, tp=args.tp, requests=args.requests,
                max_tokens=args.max_tokens, max_batch=args.max_batch, rounds=args.rounds, dtype="float32",
                fast_collectives=args.fast_collectives, threads=os.environ.get("TENSORPAR_THREADS"),
                cpu=m0["cpu"], cores=m0["cores"], load_start=m0["loadavg"][0], load_end=load1[0])
    lines = [f"# serve --deterministic: throughput cost ({meta['date']})", "",
             f"Model {args.model}, fp32, tp={args.tp}, {meta['threads'] or 'default'} thread(s) per rank, "
             f"--fast-collectives {args.fast_collectives}; "
             f"{args.requests} greedy requests of {args.max_tokens} tokens (logprobs on) over bench_serve's 8 "
             f"prompts submitted at once, --max-batch {args.max_batch}; then each prompt alone. {meta['cpu']}, "
             f"{meta['cores']} cores; load average {meta['load_start']:.1f} at start, {meta['load_end']:.1f} at end "
             f"(other jobs share the machine). `same bits`: prompts whose tokens and logprobs in the burst equal "
             f"those alone, bit for bit.", "",
             "Times are wall / rank 0's CPU time.", "",
             "| mode | round | output tok/s (burst) | output tok per CPU s | prefill step ms | decode step ms (burst) "
             "| decode step ms (alone) | same bits |", "|---|---|---|---|---|---|---|---|"]
    for j, r in enumerate(rows):
        lines.append(f"| {r['mode']} | {j // 2 + 1} | {r['out_tok_per_s']:.1f} | {r['out_tok_per_cpu_s']:.1f} | "
                     f"{r['prefill_step_ms_median']:.0f} / {r['prefill_step_cpu_ms_median']:.0f} | "
                     f"{r['decode_step_ms_median']:.1f} / {r['decode_step_cpu_ms_median']:.1f} | "
                     f"{r['alone_decode_step_ms_median']:.1f} / {r['alone_decode_step_cpu_ms_median']:.1f} | "
                     f"{r['same_bits']}/{r['prompts']} |")
    write_results(Path(args.out), meta, rows, lines)


if __name__ == "__main__":
    main()
