"""Time of one `tensorpar serve` engine step (no HTTP, no scheduler) at a full batch, with and without a new prompt,
for the step as one forward (this version) next to one forward per row group (the previous design), same run.

Per tp size and dtype, every rank builds the engine on the model (``--max-batch`` slots), prefills ``--max-batch``
of bench_serve's prompts, then times, interleaved over ``--rounds`` rounds of ``--steps`` steps each:

* ``decode``: every slot decodes one token (one row group; both designs are the same forward);
* ``decode + 1 prompt``: ``max_batch - 1`` decode rows and one of bench_serve's prompts re-prefilled in the last
  slot (two row groups: one forward of all their tokens, or, as before, the prompt's forward then the decodes').

tp = 1 runs one process with ``TENSORPAR_THREADS`` threads (default: the usable cores); tp > 1 one thread per rank.
Rank 0's median step time (ms) is reported; the ranks run the same steps. Results:
bench/results/serve_step.{md,json} (atomic writes) with the load average at start and end.

    PYTHONPATH=. python bench/bench_serve_step.py --tp 1 2 --dtype float32 bfloat16
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_serve import PROMPTS, atomic_write  # noqa: E402


def rank_main(folder: str, dtype: str, max_batch: int, steps: int, rounds: int):
    import torch
    from transformers import AutoTokenizer

    from tensorpar.hf.load import build_parallel_model
    from tensorpar.parallel import ParallelConfig, init_parallel
    from tensorpar.serve.engine import Engine
    from tensorpar.serve.plan import Row, StepPlan

    world = int(os.environ["WORLD_SIZE"])
    ctx = init_parallel(ParallelConfig(tp=world), timeout_s=300, fast_collectives="auto")
    try:
        model, _ = build_parallel_model(folder, ctx.tp, dtype=getattr(torch, dtype), device=ctx.device)
        engine = Engine(model, ctx.tp, max_batch=max_batch, max_len=512)
        tok = AutoTokenizer.from_pretrained(folder)
        prompts = [tok(PROMPTS[i % len(PROMPTS)])["input_ids"] for i in range(max_batch)]
        rank0 = ctx.tp.rank == 0
        one_forward = engine._forward

        def per_group(batches):          # the previous design: one forward per row group
            outs = [one_forward([bt]) for bt in batches]
            return outs[0] if len(outs) == 1 else torch.cat(outs)

        def run(plan):
            engine.exchange(plan if rank0 else None)
            return engine.step(plan, None).tokens

        last = run(StepPlan("step", [Row(i, list(p), 0) for i, p in enumerate(prompts)]))
        lens = [len(p) for p in prompts]
        k = 0
        times = {}

        def timed(name, mixed):
            nonlocal last, k
            ts = []
            for _ in range(steps):
                rows = [Row(i, [last[i]], lens[i] + k) for i in range(max_batch - (1 if mixed else 0))]
                if mixed:
                    rows.append(Row(max_batch - 1, list(prompts[k % len(prompts)]), 0))
                    lens[max_batch - 1] = len(prompts[k % len(prompts)]) - k - 1   # its next decode position
                t0 = time.perf_counter()
                out = run(StepPlan("step", rows))
                ts.append(time.perf_counter() - t0)
                last = out
                k += 1
            times.setdefault(name, []).extend(ts)

        for r in range(rounds + 1):              # round 0 warms up every path
            for design, fwd in (("one forward", one_forward), ("forward per group", per_group)):
                engine._forward = fwd
                for mixed in (False, True):
                    timed((design, "decode + 1 prompt" if mixed else "decode"), mixed)
            if r == 0:
                times.clear()
        engine._forward = one_forward
        return {f"{d}|{c}": statistics.median(v) * 1e3 for (d, c), v in times.items()} if rank0 else None
    finally:
        ctx.destroy()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtype", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10, help="steps per case and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results/serve_step")
    args = ap.parse_args()
    from tensorpar.hub import resolve_model
    from tensorpar.launch import run_ranks, usable_cores

    folder = str(resolve_model(args.model))
    load0 = os.getloadavg()
    rows = []
    import tempfile
    for dtype in args.dtype:
        for tp in args.tp:
            env = dict(os.environ)
            if tp == 1:
                os.environ.setdefault("TENSORPAR_THREADS", str(usable_cores()))
            threads = int(os.environ.get("TENSORPAR_THREADS", usable_cores())) if tp == 1 else 1
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "r.json")
                rc = run_ranks(_entry, tp, path, folder, dtype, args.max_batch, args.steps, args.rounds)
                got = json.load(open(path)) if os.path.exists(path) else None
            os.environ.clear()
            os.environ.update(env)
            if rc != 0 or got is None:
                rows.append(dict(tp=tp, dtype=dtype, error=f"exit {rc}"))
                continue
            rows.append(dict(tp=tp, dtype=dtype, threads=threads, **got))
            print(rows[-1], flush=True)
    load1 = os.getloadavg()
    meta = dict(model=Path(folder).name, max_batch=args.max_batch, steps=args.steps, rounds=args.rounds,
                cpus=os.cpu_count(), loadavg_start=load0, loadavg_end=load1, date=time.strftime("%Y-%m-%d %H:%M:%S"))
    out = Path(args.out)
    atomic_write(out.with_suffix(".json"), json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"# tensorpar serve: one engine step ({meta['date']})", "",
             f"Model {meta['model']}; {args.max_batch} slots; median of {args.steps} x {args.rounds} interleaved steps "
             f"per case on rank 0; {meta['cpus']} CPUs; load average {load0[0]:.1f} at start, {load1[0]:.1f} at "
             f"end. `decode`: {args.max_batch} decode rows. `decode + 1 prompt`: {args.max_batch - 1} decode rows "
             f"and one of bench_serve's prompts prefilled. 'one forward' is this version's step, 'forward per "
             f"group' the previous design (the prompt's forward, then the decodes').", "",
             "| dtype | tp | decode ms (one forward / per group) | decode + 1 prompt ms (one forward / per group) | "
             "a prompt's extra cost, one forward / per group |", "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['dtype']} | {r['tp']} | did not run: {r['error']} | | |")
            continue
        d1, dg = r["one forward|decode"], r["forward per group|decode"]
        m1, mg = r["one forward|decode + 1 prompt"], r["forward per group|decode + 1 prompt"]
        lines.append(f"| {r['dtype']} | {r['tp']}{' (%d threads)' % r['threads'] if r['tp'] == 1 else ''} | "
                     f"{d1:.1f} / {dg:.1f} | {m1:.1f} / {mg:.1f} | +{m1 - d1:.1f} / +{mg - dg:.1f} ms |")
    atomic_write(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


def _entry(path, *args):
    r = rank_main(*args)
    if r is not None:
        with open(path, "w") as f:
            json.dump(r, f)
    return 0


if __name__ == "__main__":
    main()
