"""How far this machine's two CPUs scale a kernel from one process to two (issue 28's tp=2 / tp=1 targets).

Tensor parallelism at tp=2 here runs one thread per rank on each of the 2 CPUs; tp=1 runs one thread alone. A
decode whose time is the weights' read from memory can scale by the memory-read limit's two-thread / one-thread ratio
(``bench/stream_read.c``); a kernel bound by the core's arithmetic scales by 2 only if the two CPUs are two cores
that keep their clock when both are busy. A VM's CPUs may be two hyperthreads of one core, or run slower with both
busy; ``lscpu`` inside the VM cannot say which. This measures it.

For each kernel, one thread per process (``torch.set_num_threads(1)``), each process pinned to its own CPU: the
rate of one process alone, then of two at once (each its own copy of the data), interleaved over ``--rounds``:

* ``fp32 GEMM in L2``: ``torch.mm`` of ``[64, 512] x [512, 512]`` (1 MiB of weights: arithmetic, no memory traffic);
* ``fp32 GEMV in L2``: tensorpar's GEMV (``gemv_kernel.linear``), 1 row, 1 MiB of weights (load bound, in cache);
* ``int8 GEMV in L2``: tensorpar's VNNI kernel (``torch.ops.tensorpar.q8_linear``), 1 row, 1 MiB of int8 weights;
* ``fp32 / bf16 / int8 GEMV from memory``: the same kernels, 1 row, over one tp=2 rank's weights of the 1.1B Llama
  (22 layers of fused QKV 1280x2048, o 2048x1024, gate-up 5632x2048, down 2048x2816; random, distinct), the
  decode step's matmuls: GB/s of weights read.

Two at once / alone near 2: the kernel scales with the CPUs; near the memory-read ratio: bound by memory; near 1:
the CPUs share one core's arithmetic (or its clock drops). Results: ``--out``.{md,json} with the CPU model and the
other work during the run.

    PYTHONPATH=. .venv/bin/python bench/bench_core_scaling.py [--rounds 3] [--seconds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

#: one tp=2 rank's matmuls of a 1.1B Llama layer (TinyLlama's shape: hidden 2048, 32 / 4 heads of 64, MLP 5632)
LAYER_SHARD = ((1280, 2048), (2048, 1024), (5632, 2048), (2048, 2816))
LAYERS = 22
KERNELS = ("fp32 GEMM in L2", "fp32 GEMV in L2", "int8 GEMV in L2", "fp32 GEMV from memory",
           "bf16 GEMV from memory", "int8 GEMV from memory")


def _make(kernel: str):
    """``(fn, units_per_call, unit)`` for one call of ``kernel`` on data of its own."""
    import torch

    from tensorpar.decode import gemv_kernel
    from tensorpar.decode.int8 import quantize_weight
    g = torch.Generator().manual_seed(os.getpid())
    if kernel == "fp32 GEMM in L2":
        x, w = torch.randn(64, 512, generator=g), torch.randn(512, 512, generator=g)
        return (lambda: torch.mm(x, w)), 2 * 64 * 512 * 512 / 1e9, "GFLOP/s"
    if kernel.endswith("in L2"):
        shapes = [(512, 512)] if kernel.startswith("fp32") else [(1024, 1024)]       # 1 MiB either way
    else:
        shapes = [s for _ in range(LAYERS) for s in LAYER_SHARD]
    dt = kernel.split()[0]
    ws = [torch.randn(n, k, generator=g) for n, k in shapes]
    xs = {k: torch.randn(1, k, generator=g) for _, k in shapes}
    if dt == "fp32":
        calls = [(gemv_kernel.linear, xs[w.shape[1]], w) for w in ws]
        nbytes = sum(w.numel() * 4 for w in ws)
    elif dt == "bf16":
        ws = [w.bfloat16() for w in ws]
        calls = [(gemv_kernel.bf16w_linear, xs[w.shape[1]], w) for w in ws]
        nbytes = sum(w.numel() * 2 for w in ws)
    else:
        q8 = [quantize_weight(w, write=False) for w in ws]
        del ws
        calls = [(lambda x, w, b: torch.ops.tensorpar.q8_linear(x, w.q, w.scale, b), xs[w.q.shape[1]], w) for w in q8]
        nbytes = sum(w.q.numel() + w.scale.numel() * 2 for w in q8)

    def run():
        for f, x, w in calls:
            f(x, w, None)
    return run, nbytes / 1e9, "GB/s"


def worker(kernel: str, cpu: int, seconds: float, start_at: float) -> dict:
    """Rate of ``kernel`` on ``cpu`` for about ``seconds`` from wall time ``start_at`` (the processes of a pair start
    together): calls until the time is up, then units per second."""
    import torch
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {cpu})
    fn, units, unit = _make(kernel)
    fn()                                        # warm-up (and the data's first touch)
    time.sleep(max(0.0, start_at - time.time()))
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return {"rate": n * units / (time.perf_counter() - t0), "unit": unit, "calls": n}


def _run(kernel: str, cpus: list[int], seconds: float) -> list[dict]:
    start_at = time.time() + 15.0               # after every process has built its data
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", kernel, "--cpu", str(c), "--seconds",
                               str(seconds), "--start-at", repr(start_at)], stdout=subprocess.PIPE, text=True)
             for c in cpus]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{kernel}: a worker failed")
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "core-scaling"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cpu", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not (a.rounds >= 1 and a.seconds > 0):
        ap.error(f"--rounds {a.rounds}, --seconds {a.seconds:g}: need --rounds >= 1 and --seconds > 0")
    if a.worker:
        print(json.dumps(worker(a.worker, a.cpu, a.seconds, a.start_at)))
        return
    from machine import cpu_account, describe, machine, other_work, write_results
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("bench_core_scaling: needs 2 CPUs; this process may use " + str(cpus))
    start, acc0 = machine(), cpu_account()
    rows = {k: {"kernel": k, "alone": [], "pair": []} for k in a.kernels}
    for rnd in range(a.rounds):
        for k in a.kernels:
            order = ("alone", "pair") if rnd % 2 == 0 else ("pair", "alone")
            for how in order:
                res = _run(k, cpus[:1] if how == "alone" else cpus[:2], a.seconds)
                rows[k]["unit"] = res[0]["unit"]
                rows[k][how].append([r["rate"] for r in res])
            print(f"round {rnd + 1} {k}: alone {rows[k]['alone'][-1][0]:.2f}, pair "
                  f"{', '.join(f'{r:.2f}' for r in rows[k]['pair'][-1])} {rows[k]['unit']}", flush=True)
    work = other_work(acc0, cpu_account())
    end = machine()
    med = statistics.median
    lines = [f"# One process against two at once, one thread each, each pinned to its own CPU ({start['cpu']}, "
             f"{start['cores']} cores)", "",
             f"{time.strftime('%Y-%m-%d %H:%M')}; load average {start['loadavg'][0]:.2f} at start, "
             f"{end['loadavg'][0]:.2f} at end; {describe(work)}. {a.rounds} rounds of {a.seconds:g} s per "
             "measurement, alone and pair interleaved (order reversed every other round); medians over rounds.", "",
             "| kernel | unit | one process alone | each of two at once | two at once, summed | summed / alone |",
             "|---|---|---:|---:|---:|---:|"]
    for k, r in rows.items():
        alone = med(x[0] for x in r["alone"])
        each = med(v for x in r["pair"] for v in x)
        summed = med(sum(x) for x in r["pair"])
        r.update(alone_median=alone, pair_each_median=each, pair_sum_median=summed)
        lines.append(f"| {k} | {r['unit']} | {alone:.2f} | {each:.2f} | {summed:.2f} | {summed / alone:.2f} |")
    write_results(Path(a.out), {**start, "end": end, "other_work": work, "rounds": a.rounds,
                                "seconds": a.seconds}, list(rows.values()), lines)


if __name__ == "__main__":
    main()
