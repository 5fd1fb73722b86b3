"""ms per call of ``--quantize bf16``'s matmul above the GEMV's rows (bf16 weights ``[N, K]``, fp32 input ``[M, K]``,
fp32 output) at the 1.1B Llama's and SmolLM2-135M's shapes (tp=1: fused QKV, o_proj, fused gate-up, down, LM head;
bench_gemv's ``shapes``) and M = 4, 16, 32, 512 rows, one thread, interleaved per repeat:

- ``whole``: ``F.linear(x, W.float())``, the whole weight converted per call (bf16_linear before the chunks);
- ``chunked``: :func:`tensorpar.decode.bf16_weights.chunked_linear` (at most ``_CHUNK_ELEMS`` weights converted
  at a time into one buffer, ``addmm`` per chunk into the output's columns);
- ``gemv``: our GEMV's bf16-weight entry (:func:`tensorpar.decode.gemv_kernel.bf16w_linear`, the weights widened in
  registers; more than 4 rows in groups of 4 over L2-sized chunks of weight rows).

ms = median of ``--repeats`` by wall time and by the thread's CPU time (``time.thread_time``: on the shared machine
it counts less of the other processes' load). A run whose 1-minute load average reached 1 is labelled loaded.
Results: ``--out`` (default bench/results/bf16_batch).{md,json}, with bench/machine.py's ``write_results``.

    PYTHONPATH=. python bench/bench_bf16_batch.py [--rows 4 16 32 512] [--repeats 3] [--models llama smollm2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench_gemv import shapes  # noqa: E402
from machine import machine, write_results  # noqa: E402

from tensorpar.decode import gemv_kernel  # noqa: E402
from tensorpar.decode.bf16_weights import chunked_linear  # noqa: E402

VARIANTS = {"whole": lambda x, w: F.linear(x, w.float()), "chunked": chunked_linear,
            "gemv": lambda x, w: gemv_kernel.bf16w_linear(x, w, None)}


def timed(fn, x, w) -> tuple[float, float]:
    """(wall ms, thread CPU ms) of one call."""
    t0, c0 = time.perf_counter(), time.thread_time()
    fn(x, w)
    return (time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 16, 32, 512])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", nargs="+", default=["llama", "smollm2"])
    ap.add_argument("--out", default="bench/results/bf16_batch")
    args = ap.parse_args()
    torch.set_num_threads(1)
    variants = [v for v in VARIANTS if v != "gemv" or gemv_kernel.available()]
    m0, top, rows = machine(), os.getloadavg()[0], []
    g = torch.Generator().manual_seed(0)
    for model in args.models:
        for name, n, k in shapes(1, model):
            w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
            for m in args.rows:
                x = torch.randn(m, k, generator=g)
                for fn in VARIANTS.values():
                    if fn is not VARIANTS["gemv"] or "gemv" in variants:
                        fn(x, w)                                                            # warm up
                times = {v: [] for v in variants}
                for r in range(args.repeats):
                    for v in (variants if r % 2 == 0 else variants[::-1]):
                        times[v].append(timed(VARIANTS[v], x, w))
                    top = max(top, os.getloadavg()[0])
                row = dict(model=model, matrix=name, n=n, k=k, m=m)
                for v in variants:
                    row[f"{v}_ms"] = statistics.median(t[0] for t in times[v])
                    row[f"{v}_cpu_ms"] = statistics.median(t[1] for t in times[v])
                rows.append(row)
                print(row, flush=True)
    meta = dict(machine=m0, machine_end=machine(), torch=torch.__version__, threads=1, repeats=args.repeats,
                loaded=top >= 1.0, load_top=top)
    lines = [f"# bf16 weights, fp32 input: ms per call above the GEMV's rows (1 thread, median of {args.repeats}"
             + (f", loaded: 1-minute load average up to {top:.1f})" if meta["loaded"] else ")"),
             "", f"CPU: {m0['cpu']}, {m0['cores']} cores; load at start {m0['loadavg']}, at end "
             f"{meta['machine_end']['loadavg']}; torch {torch.__version__}. bench/bench_bf16_batch.py. ms by the "
             "thread's CPU time (wall in brackets); the best per row in bold.", "",
             "| model | matrix | N x K | M | " + " | ".join(variants) + " |",
             "|---|---|---|---|" + "---|" * len(variants)]
    for r in rows:
        best = min(variants, key=lambda v: r[f"{v}_cpu_ms"])
        cells = [(f"**{r[f'{v}_cpu_ms']:.2f}**" if v == best else f"{r[f'{v}_cpu_ms']:.2f}")
                 + f" ({r[f'{v}_ms']:.2f})" for v in variants]
        lines.append(f"| {r['model']} | {r['matrix']} | {r['n']}x{r['k']} | {r['m']} | " + " | ".join(cells) + " |")
    write_results(Path(args.out), meta, rows, lines)


if __name__ == "__main__":
    main()
