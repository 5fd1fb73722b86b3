"""The int8 all-reduce's own work per call (``--tp-comm int8``, tensorpar/comm/compress.py) without the wire: this
rank's partial quantized into its payload (:func:`encode`) and two ranks' payloads dequantized and summed
(:func:`decode_sum`), in our C kernel (csrc/q8_comm.cpp) against the PyTorch ops it replaces (the same bits), one
thread, interleaved per repeat. Sizes: a decode step's ``[1, h]`` (SmolLM2 576, the 1.1B Llama 2048, 4096 = 16 KB)
and a 512-token prefill's ``[512, h]``.

    PYTHONPATH=. .venv/bin/python bench/bench_q8_comm.py [--repeats 5] [--out bench/results/q8_comm]

``us`` = the median over ``--repeats`` of the mean over a batch of calls (thread CPU time). Writes OUT.json and
OUT.md with the CPU model and the other work on the machine during the run.
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

from machine import cpu_account, describe, machine, other_work, write_results  # noqa: E402

SIZES = ((1, 576), (1, 2048), (1, 4096), (512, 576), (512, 2048))


def per_call_us(x: torch.Tensor, kernel: bool, calls: int) -> float:
    from tensorpar.comm import compress
    saved = compress._lib
    compress._lib = saved if kernel else (lambda: None)
    try:
        def one():
            p = compress.encode(x)
            return compress.decode_sum(torch.stack([p, p]), x.numel())
        one()
        t0 = time.thread_time()
        for _ in range(calls):
            one()
        return (time.thread_time() - t0) / calls * 1e6
    finally:
        compress._lib = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "q8_comm"))
    a = ap.parse_args()
    from tensorpar.comm import compress
    if compress._lib() is None:
        raise SystemExit("bench_q8_comm: the C kernel does not build or run here (no compiler, or "
                         "TENSORPAR_COMM_KERNEL=0)")
    torch.set_num_threads(1)
    cpu0, t_start = cpu_account(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = []
    for shape in SIZES:
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
        calls = max(5, 200_000 // x.numel())
        got = {True: [], False: []}
        for rep in range(a.repeats):
            for kernel in ((True, False) if rep % 2 == 0 else (False, True)):
                got[kernel].append(per_call_us(x, kernel, calls))
        rows.append({"shape": list(shape), "kernel_us": statistics.median(got[True]),
                     "torch_us": statistics.median(got[False])})
        print(rows[-1], flush=True)
    meta = {**machine(), "started": t_start, "repeats": a.repeats, "other_work": other_work(cpu0, cpu_account())}
    lines = ["# --tp-comm int8: quantize + dequantize-sum per call, C kernel against PyTorch ops", "",
             f"{meta['cpu']}, {meta['cores']} cores, torch {torch.__version__}, {t_start}; {describe(meta['other_work'])}."
             f" One thread; thread CPU time per call (encode one rank's partial, decode_sum of 2 payloads), median "
             f"of {a.repeats} interleaved repeats.", "",
             "| partial | C kernel (us) | PyTorch ops (us) | speed-up |", "|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| [{r['shape'][0]}, {r['shape'][1]}] fp32 | {r['kernel_us']:.1f} | {r['torch_us']:.1f} | "
                     f"{r['torch_us'] / r['kernel_us']:.1f}x |")
    write_results(Path(a.out), meta, rows, lines)


if __name__ == "__main__":
    main()
