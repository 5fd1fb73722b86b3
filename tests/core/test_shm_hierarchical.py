"""Hierarchical all-reduce on 2 simulated hosts x 2 ranks: parity with the flat all-reduce, byte counts."""
import torch

from tensorpar import comm
from tensorpar.shm import HierarchicalComm, disable_fast_collectives
from tensorpar.testing import assert_parity
from tests._shm import fingerprint

HOSTS = 2
PER_HOST = 2


def job_hierarchical(ctx):
    flat = ctx.tp
    g = comm.Group(pg=flat.pg, rank=flat.rank, size=flat.size, name="tp")
    from tensorpar.shm import enable_fast_collectives
    assert enable_fast_collectives(g, "hierarchical", host_id=f"simhost{g.rank // PER_HOST}", timeout_s=30.0)
    h: HierarchicalComm = g.fast
    try:
        assert h.hosts == [[0, 1], [2, 3]]
        assert h.is_leader == (g.rank % PER_HOST == 0)
        prints = []
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for numel in (1, 1000, 300_000):
                x = torch.randn(numel, generator=torch.Generator().manual_seed(g.rank)).to(dtype)
                y = comm.all_reduce(x, g)
                assert_parity(f"hierarchical sum {dtype} x{numel}", y, comm.all_reduce(x, flat), "close")
                m = comm.all_reduce(x, g, op="max")
                assert torch.equal(m, comm.all_reduce(x, flat, op="max"))
                prints.append((fingerprint(y), fingerprint(m)))
        # the other collectives keep the flat path and stay exact
        parts = torch.arange(6.0).view(2, 3) + 10 * g.rank
        assert torch.equal(comm.all_gather(parts, g, dim=0), comm.all_gather(parts, flat, dim=0))
        assert torch.equal(comm.broadcast(parts, g, src=3), comm.broadcast(parts, flat, src=3))
        # bytes: 10 all-reduces of 1000 fp32 on the leaders' group vs the flat group
        x = torch.ones(1000)
        with comm.counting(flat) as cf:
            for _ in range(10):
                comm.all_reduce(x, flat)
        if h.is_leader:
            with comm.counting(h.leaders) as cl:
                for _ in range(10):
                    comm.all_reduce(x, g)
            leaders = cl.summary().get("all_reduce", {"bytes": 0, "wire_bytes": 0})
        else:
            for _ in range(10):
                comm.all_reduce(x, g)
            leaders = {"bytes": 0, "wire_bytes": 0}
        return prints, cf.summary()["all_reduce"], leaders
    finally:
        disable_fast_collectives(g)


def test_hierarchical_all_reduce_on_two_simulated_hosts(pools):
    out = pools(HOSTS * PER_HOST).run(job_hierarchical)
    assert all(o[0] == out[0][0] for o in out), "ranks got different bits"
    n, b = HOSTS * PER_HOST, 10 * 1000 * 4
    flat_bytes = sum(o[1]["bytes"] for o in out)
    cross_bytes = sum(o[2]["bytes"] for o in out)
    assert flat_bytes == n * b
    # tensor bytes handed to cross-host collectives: 1 / (ranks per host) of the flat ring's
    assert cross_bytes * PER_HOST == flat_bytes
    # ring wire bytes summed over ranks: 2 (h - 1) B instead of 2 (N - 1) B
    assert sum(o[1]["wire_bytes"] for o in out) == 2 * (n - 1) * b
    assert sum(o[2]["wire_bytes"] for o in out) == 2 * (HOSTS - 1) * b


def job_rebuilt(ctx, host_of_rank, times):
    """The hierarchical communicator made and closed ``times`` times over the same ranks, as a pool's jobs do: each
    one's leaders' group must be new (a reused store prefix once made gloo connect to the previous group's closed
    ports and hang)."""
    flat = ctx.tp
    out = []
    for _ in range(times):
        g = comm.Group(pg=flat.pg, rank=flat.rank, size=flat.size, name="tp")
        from tensorpar.shm import enable_fast_collectives
        assert enable_fast_collectives(g, "hierarchical", host_id=host_of_rank[g.rank], timeout_s=20.0)
        try:
            x = torch.full((300_000,), float(g.rank + 1))             # past the mesh's limit: the leaders' gloo group
            parts = torch.arange(4.0) + 10 * g.rank
            out.append((comm.all_reduce(x, g)[0].item(), comm.all_reduce(x[:10], g)[0].item(),
                        torch.equal(comm.all_gather(parts, g, dim=0), comm.all_gather(parts, flat, dim=0))))
        finally:
            disable_fast_collectives(g)
    return out


def test_hierarchical_rebuilt_again_and_again_and_on_unequal_hosts(pools):
    p = pools(HOSTS * PER_HOST)
    total = float(sum(range(1, 5)))
    for hosts in (["a", "a", "b", "b"], ["a", "b", "b", "b"], ["a", "b", "c", "d"]):
        assert p.run(job_rebuilt, hosts, 3, timeout_s=120) == [[(total, total, True)] * 3] * 4, hosts
