"""fp32 decode matmuls on the CPU: ``torch.mm`` (MKL, what the lean path ran before) against oneDNN on weights
prepacked once for the row count (``torch.ops.mkldnn._linear_pointwise`` after ``_reorder_linear_weight(w, rows)``
through :func:`tensorpar.decode.kernels.pack`, as the decoder packs them for its rows), one thread, interleaved in
one run.

Weights: one tp=2 rank's share of SmolLM2-135M's 30 layers (fused QKV 480x576, output 576x320, fused gate-up
1536x576, down 576x768) and its LM head half (24576x576), all distinct, so they are read from memory as in a decode
step (259 MiB fp32). For each row count: milliseconds to run all of them once (median of ``--repeats``) and the
arithmetic rate. Results: bench/results/matmul_pack.{md,json}.

    PYTHONPATH=. python bench/bench_matmul_pack.py
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

from bench.bench_serve import atomic_write  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 12, 32, 44])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="bench/results/matmul_pack")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    ws = []
    for _ in range(30):
        ws += [torch.randn(o, i, generator=g) for o, i in ((480, 576), (576, 320), (1536, 576), (576, 768))]
    ws.append(torch.randn(24576, 576, generator=g))
    from tensorpar.decode.kernels import pack
    wt = [w.t() for w in ws]
    load0 = os.getloadavg()
    rows = []
    for m in args.rows:
        xs = {i: torch.randn(m, i, generator=g) for i in {w.shape[1] for w in ws}}
        packed = [pack(w, m) for w in ws]        # the layout oneDNN picks for m rows (packed for 1 row before)

        def mm():
            for w in wt:
                torch.mm(xs[w.shape[0]], w)

        def onednn():
            for w, p in zip(ws, packed):
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

        times = {"mm": [], "onednn": []}
        for _ in range(2):
            mm()
            onednn()
        for _ in range(args.repeats):
            for name, fn in (("mm", mm), ("onednn", onednn)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        flops = 2 * m * sum(w.numel() for w in ws)
        t_mm, t_dnn = statistics.median(times["mm"]), statistics.median(times["onednn"])
        rows.append(dict(rows=m, mm_ms=t_mm * 1e3, onednn_ms=t_dnn * 1e3, mm_gflops=flops / t_mm / 1e9,
                         onednn_gflops=flops / t_dnn / 1e9))
    load1 = os.getloadavg()
    meta = dict(torch=torch.__version__, threads=1, weights_mib=sum(w.numel() for w in ws) * 4 / 2 ** 20,
                loadavg_start=load0, loadavg_end=load1, date=time.strftime("%Y-%m-%d %H:%M:%S"))
    out = Path(args.out)
    atomic_write(out.with_suffix(".json"), json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"# fp32 decode matmuls: torch.mm against prepacked oneDNN ({meta['date']})", "",
             f"torch {meta['torch']}, one thread; one tp=2 rank's SmolLM2 matmul weights ({meta['weights_mib']:.0f} "
             f"MiB fp32, 121 matrices) run once per measurement, median of {args.repeats}, the two interleaved; load "
             f"average {load0[0]:.1f} at start, {load1[0]:.1f} at end.", "",
             "| rows | torch.mm ms | oneDNN prepacked ms | torch.mm GFLOP/s | oneDNN GFLOP/s | speedup |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rows']} | {r['mm_ms']:.1f} | {r['onednn_ms']:.1f} | {r['mm_gflops']:.0f} | "
                     f"{r['onednn_gflops']:.0f} | {r['mm_ms'] / r['onednn_ms']:.2f}x |")
    atomic_write(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
