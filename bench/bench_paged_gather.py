"""What reading scattered KV blocks costs on the CPU: one decode attention of a layer (SmolLM2-135M's shapes at
tp=2 on rank 0: 5 query heads, 2 KV heads, head_dim 64, fp32) with the rows' positions read as a view of the
static cache (one block of ``max_len`` per row, consecutive) against gathered from 16-position blocks scattered
over the pool (:meth:`tensorpar.decode.kv_cache.LeanKVCache._gathered`, one ``index_select`` per layer for keys and
one for values). Median of ``--repeats`` calls, one thread. Results: bench/results/paged_gather.md.

    PYTHONPATH=. python bench/bench_paged_gather.py
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tensorpar.decode.kv_cache import LeanKVCache


def median_ms(fn, repeats):
    for _ in range(5):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", default="bench/results/paged_gather.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    nq, nkv, d, max_len, bs = 5, 2, 64, 1024, 16
    rows = []
    for b, length in ((1, 256), (8, 256), (32, 256), (32, 1000), (64, 256)):
        static = LeanKVCache(1, b, nkv, max_len, d, max_batch=b, max_len=max_len, dtype=torch.float32,
                             device=torch.device("cpu"))
        nb = -(-length // bs)
        paged = LeanKVCache(1, b * nb * 2, nkv, bs, d, max_batch=b, max_len=max_len, dtype=torch.float32,
                            device=torch.device("cpu"))
        g = torch.Generator().manual_seed(0)
        static.kcache.normal_(generator=g)
        paged.kcache.normal_(generator=g)
        table = torch.randperm(b * nb * 2, generator=g)[:b * nb].view(b, nb)       # scattered blocks
        q = torch.randn(b, nq, 1, d, generator=g)
        idx = torch.tensor([0, 0, 0, 1, 1])

        def view():
            k = static.k[0][:, :b, :length].transpose(0, 1)
            v = static.v[0][:, :b, :length].transpose(0, 1)
            return F.scaled_dot_product_attention(q, k.index_select(1, idx), v.index_select(1, idx))

        def gathered():
            flat = table.reshape(-1)
            k = paged._gathered(paged.k[0], flat, b, length)
            v = paged._gathered(paged.v[0], flat, b, length)
            return F.scaled_dot_product_attention(q, k.index_select(1, idx), v.index_select(1, idx))

        def gather_only():
            flat = table.reshape(-1)
            paged._gathered(paged.k[0], flat, b, length)
            paged._gathered(paged.v[0], flat, b, length)

        rows.append((b, length, median_ms(view, args.repeats), median_ms(gathered, args.repeats),
                     median_ms(gather_only, args.repeats)))
        print(rows[-1], flush=True)
    la = os.getloadavg()
    lines = ["# Reading scattered KV blocks: gathered vs a view (one layer's decode attention)", "",
             f"SmolLM2-135M's rank-0 shapes at tp=2 (5 query heads, 2 KV heads, head_dim 64), fp32, one thread, "
             f"blocks of {bs} positions in random order over a pool twice the size needed; median of "
             f"{args.repeats} calls; load average {la[0]:.1f} (the machine is shared with other jobs: absolute times "
             f"are inflated, the ratio is the result). A SmolLM2 step runs this once per layer (30 layers).", "",
             "| rows | positions | view ms | gathered ms | of which the gather ms |", "|---|---|---|---|---|"]
    lines += [f"| {b} | {n} | {a:.3f} | {g_:.3f} | {o:.3f} |" for b, n, a, g_, o in rows]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
