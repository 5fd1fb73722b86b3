"""CPU decode attention in bf16 against the same attention on fp32 copies (what tensorpar.decode.lean runs for bf16/fp16
decode on the CPU: the keys and values cast into fp32 buffers allocated once), one thread, same run; also the
same with freshly allocated fp32 copies per call (``.float()``), which depends on the allocator's state.

Shapes: SmolLM2-135M at tp=2 on rank 0 (5 query heads over 2 KV heads, head_dim 64), one query per row, ``--rows``
rows over ``--positions`` cached positions, as the lean path's decode calls it (one call per run of query heads
with its KV head). Also one prefill shape (one row of ``--prompt`` queries, causal), where the lean path keeps the
model dtype. Median microseconds per call over ``--repeats``. Results: bench/results/attention_dtype.{md,json}.

    PYTHONPATH=. python bench/bench_attention_dtype.py
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


def timed(fns, repeats: int) -> list[float]:
    """Median microseconds per call of each of ``fns``, calls interleaved (the first calls of a process allocate
    and fault in fresh memory; interleaving keeps that from landing on one variant)."""
    for _ in range(20):
        for fn in fns:
            fn()
    ts = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            ts[i].append(time.perf_counter() - t0)
    return [statistics.median(t) * 1e6 for t in ts]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--positions", type=int, default=80)
    ap.add_argument("--prompt", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", default="bench/results/attention_dtype")
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    runs, d = [(0, 0, 3), (1, 3, 5)], 64          # SmolLM2 tp=2 rank 0: query heads 0-2 on KV head 0, 3-4 on 1
    bf = torch.bfloat16
    load0 = os.getloadavg()
    rows = []

    def attend(q, k, v):
        return torch.cat([F.scaled_dot_product_attention(q[:, a:b], k[:, j:j + 1], v[:, j:j + 1],
                                                         enable_gqa=b - a > 1) for j, a, b in runs], dim=1)

    for b in args.rows:
        q = torch.randn(b, 5, 1, d).to(bf)
        k, v = torch.randn(b, 2, args.positions, d).to(bf), torch.randn(b, 2, args.positions, d).to(bf)
        kb, vb = torch.empty(k.shape), torch.empty(v.shape)      # the lean path's fp32 buffers, allocated once
        t_bf, t_up, t_fresh = timed([lambda: attend(q, k, v),
                                     lambda: attend(q.float(), kb.copy_(k), vb.copy_(v)).to(bf),
                                     lambda: attend(q.float(), k.float(), v.float()).to(bf)], args.repeats)
        rows.append(dict(case=f"decode, {b} rows x {args.positions} positions", bf16_us=t_bf, fp32_copies_us=t_up))
        rows.append(dict(case=f"decode, {b} rows x {args.positions} positions, fp32 copies freshly allocated",
                         bf16_us=t_bf, fp32_copies_us=t_fresh))
    idx = torch.tensor([0, 0, 0, 1, 1])
    q = torch.randn(1, 5, args.prompt, d).to(bf)
    k, v = torch.randn(1, 2, args.prompt, d).to(bf), torch.randn(1, 2, args.prompt, d).to(bf)
    t_bf, t_up = timed([lambda: F.scaled_dot_product_attention(q, k.index_select(1, idx), v.index_select(1, idx),
                                                               is_causal=True),
                        lambda: F.scaled_dot_product_attention(q.float(), k.index_select(1, idx).float(),
                                                               v.index_select(1, idx).float(), is_causal=True).to(bf)],
                       args.repeats)
    rows.append(dict(case=f"prefill, 1 row x {args.prompt} queries", bf16_us=t_bf, fp32_copies_us=t_up))
    load1 = os.getloadavg()
    meta = dict(torch=torch.__version__, threads=1, loadavg_start=load0, loadavg_end=load1,
                date=time.strftime("%Y-%m-%d %H:%M:%S"))
    out = Path(args.out)
    atomic_write(out.with_suffix(".json"), json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"# CPU attention: bf16 against fp32 copies ({meta['date']})", "",
             f"torch {meta['torch']}, one thread; SmolLM2 tp=2 rank 0 heads (5 query heads over 2 KV heads, head_dim "
             f"64); median of {args.repeats} calls, the two variants interleaved; load average {load0[0]:.1f} at start, {load1[0]:.1f} at end.", "",
             "| case | bf16 us | fp32 copies (casts included) us | bf16 / fp32 copies |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['bf16_us']:.1f} | {r['fp32_copies_us']:.1f} | "
                     f"{r['bf16_us'] / r['fp32_copies_us']:.2f} |")
    atomic_write(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
