"""bf16 x bf16 matmuls of a bf16 model (``--dtype bfloat16``) per layout, one thread: where the bf16 blocked layout's
GEMV pays, against oneDNN's bf16 GEMM.

The 1.1B Llama's tp=2 matrices (QKV 1280 x 2048, O 2048 x 1024, gate-up 5632 x 2048, down 2048 x 2816), several
random copies each so that the weights come from memory:

1. one and four input rows, GB/s of weights read: our GEMV on the plain bf16 weight (``gemv_kernel.linear``,
   ``vdpbf16ps``), our GEMV on the bf16 blocked layout as ``bf16_linear`` runs it (``bf16_blocked_linear``:
   ``vdpbf16ps`` on pairs of inputs, the output rounded to bf16), the same layout's fp32 path
   (``bf16w_blocked_linear`` on the input widened to fp32: the weights widened, fp32 FMAs; what bf16 models ran
   before 2026-12-04 late), oneDNN on weights prepacked for the rows (``kernels.pack``);
2. 4 to 128 rows, ms per layer (the four matrices): ``F.linear`` on the plain weights, oneDNN on weights prepacked
   for the rows, our blocked GEMV (pairs), its fp32 path, and ``chunked_linear`` (the blocked weights converted
   back by ``tp_unblock_bf16`` in chunks, then ``F.linear``).

    PYTHONPATH=.:bench python bench/bench_bf16_act_gemv.py [--copies 6] [--out bench/results/gemv-bf16act]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

SHAPES = {"qkv": (1280, 2048), "o": (2048, 1024), "gate-up": (5632, 2048), "down": (2048, 2816)}


def best_ms(fn, reps: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--copies", type=int, default=6, help="random copies of each matrix, cycled")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "gemv-bf16act"))
    a = p.parse_args()
    if a.copies < 1:
        p.error(f"--copies {a.copies}: need at least 1 copy of each matrix")
    from machine import cpu_account, describe, machine, other_work, write_results

    from tensorpar.decode import bf16_weights as bw
    from tensorpar.decode import gemv_kernel as gk
    from tensorpar.decode.kernels import pack, packed_linear
    if not gk.available():
        p.error("our GEMV does not run here (no AVX-512 BF16 / AVX2 + FMA, or no compiler)")
    torch.set_num_threads(1)

    def widened(x, w):          # the blocked layout's fp32 path: the weights widened, fp32 FMAs, rounded once
        return gk.bf16w_blocked_linear(x.float(), w.w, w.n, None).to(torch.bfloat16)

    start, acc0 = machine(), cpu_account()
    weights = {name: [torch.randn(n, k).bfloat16() for _ in range(a.copies)] for name, (n, k) in SHAPES.items()}
    blocked = {name: [bw.Bf16Weight(bw.block_bf16(w), torch.bfloat16, w.shape[0]) for w in ws]
               for name, ws in weights.items()}
    rows_out, lines = [], []
    lines += ["| rows | matrix | plain, our GEMV GB/s | blocked, our GEMV GB/s | blocked, fp32 FMAs GB/s "
              "| oneDNN prepacked GB/s |", "|---|---|---|---|---|---|"]
    for m in (1, 4):
        for name, ws in weights.items():
            x = torch.randn(m, ws[0].shape[1]).bfloat16()
            packed = [pack(w, m) for w in ws]
            nbytes = ws[0].numel() * 2 * len(ws)
            plain = best_ms(lambda: [gk.linear(x, w, None) for w in ws])
            ours = best_ms(lambda: [bw.bf16_linear(x, w) for w in blocked[name]])
            fma = best_ms(lambda: [widened(x, w) for w in blocked[name]])
            dnn = best_ms(lambda: [packed_linear(x, w, None) for w in packed])
            r = dict(rows=m, matrix=name, plain_gbs=nbytes / plain / 1e6, blocked_gbs=nbytes / ours / 1e6,
                     fma_gbs=nbytes / fma / 1e6, onednn_gbs=nbytes / dnn / 1e6)
            rows_out.append(r)
            lines.append(f"| {m} | {name} | {r['plain_gbs']:.1f} | {r['blocked_gbs']:.1f} | {r['fma_gbs']:.1f} "
                         f"| {r['onednn_gbs']:.1f} |")
    lines += ["", "| rows | F.linear, plain weights ms / layer | oneDNN prepacked ms / layer "
              "| our blocked GEMV ms / layer | blocked, fp32 FMAs ms / layer | chunks converted back ms / layer |",
              "|---|---|---|---|---|---|"]
    for m in (4, 8, 16, 32, 64, 128):
        tot = [0.0] * 5
        for name, ws in weights.items():
            x = torch.randn(m, ws[0].shape[1]).bfloat16()
            packed = [pack(w, m) for w in ws]
            fns = [lambda: [F.linear(x, w) for w in ws], lambda: [packed_linear(x, w, None) for w in packed],
                   lambda: [bw.bf16_linear(x, w) for w in blocked[name]],
                   lambda: [widened(x, w) for w in blocked[name]],
                   lambda: [bw.chunked_linear(x, w) for w in blocked[name]]]
            for i, fn in enumerate(fns):
                tot[i] += best_ms(fn) / len(ws)
            del packed
        rows_out.append(dict(rows=m, linear_ms=tot[0], onednn_ms=tot[1], blocked_ms=tot[2], fma_ms=tot[3],
                             chunks_ms=tot[4]))
        lines.append(f"| {m} | " + " | ".join(f"{t:.2f}" for t in tot) + " |")
    work = other_work(acc0, cpu_account())
    end = machine()
    head = [f"bf16 x bf16 matmuls, the 1.1B Llama's tp=2 shapes, {a.copies} copies each cycled, one thread, best of 3; "
            f"{start['cpu']}, {start['cores']} cores, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}; "
            f"load average at start {start['loadavg'][0]:.2f}, at end {end['loadavg'][0]:.2f}; {describe(work)}.", ""]
    write_results(Path(a.out), dict(copies=a.copies, machine_start=start, machine_end=end, other_work=work),
                  rows_out, head + lines)


if __name__ == "__main__":
    main()
