"""Benchmark the shared-memory collectives against gloo, at 2 and 4 ranks on this host.

What runs: for each rank count a pool of gloo ranks (one torch thread each) is started; on it,
for all-reduce (sum, fp32), all-gather (equal shards; the size is the gathered output) and
broadcast (from rank 0), at 4 KB, 64 KB, 1 MB and 16 MB, the shared-memory path and gloo are
timed call by call, alternating per size so that load drift hits both. All rows come from the
same run. A single-process breakdown of one 4 KB all-reduce (the peer's arrival faked, so no
waiting) shows where the Python-level microseconds go.

Columns: median and p90 of rank 0's per-call time (latency); ``algbw`` = size / mean time of
the slowest rank; ``busbw`` = algbw x 2 (n - 1) / n for all-reduce, x (n - 1) / n for all-gather,
x 1 for broadcast (the nccl-tests convention: bytes each rank moves).

Usage::

    PYTHONPATH=. python bench/bench_collectives.py              # full run, ~1-3 min on an idle machine
    PYTHONPATH=. python bench/bench_collectives.py --quick      # 10x fewer iterations, to check it works

Writes ``bench/results/collectives.json`` and ``bench/results/collectives.md`` (``--out`` changes
the directory). Timings on a shared or loaded machine are noise; the JSON records the load
average before and after the run so such runs can be recognised.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tensorpar import comm
from tensorpar.shm import disable_fast_collectives, enable_fast_collectives

SIZES = {"4KB": 4 << 10, "64KB": 64 << 10, "1MB": 1 << 20, "16MB": 16 << 20}
COLLECTIVES = ("all_reduce", "all_gather", "broadcast")
# iterations per (size, backend): enough calls for a stable median, about a second per series
ITERS = {"4KB": (3000, 400), "64KB": (1500, 300), "1MB": (150, 60), "16MB": (15, 10)}   # (shm, gloo)
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0}


def _call(kind: str, group: comm.Group, nbytes: int):
    """A zero-argument closure running one ``kind`` collective of ``nbytes`` (fp32) on ``group``."""
    n = group.size
    if kind == "all_reduce":
        x = torch.randn(nbytes // 4)
        return lambda: comm.all_reduce(x, group)
    if kind == "all_gather":
        x = torch.randn(nbytes // 4 // n)
        return lambda: comm.all_gather(x, group, dim=0)
    x = torch.randn(nbytes // 4)
    return lambda: comm.broadcast(x, group, src=0)


def _series(fn, iters: int, pg) -> list[int]:
    """Per-call times in ns of ``iters`` calls, after a warm-up and a barrier."""
    for _ in range(max(3, iters // 20)):
        fn()
    dist.barrier(group=pg)
    times = []
    clock = time.perf_counter_ns
    for _ in range(iters):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return times


def job_bench(ctx, sizes: list[str], collectives: list[str], scale: float):
    """On every rank: time each (collective, size) on the shared-memory group and on gloo."""
    plain = ctx.tp
    fast = comm.Group(pg=plain.pg, rank=plain.rank, size=plain.size, name="tp")
    enable_fast_collectives(fast, "on", timeout_s=120.0)
    rows = []
    try:
        for kind in collectives:
            for size in sizes:
                nbytes = SIZES[size]
                for backend, group, iters in (("shm", fast, ITERS[size][0]), ("gloo", plain, ITERS[size][1])):
                    iters = max(5, int(iters * scale))
                    t = _series(_call(kind, group, nbytes), iters, plain.pg)
                    rows.append({"collective": kind, "size": size, "bytes": nbytes, "backend": backend,
                                 "iters": iters, "times_ns": t})
    finally:
        disable_fast_collectives(fast)
    return rows


def summarize(per_rank: list[list[dict]], n: int) -> list[dict]:
    """Merge the ranks' rows: rank 0's median / p90, the slowest rank's mean, bandwidths."""
    out = []
    for i, row in enumerate(per_rank[0]):
        t0 = sorted(row["times_ns"])
        mean_slowest = max(statistics.fmean(r[i]["times_ns"]) for r in per_rank)
        algbw = row["bytes"] / mean_slowest          # bytes per ns == GB/s
        out.append({"ranks": n, "collective": row["collective"], "size": row["size"], "bytes": row["bytes"],
                    "backend": row["backend"], "iters": row["iters"],
                    "median_us": t0[len(t0) // 2] / 1e3, "p90_us": t0[int(len(t0) * 0.9)] / 1e3,
                    "mean_us": mean_slowest / 1e3, "algbw_GBps": algbw,
                    "busbw_GBps": algbw * BUS_FACTOR[row["collective"]](n)})
    return out


def phase_breakdown(iters: int = 20000) -> dict[str, float]:
    """Microseconds per phase of one 4 KB fp32 all-reduce, in one process with a faked peer.

    The peer's arrival count is set far ahead and its metadata written for both buffers, so
    no call waits: what remains is the Python and torch overhead of the call itself.
    """
    from tensorpar.shm.collectives import ShmCommunicator
    from tensorpar.shm.protocol import K_AR, _meta
    from tensorpar.shm.segment import W_ARRIVED, W_META, Layout, Segment
    from tensorpar.shm.sync import Peer

    torch.set_num_threads(1)
    lay = Layout(2, 1 << 16)
    seg = Segment.create(lay)
    seg.unlink()
    c = ShmCommunicator(seg, 0, 2, [Peer(0, os.getpid(), None), Peer(1, os.getpid(), None)])
    group = comm.Group(pg=None, rank=0, size=2, fast=c)
    x = torch.randn(1024)
    a, b = _meta(K_AR, 1, x.dtype, x.numel()), hash(x.shape)
    for p in (0, 1):
        seg.ctl[lay.line(1) + W_META + 2 * p], seg.ctl[lay.line(1) + W_META + 2 * p + 1] = a, b
    seg.ctl[lay.line(1) + W_ARRIVED] = 1 << 60
    c.all_reduce(x)                                  # builds the cached plan of this call signature
    views = c._plans[(K_AR, x.dtype, x.shape, "sum")][4][0]

    def per_call(fn) -> float:
        for _ in range(iters // 10):
            fn()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter_ns()
            for _ in range(iters):
                fn()
            best = min(best, (time.perf_counter_ns() - t0) / iters / 1e3)
        return best

    try:
        return {
            "comm.all_reduce (whole call, no wait)": per_call(lambda: comm.all_reduce(x, group)),
            "ShmCommunicator.all_reduce": per_call(lambda: c.all_reduce(x)),
            "copy in (ctypes.memmove 4 KB)": per_call(lambda: ctypes.memmove(c._addr[0], x.data_ptr(), 4096)),
            "publish + check peers (_arrive)": per_call(lambda: c._arrive(0, a, b, K_AR)),
            "sum (torch.add of two slot views)": per_call(lambda: torch.add(views[0], views[1])),
            "plan lookup (metadata words and slot views, cached per signature)": per_call(lambda: c._plans.get(
                (K_AR, x.dtype, x.shape, "sum"))),
        }
    finally:
        c.close()


def to_markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [f"# Collectives: shared memory vs gloo", "",
             f"Run {meta['date']} on {meta['cpus']} CPUs ({meta['machine']}), torch {meta['torch']}, "
             f"commit {meta['commit']}, 1 torch thread per rank. Load average before / after: "
             f"{meta['loadavg_before']} / {meta['loadavg_after']}."
             + (" **The machine was busy: treat these numbers as noise.**" if meta["busy"] else ""), "",
             "| ranks | collective | size | shm median µs | shm p90 µs | gloo median µs | gloo p90 µs | speed-up "
             "(median) | shm busbw GB/s | gloo busbw GB/s |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    rows = result["rows"]
    for r in rows:
        if r["backend"] != "shm":
            continue
        g = next(x for x in rows if x["backend"] == "gloo" and
                 (x["ranks"], x["collective"], x["size"]) == (r["ranks"], r["collective"], r["size"]))
        lines.append(f"| {r['ranks']} | {r['collective']} | {r['size']} | {r['median_us']:.1f} | {r['p90_us']:.1f} | "
                     f"{g['median_us']:.1f} | {g['p90_us']:.1f} | {g['median_us'] / r['median_us']:.1f}x | "
                     f"{r['busbw_GBps']:.2f} | {g['busbw_GBps']:.2f} |")
    lines += ["", "Where the time of one 4 KB all-reduce goes (one process, peer's arrival faked, best of 5):", "",
              "| phase | µs |", "|---|---:|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in result["breakdown_us"].items()]
    lines += ["", "SmolLM2 decode tokens/s (tp=2 vs tp=1 with 1 and 2 threads): not measured here yet; it needs the "
              "`generate` command.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--collectives", nargs="+", default=list(COLLECTIVES), choices=list(COLLECTIVES))
    ap.add_argument("--quick", action="store_true", help="10x fewer iterations (checks that it runs)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args(argv)
    for n in args.ranks:
        if n < 2:
            raise ValueError(f"--ranks must be >= 2 (a collective needs peers), got {n}")
    from tensorpar.testing import WorkerPool

    load_before = os.getloadavg()
    rows = []
    for n in args.ranks:
        with WorkerPool(n, collective_timeout_s=300.0, job_timeout_s=3600.0) as pool:
            rows += summarize(pool.run(job_bench, args.sizes, args.collectives, 0.1 if args.quick else 1.0), n)
        print(f"{n} ranks done", file=sys.stderr)
    breakdown = phase_breakdown(2000 if args.quick else 20000)
    load_after = os.getloadavg()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    cpus = len(os.sched_getaffinity(0))
    result = {"meta": {"date": _dt.datetime.now().isoformat(timespec="seconds"), "cpus": cpus,
                       "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                       "commit": commit, "quick": args.quick,
                       "loadavg_before": [round(v, 2) for v in load_before],
                       "loadavg_after": [round(v, 2) for v in load_after],
                       "busy": load_before[0] > 0.5},
              "rows": rows, "breakdown_us": breakdown}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "collectives.json").write_text(json.dumps(result, indent=1) + "\n")
    md = to_markdown(result)
    (args.out / "collectives.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
