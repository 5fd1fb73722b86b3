"""oneDNN's batch-size hint when the lean path packs weights (:func:`tensorpar.decode.kernels.pack`): a decode
step's matmuls on weights packed for one row (before 2026-12-03) against packed for the step's rows, ``F.linear``
on the plain weights and (bf16, up to 4 rows) our GEMV, one thread, interleaved per repeat.

Weights: the 1.1B Llama's 22 layers at tp=1 (fused QKV 2560x2048, output 2048x2048, fused gate-up 11264x2048, down
2048x5632), all distinct, so a step reads them from memory as decode does (1.9 GB in bf16). For each row count:
milliseconds to run all 88 once (median of ``--repeats``), and whether each packed layout gives ``F.linear``'s bits
(one layer's shapes). Also the time to give the weights back (``to_dense`` of every packed matrix: what
``generate_tokens`` does after its last step when it packed them). Rows: a decode step's 1-64 and a 512-token
prefill (4 layers only, the rest scaled: compute-bound).

    PYTHONPATH=. .venv/bin/python bench/bench_pack_hint.py [--dtypes bfloat16 float32] [--repeats 3] \\
        [--out bench/results/pack_hint]

Writes OUT.json and OUT.md with the CPU model and the other work on the machine during the run.
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

from machine import cpu_account, describe, machine, other_work, write_results  # noqa: E402

LAYER = ((2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632))
LAYERS = 22
PREFILL = 512
PREFILL_LAYERS = 4


def _time(fn, xs, ws) -> float:
    t0 = time.perf_counter()
    for w in ws:
        fn(xs[w[1]], w[0])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, PREFILL])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "pack_hint"))
    a = ap.parse_args()
    from tensorpar.decode import gemv_kernel
    torch.set_num_threads(1)
    cpu0, t_start = cpu_account(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    g = torch.Generator().manual_seed(0)
    packed_mm = lambda x, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")  # noqa: E731
    rows_out = []
    for dtype_name in a.dtypes:
        dtype = getattr(torch, dtype_name)
        plain = [(torch.randn(o, i, generator=g).to(dtype), i) for _ in range(LAYERS) for o, i in LAYER]
        for m in a.rows:
            n_layers = PREFILL_LAYERS if m >= PREFILL else LAYERS
            ws = plain[:4 * n_layers]
            scale = LAYERS / n_layers
            xs = {i: torch.randn(m, i, generator=g).to(dtype) for i in (2048, 5632)}
            hints = sorted({1, m if dtype == torch.float32 else max(m, 4)})
            cfgs = {f"packed for {h} row{'s' if h > 1 else ''}": (packed_mm, h) for h in hints}
            cfgs["F.linear"] = (lambda x, w: F.linear(x, w), None)
            if dtype == torch.bfloat16 and m <= 4 and gemv_kernel.available():
                cfgs["our GEMV"] = (lambda x, w: gemv_kernel.gemv_raw(x, w, None), None)
            packs = {h: [(torch.ops.mkldnn._reorder_linear_weight(w, h), i) for w, i in ws] for h in hints}
            bits = {}
            for h in hints:                 # one layer's shapes: the packed layout against F.linear's bits
                bits[h] = all(torch.equal(packed_mm(xs[i], packs[h][k][0]), F.linear(xs[i], w))
                              for k, (w, i) in enumerate(ws[:4]))
            times = {c: [] for c in cfgs}
            for rep in range(a.repeats + 1):                    # the first round warms up, not counted
                for c in (list(cfgs) if rep % 2 == 0 else list(cfgs)[::-1]):
                    fn, h = cfgs[c]
                    t = _time(fn, xs, packs[h] if h is not None else ws) * scale
                    if rep:
                        times[c].append(t)
            undo = None
            if m == 16 and dtype == torch.bfloat16:             # giving the weights back, as generate's settle does
                t0 = time.perf_counter()
                for p, _ in packs[max(m, 4)]:
                    p.to_dense()
                undo = time.perf_counter() - t0
            row = {"dtype": dtype_name, "rows": m, "ms": {c: statistics.median(v) * 1e3 for c, v in times.items()},
                   "bitwise_f_linear": {str(h): b for h, b in bits.items()}, "unpack_s": undo}
            rows_out.append(row)
            print(row, flush=True)
            del packs
    meta = {**machine(), "started": t_start, "repeats": a.repeats, "other_work": other_work(cpu0, cpu_account())}
    lines = ["# oneDNN's pack hint: a decode step's matmuls, 1.1B Llama tp=1 shapes, one thread", "",
             f"{meta['cpu']}, {meta['cores']} cores, torch {torch.__version__}, {t_start}; "
             f"{describe(meta['other_work'])}. ms to run the 22 layers' 88 matmuls once (median of {a.repeats} "
             f"interleaved repeats; the {PREFILL}-row prefill: {PREFILL_LAYERS} layers, scaled to 22). bits: the "
             "packed layout's outputs equal F.linear's (one layer's shapes).", "",
             "| dtype | rows | configuration | ms per step | bits = F.linear |", "|---|---:|---|---:|---|"]
    for r in rows_out:
        for c, ms in r["ms"].items():
            h = c.split("for ")[1].split()[0] if c.startswith("packed") else None
            lines.append(f"| {r['dtype']} | {r['rows']} | {c} | {ms:.1f} | "
                         f"{'' if h is None else ('yes' if r['bitwise_f_linear'][h] else 'no')} |")
    for r in rows_out:
        if r["unpack_s"] is not None:
            lines += ["", f"Giving the weights back (to_dense of all 88 packed {r['dtype']} matrices, packed for "
                          f"{max(r['rows'], 4)} rows): {r['unpack_s']:.2f} s."]
    write_results(Path(a.out), meta, rows_out, lines)


if __name__ == "__main__":
    main()
