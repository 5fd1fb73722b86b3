"""The link between two hosts as the planner sees it: all-reduce and send/recv times over it, and what one small
all-reduce (and all-gather) adds to a decode-like step (one rank per host, started by torchrun; used by
bench_link_rates.py; the same script measures two real machines: ``torchrun --nnodes 2 ... bench/link_job.py --out
link.json``). Rank 0 writes ``--out`` (JSON):

The all-reduces and all-gathers are tensorpar's (:func:`tensorpar.comm.all_reduce` on a group with the fast
collectives of ``--fast-collectives auto``, as generate, serve and train run them: across hosts the leaders' TCP mesh
for messages up to its ``max_bytes``, gloo above; ``mesh_max_bytes`` in the output), send/recv gloo's (the pipeline's).

* ``allreduce``: ``{bytes: median seconds}`` of one all-reduce of fp32, ``--calls`` calls back to back (fewer above
  1 MB: ``--calls x 64 KiB / bytes``, at least 8) after 3 warm-up calls;
* ``send``: ``{bytes: median seconds}`` of one send, half a ping-pong, as many calls;
* ``step``: what one all-reduce (``allreduce_us``) and one all-gather (``allgather_us``) of ``--step-bytes`` add to a
  step that alternates a one-thread one-row matmul (``[1, hidden] x [hidden, cols]`` fp32, about the weights a rank
  reads between two decode collectives) with the collective, as a decode step does: ``(wall of --calls matmul +
  collective pairs - wall of the --calls matmuls alone) / --calls``, the mean over the two ranks, the median of
  ``--rounds`` rounds (blocks interleaved). Also ``compute_us`` (one matmul) and each round's values;
* ``fit``: ``seconds = latency + bytes / bandwidth`` (2 ranks: a ring all-reduce moves ``2 (n - 1) / n = 1`` x the
  bytes), as ``latency_us`` and ``bandwidth_gbps`` (GB/s): for ``send``, :func:`fit` of its medians; for
  ``allreduce``, :func:`link_fit`: the bandwidth of the back-to-back medians, the latency of the in-step all-reduce.

Why the in-step time (bench/results/link_probe.md): on the namespace testbed (two hosts sharing a loaded 2-core
machine) a small all-reduce costs what waking gloo's threads on each rank costs, not what the wire does; one call
after a barrier (this job's method before) was 1-3 ms and not monotonic in the size, back-to-back calls are cheaper
than calls between matmuls, and a decode step pays the latter.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist


def fit(points: dict[int, float]) -> dict:
    """Bandwidth from the smallest and the largest size (the slope between them), latency: the smallest size's time
    less its bytes at that bandwidth (a least-squares line is pulled by the large sizes' noise, which is larger than
    the small sizes' time). ``points``: ``{bytes: seconds}``, at least two sizes."""
    (b0, t0), (b1, t1) = min(points.items()), max(points.items())
    slope = max((t1 - t0) / (b1 - b0), 1e-15)
    return {"latency_us": max(0.0, (t0 - slope * b0) * 1e6), "bandwidth_gbps": 1 / slope / 1e9}


def link_fit(b2b: dict[int, float], step_bytes: int, step_s: float) -> dict:
    """The all-reduce link the planner prices every collective with (``latency + bytes / bandwidth``): the bandwidth
    of :func:`fit` over the back-to-back medians ``b2b`` (``{bytes: seconds}``; the large sizes decide it), the
    latency what one all-reduce of ``step_bytes`` adds to a decode-like step (``step_s`` seconds) less its bytes at
    that bandwidth (at least 0). Returns ``{"latency_us", "bandwidth_gbps", "b2b_latency_us"}`` (the last: the
    back-to-back fit's own latency, for comparison)."""
    line = fit(b2b)
    bandwidth = line["bandwidth_gbps"] * 1e9
    return {"latency_us": max(0.0, step_s - step_bytes / bandwidth) * 1e6, "bandwidth_gbps": line["bandwidth_gbps"],
            "b2b_latency_us": line["latency_us"]}


def calls_for(size: int, calls: int) -> int:
    """Calls per size: ``calls`` up to 64 KiB, ``calls x 64 KiB / size`` above it, at least 8."""
    return max(8, min(calls, calls * 65536 // size))


def step_costs(group, calls: int, rounds: int, nbytes: int, hidden: int, cols: int) -> dict:
    """This rank's in-step costs (module docstring), seconds: ``{"compute": [per round], "allreduce": [...],
    "allgather": [...]}`` per call."""
    from tensorpar import comm
    w = torch.randn(hidden, cols, generator=torch.Generator().manual_seed(group.rank)) * 0.01
    x = torch.randn(1, hidden)
    t = torch.ones(nbytes // 4)
    ops = {"compute": None, "allreduce": lambda: comm.all_reduce(t, group),
           "allgather": lambda: comm.all_gather(t, group, dim=0)}
    res = {k: [] for k in ops}
    for r in range(rounds + 1):   # round 0: warm-up
        walls = {}
        for name, op in ops.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                torch.mm(x, w)
                if op is not None:
                    op()
            walls[name] = (time.perf_counter() - t0) / calls
        if r:
            res["compute"].append(walls["compute"])
            for name in ("allreduce", "allgather"):
                res[name].append(walls[name] - walls["compute"])
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="2304,65536,1048576,4194304")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--iters", type=int, default=None, help="(old name of --calls)")
    ap.add_argument("--step-bytes", type=int, default=None, help="the in-step collective's bytes (default: the "
                                                                 "smallest size)")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--cols", type=int, default=3072)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    calls = args.iters or args.calls
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from tensorpar import comm
    from tensorpar.shm import enable_fast_collectives
    group = comm.Group.from_pg(dist.group.WORLD, name="tp")
    enable_fast_collectives(group, "auto", timeout_s=120.0)
    leaders = getattr(group.fast, "leaders", None)
    mesh = getattr(leaders, "fast", None)
    sizes = sorted(map(int, args.sizes.split(",")))
    step_bytes = args.step_bytes or sizes[0]
    res = {"allreduce": {}, "send": {}}
    for size in sizes:
        x = torch.ones(size // 4)
        n = calls_for(size, calls)
        ar, pp = [], []
        dist.barrier()
        for i in range(n + 3):
            t = time.perf_counter()
            comm.all_reduce(x, group)
            if i >= 3:
                ar.append(time.perf_counter() - t)
        dist.barrier()
        for i in range(n + 3):
            t = time.perf_counter()
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                dist.send(x, 0)
            if i >= 3:
                pp.append((time.perf_counter() - t) / 2)
        res["allreduce"][size] = statistics.median(ar)
        res["send"][size] = statistics.median(pp)
    mine = step_costs(group, calls, args.rounds, step_bytes, args.hidden, args.cols)
    both = [None] * dist.get_world_size()
    dist.all_gather_object(both, mine)
    per_round = {k: [statistics.fmean(r[k][i] for r in both) for i in range(args.rounds)] for k in mine}
    res["step"] = {"bytes": step_bytes, "hidden": args.hidden, "cols": args.cols, "calls": calls,
                   "compute_us": statistics.median(per_round["compute"]) * 1e6,
                   "allreduce_us": statistics.median(per_round["allreduce"]) * 1e6,
                   "allgather_us": statistics.median(per_round["allgather"]) * 1e6,
                   "rounds_us": {k: [round(v * 1e6, 1) for v in vals] for k, vals in per_round.items()}}
    res["path"] = type(group.fast).__name__ if group.fast is not None else "gloo"
    res["mesh_max_bytes"] = getattr(mesh, "max_bytes", 0)
    res["fit"] = {"allreduce": link_fit(res["allreduce"], step_bytes, res["step"]["allreduce_us"] * 1e-6),
                  "send": fit(res["send"])}
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(res, f)
    from tensorpar.shm import disable_fast_collectives
    disable_fast_collectives(group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
