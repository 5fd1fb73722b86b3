"""Engine-only serving throughput of `tensorpar serve` (no HTTP): the scheduler and the tp ranks' engine steps on
bench_serve's workload, with the step of this version next to the previous step design, in one run.

Workload (as bench/bench_serve.py): ``--requests`` greedy requests of ``--max-tokens`` tokens over bench_serve's 8
prompts, ``--max-batch`` slots; all requests are submitted at once (a burst: the first step admits ``max_batch``
new prompts, then each finished request's slot is refilled at the next step). Per tp size and round, two modes,
interleaved:

* ``batched`` (this version): the new prompts of a step prefilled in one padded forward
  (:func:`tensorpar.serve.engine.prefill_groups`), and the step plan broadcast as an int64 tensor
  (:meth:`Engine.exchange`, shared memory when ``--fast-collectives`` gives the group the fast path);
* ``per-request`` (the previous design): each new prompt prefilled in its own forward, the plan broadcast with
  ``torch.distributed.broadcast_object_list`` over gloo (pickle, two broadcasts).

Measured on rank 0: output tokens/s over the wall time of the scheduler loop, the plan exchange time per step, and
the median step time of steps with and without prefill. Every greedy output is compared between the modes
(``equal`` column: requests whose tokens are the same in both modes). Results: bench/results/serve_engine.{md,json}
(atomic writes), with the load average at start and end.

    PYTHONPATH=. python bench/bench_serve_engine.py --tp 1 2 --requests 64 --rounds 2
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
from bench.machine import write_results  # noqa: E402


def _old_exchange(engine):
    """The previous Engine.exchange: one pickled object broadcast (torch.distributed.broadcast_object_list)."""
    import torch.distributed as dist

    def exchange(plan):
        if engine.tp.size == 1:
            return plan
        box = [plan]
        dist.broadcast_object_list(box, src=dist.get_global_rank(engine.tp.pg, 0), group=engine.tp.pg)
        return box[0]
    return exchange


def _per_request_step(engine, inner):
    """The previous Engine.step: every prefill row in its own forward, then the decode rows together."""
    from tensorpar.serve.engine import StepResult
    from tensorpar.serve.plan import StepPlan

    def step(plan, samplers):
        rows = plan.rows
        new = [i for i, r in enumerate(rows) if r.start == 0]
        old = [i for i, r in enumerate(rows) if r.start > 0]
        out: dict[int, tuple] = {}
        for i in new:
            res = inner(StepPlan("step", [rows[i]]), None if samplers is None else [samplers[i]])
            out[i] = (res.tokens[0], res.logprobs[0], res.top[0])
        if old:
            res = inner(StepPlan("step", [rows[i] for i in old]),
                        None if samplers is None else [samplers[i] for i in old])
            for j, i in enumerate(old):
                out[i] = (res.tokens[j], res.logprobs[j], res.top[j])
        return StepResult([out[i][0] for i in range(len(rows))], [out[i][1] for i in range(len(rows))],
                          [out[i][2] for i in range(len(rows))])
    return step


def _rank_main(folder, args, modes):
    import torch
    from transformers import AutoTokenizer

    from tensorpar.hf.load import build_parallel_model
    from tensorpar.parallel import ParallelConfig, init_parallel
    from tensorpar.serve.engine import Engine, follow
    from tensorpar.serve.scheduler import Request, Scheduler

    world = int(os.environ.get("WORLD_SIZE", "1"))
    ctx = init_parallel(ParallelConfig(tp=world), timeout_s=300, fast_collectives=args.fast_collectives)
    model, _ = build_parallel_model(folder, ctx.tp, dtype=torch.float32, device=ctx.device)
    engine = Engine(model, ctx.tp, max_batch=args.max_batch, max_len=args.max_len)
    new_step, new_exchange = engine.step, engine.exchange
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    results = []
    for mode in modes:
        engine.step = new_step if mode == "batched" else _per_request_step(engine, new_step)
        exchange = new_exchange if mode == "batched" else _old_exchange(engine)
        times = {"exchange": [], "prefill": [], "decode": []}

        def timed_exchange(plan, _ex=exchange, _t=times):
            t0 = time.perf_counter()
            out = _ex(plan)
            if ctx.tp.rank == 0 and plan.op == "step":
                _t["exchange"].append(time.perf_counter() - t0)
            return out
        engine.exchange = timed_exchange
        if ctx.tp.rank != 0:
            follow(engine)
            continue
        inner = engine.step

        def timed_step(plan, samplers, _inner=inner, _t=times):
            t0 = time.perf_counter()
            out = _inner(plan, samplers)
            _t["prefill" if any(r.start == 0 for r in plan.rows) else "decode"].append(time.perf_counter() - t0)
            return out
        engine.step = timed_step
        sched = Scheduler(engine, eos=set(), max_waiting=args.requests + 1, heartbeat_s=1.0)
        outs: list[list[int]] = [[] for _ in range(args.requests)]
        left = [args.requests]

        def make_emit(i):
            def emit(ev):
                if ev[0] == "token":
                    outs[i].append(ev[1])
                elif ev[0] == "done":
                    left[0] -= 1
                    if left[0] == 0:
                        sched.stop()
            return emit
        t0 = time.perf_counter()
        for i in range(args.requests):
            sched.submit(Request(prompt=list(prompts[i % len(prompts)]), max_tokens=args.max_tokens,
                                 emit=make_emit(i)))
        sched.run()                                   # ends with a "stop" plan: the other ranks return from follow
        wall = time.perf_counter() - t0
        n = sum(len(o) for o in outs)
        med = lambda xs: 1e3 * statistics.median(xs) if xs else float("nan")   # noqa: E731
        results.append(dict(mode=mode, tokens=n, wall_s=wall, out_tok_per_s=n / wall,
                            steps=len(times["prefill"]) + len(times["decode"]),
                            exchange_ms_median=med(times["exchange"]),
                            prefill_step_ms_median=med(times["prefill"]), decode_step_ms_median=med(times["decode"]),
                            decode_step_ms_best=1e3 * min(times["decode"]) if times["decode"] else float("nan"),
                            outputs=outs))
    ctx.destroy()
    return results if ctx.tp.rank == 0 else None


def _job(folder, args, modes, path):
    res = _rank_main(folder, args, modes)
    if res is not None:                 # rank 0
        with open(path, "w") as f:
            json.dump(res, f)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of (batched, per-request)")
    ap.add_argument("--fast-collectives", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--out", default="bench/results/serve_engine")
    args = ap.parse_args()
    if args.requests < 1 or args.rounds < 1 or args.max_batch < 1:
        raise ValueError("--requests, --rounds and --max-batch must be >= 1")

    from tensorpar.hub import resolve_model
    from tensorpar.launch import run_ranks
    folder = str(resolve_model(args.model))
    load0 = os.getloadavg()
    modes = ["batched", "per-request"] * args.rounds
    rows = []
    for tp in args.tp:
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        rc = run_ranks(_job, tp, folder, args, modes, path)
        with open(path) as f:
            res = json.load(f) if rc == 0 else []
        os.unlink(path)
        if rc != 0:
            raise SystemExit(f"tp={tp}: the ranks failed (exit {rc})")
        ref = {i: o for r in res if r["mode"] == "batched" for i, o in enumerate(r["outputs"])}
        for r in res:
            r["equal"] = sum(o == ref[i] for i, o in enumerate(r.pop("outputs")))
            r["tp"] = tp
            rows.append(r)
            print(json.dumps(r), flush=True)
    load1 = os.getloadavg()
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M:%S"), model=args.model, requests=args.requests,
                max_tokens=args.max_tokens, max_batch=args.max_batch, rounds=args.rounds,
                fast_collectives=args.fast_collectives, threads=os.environ.get("TENSORPAR_THREADS"),
                cpus=os.cpu_count(), load_start=load0[0], load_end=load1[0])
    lines = [f"# tensorpar serve engine-only throughput ({meta['date']})", "",
             f"Model {args.model}; {args.requests} greedy requests of {args.max_tokens} tokens over bench_serve's "
             f"8 prompts, all submitted at once; --max-batch {args.max_batch}; --fast-collectives "
             f"{args.fast_collectives}; {meta['cpus']} CPUs; load average {load0[0]:.1f} at start, {load1[0]:.1f} at "
             f"end (other jobs share the machine). Modes interleaved per round; `equal`: requests whose tokens equal "
             f"the batched mode's of the same round index.", "",
             "| tp | mode | round | output tok/s | steps | exchange ms (median) | prefill step ms (median) | "
             "decode step ms (median / best) | equal |", "|---|---|---|---|---|---|---|---|---|"]
    for tp in args.tp:
        mine = [r for r in rows if r["tp"] == tp]
        for j, r in enumerate(mine):
            lines.append(f"| {tp} | {r['mode']} | {j // 2 + 1} | {r['out_tok_per_s']:.1f} | {r['steps']} | "
                         f"{r['exchange_ms_median']:.2f} | {r['prefill_step_ms_median']:.0f} | "
                         f"{r['decode_step_ms_median']:.0f} / {r['decode_step_ms_best']:.0f} | "
                         f"{r['equal']}/{args.requests} |")
    write_results(Path(args.out), meta, rows, lines)


if __name__ == "__main__":
    main()
