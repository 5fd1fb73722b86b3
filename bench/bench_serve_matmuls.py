"""The matmuls of a 32-row serving step of SmolLM2 at tp=2 on one core (rank 0's shapes), fp32, one thread: GFLOP/s of
``F.linear`` (MKL) and of oneDNN on prepacked weights (what the lean decoder's layers use at 32 rows), the tied LM
head also in vocabulary chunks, and a large GEMM as the core's near-peak rate. Used to bound what a serving step
can gain here (docs/benchmarks.md). Results: ``OUT.{md,json}`` with the CPU model and the load at start and end.

    PYTHONPATH=. python bench/bench_serve_matmuls.py [--rows 32] [--out bench/results/serve_matmuls]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

#: rank 0 of SmolLM2-135M at tp=2: (name, in, out); the LM head is the vocabulary half of the tied embedding
SHAPES = [("qkv", 576, 576), ("o_proj", 320, 576), ("gate_up", 576, 1536), ("down_proj", 768, 576),
          ("lm_head", 576, 24576)]


def median_s(fn, n: int = 21) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "serve_matmuls"))
    args = ap.parse_args()
    from tensorpar.decode.kernels import pack, packed_linear
    torch.set_num_threads(1)
    load0 = os.getloadavg()
    m, rows = args.rows, []
    g = torch.Generator().manual_seed(0)
    for name, k, n in SHAPES:
        x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
        wp, fl = pack(w), 2 * m * k * n
        row = {"shape": name, "in": k, "out": n, "linear_ms": median_s(lambda: F.linear(x, w)) * 1e3,
               "packed_ms": median_s(lambda: packed_linear(x, wp, None)) * 1e3}
        if name == "lm_head":
            out = torch.empty(m, n)

            def chunked():
                for a in range(0, n, 1024):
                    torch.mm(x, w[a:a + 1024].t(), out=out[:, a:a + 1024])
            row["chunked_1024_ms"] = median_s(chunked) * 1e3
        for key in [c for c in row if c.endswith("_ms")]:
            row[key.replace("_ms", "_gflops")] = fl / row[key] / 1e6
        rows.append(row)
    x, w = torch.randn(512, 1024, generator=g), torch.randn(1024, 1024, generator=g)
    peak = 2 * 512 * 1024 * 1024 / median_s(lambda: F.linear(x, w)) / 1e9
    res = {"cpu": cpu_model(), "flags_avx512f": "avx512f" in Path("/proc/cpuinfo").read_text(), "rows": m,
           "torch": torch.__version__, "load_start": load0, "load_end": os.getloadavg(), "shapes": rows,
           "gemm_512x1024x1024_gflops": peak, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    lines = [f"# A {m}-row serving step's matmuls, SmolLM2 tp=2 rank 0, fp32, 1 thread ({res['date']})", "",
             f"CPU: {res['cpu']} (AVX-512: {'yes' if res['flags_avx512f'] else 'no'}), torch {res['torch']}; load "
             f"average at start {' / '.join(f'{v:.2f}' for v in load0)}, at end "
             f"{' / '.join(f'{v:.2f}' for v in res['load_end'])}. Median of 21 calls.", "",
             "| matmul | in x out | F.linear ms (GFLOP/s) | oneDNN prepacked ms (GFLOP/s) | vocab chunks of 1024 ms (GFLOP/s) |",
             "|---|---|---|---|---|"]
    for r in rows:
        ch = (f"{r['chunked_1024_ms']:.2f} ({r['chunked_1024_gflops']:.0f})" if "chunked_1024_ms" in r else "")
        lines.append(f"| {r['shape']} | {r['in']} x {r['out']} | {r['linear_ms']:.3f} ({r['linear_gflops']:.0f}) | "
                     f"{r['packed_ms']:.3f} ({r['packed_gflops']:.0f}) | {ch} |")
    lines += ["", f"A 512 x 1024 x 1024 GEMM (F.linear), the core's near-peak rate: {peak:.1f} GFLOP/s."]
    Path(args.out + ".json").write_text(json.dumps(res, indent=1))
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
