"""Rank job for the namespace-host tests and bench: hierarchical vs flat all-reduce across real (namespace) hosts.

Run by torchrun on every host (``python -m tests._hosts_jobs --sizes 4096,65536 --iters 20 --out r.json``): every
rank joins one tp group of the whole world, installs the hierarchical all-reduce with the real host identity
(:func:`tensorpar.shm.host_identity`, not a simulated one) and checks, for each size, that

* the hierarchical sum of random fp32 inputs is bit-identical to the same sum ordered the same way in plain
  torch (each host's ranks in rank order, then the hosts: ``(x0 + x1) + (x2 + x3)``; with two hosts the
  leaders' gloo all-reduce adds two terms, and ``a + b == b + a`` exactly, so its order cannot differ);
* it is bit-identical to the flat gloo all-reduce where the order cannot matter (integer-valued inputs,
  exact in fp32), and within the harness's ``close`` tolerance otherwise (gloo's ring adds in another order);

then times both (median seconds per all-reduce, each timed call after a barrier) and rank 0 writes a JSON
record with the host grouping, the checks and the timings.
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from tensorpar import comm
from tensorpar.parallel import init_parallel, ParallelConfig
from tensorpar.shm import disable_fast_collectives, enable_fast_collectives, host_identity
from tensorpar.testing import assert_parity


def inputs(rank: int, numel: int, integer: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return (torch.randint(-1000, 1000, (numel,), generator=g).float() if integer
            else torch.randn(numel, generator=g))


def ordered_sum(hosts: list[list[int]], numel: int) -> torch.Tensor:
    """The hierarchical order in plain torch: each host's ranks left to right, then the hosts left to right."""
    total = None
    for ranks in hosts:
        part = inputs(ranks[0], numel, False)
        for r in ranks[1:]:
            part = part + inputs(r, numel, False)
        total = part if total is None else total + part
    return total


def timed(fn, pg, iters: int) -> float:
    times = []
    for _ in range(iters):
        dist.barrier(group=pg)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="4096,65536,1048576,16777216", help="bytes per all-reduce (fp32)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    ctx = init_parallel(ParallelConfig(tp=int(os.environ["WORLD_SIZE"])), timeout_s=120)
    flat = ctx.tp
    hier = comm.Group(pg=flat.pg, rank=flat.rank, size=flat.size, name="tp")
    enable_fast_collectives(hier, "hierarchical", timeout_s=120)
    ids = [None] * flat.size
    dist.all_gather_object(ids, host_identity(), group=flat.pg)
    rec = {"world": flat.size, "hosts": hier.fast.hosts, "host_ids": ids, "sizes": {}}
    try:
        for nbytes in (int(s) for s in a.sizes.split(",")):
            n = nbytes // 4
            x = inputs(flat.rank, n, False)
            y = comm.all_reduce(x, hier)
            f = comm.all_reduce(x, flat)
            xi = inputs(flat.rank, n, True)
            row = {"hier_equals_ordered_sum": torch.equal(y, ordered_sum(hier.fast.hosts, n)),
                   "hier_equals_flat_integer": torch.equal(comm.all_reduce(xi, hier), comm.all_reduce(xi, flat)),
                   "hier_max_diff_flat": (y - f).abs().max().item()}
            assert_parity(f"hierarchical vs flat all-reduce, {nbytes} bytes", y, f, "close")
            row["flat_s"] = timed(lambda: comm.all_reduce(x, flat), flat.pg, a.iters)
            row["hier_s"] = timed(lambda: comm.all_reduce(x, hier), flat.pg, a.iters)
            rec["sizes"][nbytes] = row
    finally:
        disable_fast_collectives(hier)
    if flat.rank == 0:
        with open(a.out, "w") as fh:
            json.dump(rec, fh, indent=1)
    ctx.destroy()


if __name__ == "__main__":
    main()
