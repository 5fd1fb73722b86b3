"""The link between two hosts as the planner sees it: gloo all-reduce and send/recv times over it (one rank per host,
started by torchrun; used by bench_link_rates.py). Rank 0 writes ``--out`` (JSON):

* ``allreduce``: ``{bytes: median seconds}`` of one all-reduce of fp32 (each call after a barrier);
* ``send``: ``{bytes: median seconds}`` of one send, half a ping-pong;
* ``fit``: ``seconds = latency + bytes / bandwidth`` of each (:func:`fit`) (2 ranks: a ring all-reduce moves
  ``2 (n - 1) / n = 1`` x the bytes), as ``latency_us`` and ``bandwidth_gbps`` (GB/s).
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
    the small sizes' time)."""
    (b0, t0), (b1, t1) = min(points.items()), max(points.items())
    slope = max((t1 - t0) / (b1 - b0), 1e-15)
    return {"latency_us": max(0.0, (t0 - slope * b0) * 1e6), "bandwidth_gbps": 1 / slope / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="2304,65536,1048576,4194304")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    res = {"allreduce": {}, "send": {}}
    for size in map(int, args.sizes.split(",")):
        x = torch.ones(size // 4)
        iters = args.iters if size < 1 << 20 else max(5, args.iters // 4)
        ar, pp = [], []
        for _ in range(iters + 2):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(x)
            ar.append(time.perf_counter() - t)
        for _ in range(iters + 2):
            dist.barrier()
            t = time.perf_counter()
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                dist.send(x, 0)
            pp.append((time.perf_counter() - t) / 2)
        res["allreduce"][size] = statistics.median(ar[2:])
        res["send"][size] = statistics.median(pp[2:])
    res["fit"] = {k: fit(res[k]) for k in ("allreduce", "send")}
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
