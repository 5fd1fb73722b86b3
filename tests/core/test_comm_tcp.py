"""The leaders' TCP mesh (tensorpar.comm.tcp.TcpMesh) on simulated hosts of one rank each: rank-order sums with the
same bits on every rank, the process group above its size limit, all-gather and the row step's partials, counts,
and one-line failures (a collective that differs between ranks, a peer that leaves, a peer that never comes)."""
import ctypes
import time

import pytest
import torch

from tensorpar import comm
from tensorpar.comm.tcp import TcpMesh
from tensorpar.shm import disable_fast_collectives, enable_fast_collectives


def x_of(rank: int, numel: int, dtype) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)


def job_mesh(ctx):
    flat = ctx.tp
    g = comm.Group(pg=flat.pg, rank=flat.rank, size=flat.size, name="tp")
    # "auto" across hosts installs the hierarchical all-reduce; one rank per host: the leaders are the group
    assert enable_fast_collectives(g, "auto", host_id=f"simhost{g.rank}", timeout_s=30.0)
    h = g.fast
    mesh = h.leaders.fast
    try:
        assert isinstance(mesh, TcpMesh) and 4096 <= mesh.max_bytes <= 256 * 1024, mesh
        out = {"max_bytes": mesh.max_bytes, "sums": []}
        big = mesh.max_bytes // 4 + 1                      # one element over the limit: the process group
        for dtype in (torch.float32, torch.bfloat16):
            for numel in (1, 1000, big):
                xs = [x_of(r, numel, dtype) for r in range(g.size)]
                y = comm.all_reduce(xs[g.rank], g)
                want = xs[0].clone()
                for x in xs[1:]:
                    want.add_(x)                          # rank order, in the tensor's dtype
                if numel < big:
                    assert torch.equal(y, want), (dtype, numel)
                else:
                    torch.testing.assert_close(y, want, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
                assert y.dtype == dtype and y.shape == xs[0].shape
                m = comm.all_reduce(xs[g.rank], g, op="max")
                assert torch.equal(m, torch.stack(xs).amax(0))
                out["sums"].append(y.float().sum().item())
        # all-gather of equal shards (the compressed all-reduce's collective) and of unequal ones (process group)
        part = torch.arange(6.0).view(2, 3) + 10 * g.rank
        assert torch.equal(comm.all_gather(part, g, dim=0), comm.all_gather(part, flat, dim=0))
        uneven = torch.full((g.rank + 1, 2), float(g.rank))
        sizes = [r + 1 for r in range(g.size)]
        assert torch.equal(comm.all_gather(uneven, g, dim=0, sizes=sizes),
                           comm.all_gather(uneven, flat, dim=0, sizes=sizes))
        q = torch.tensor([1.5, -2.0, 3.25]) * (g.rank + 1)
        assert torch.equal(comm.all_reduce(q, g), q / (g.rank + 1) * sum(range(1, g.size + 1)))
        # the row step's exchange: the ranks' copies in rank order, read where they arrived
        x = x_of(g.rank, 2 * 48, torch.float32).view(2, 48)
        parts = h.all_reduce_parts(x)
        assert len(parts) == g.size
        got = [torch.frombuffer((ctypes.c_float * x.numel()).from_address(a), dtype=torch.float32).view(2, 48)
               for a in parts]
        for r in range(g.size):
            assert torch.equal(got[r], x_of(r, 2 * 48, torch.float32).view(2, 48))
        # counted on the group and, as what crossed hosts, on the leaders' group
        with comm.counting(g) as c, comm.counting(h.leaders) as cl:
            for _ in range(5):
                comm.all_reduce(torch.ones(100), g)
        out["counts"] = (c.summary()["all_reduce"]["calls"], cl.summary()["all_reduce"]["calls"],
                         cl.summary()["all_reduce"]["bytes"])
        return out
    finally:
        disable_fast_collectives(g)


def test_mesh_sums_gathers_and_partials_on_three_simulated_hosts(pools):
    out = pools(3).run(job_mesh)
    assert all(o["sums"] == out[0]["sums"] for o in out), "ranks got different bits"
    assert len({o["max_bytes"] for o in out}) == 1, "the size limit must be agreed"
    assert all(o["counts"] == (5, 5, 5 * 400) for o in out)


def job_failures(ctx, case):
    flat = ctx.tp
    g = comm.Group(pg=flat.pg, rank=flat.rank, size=flat.size, name="tp.leaders")
    mesh, err = TcpMesh.build(g, timeout_s=3.0)
    assert mesh is not None, err
    g.fast = mesh
    try:
        if case == "mismatch":              # rank 1 all-reduces 12 floats where rank 0 all-reduces 10
            with pytest.raises(comm.CollectiveError) as e:
                comm.all_reduce(torch.ones(10 + 2 * g.rank), g)
            with pytest.raises(comm.CollectiveError, match="connections are unusable"):
                comm.all_reduce(torch.ones(10), g)       # its streams are out of step: refused, not garbage
            return str(e.value)
        if case == "peer_closes":           # rank 1 leaves (as a dead process's sockets close)
            if g.rank == 1:
                mesh.close()
                return ""
            t0 = time.monotonic()
            with pytest.raises(comm.CollectiveError) as e:
                comm.all_reduce(torch.ones(10), g)
            return str(e.value), time.monotonic() - t0
        if case == "peer_silent":           # rank 1 never calls: rank 0 gives up after the timeout
            if g.rank == 1:
                time.sleep(6.0)
                return ""
            t0 = time.monotonic()
            with pytest.raises(comm.CollectiveError) as e:
                comm.all_reduce(torch.ones(10), g)
            return str(e.value), time.monotonic() - t0
    finally:
        g.fast = None
        mesh.close()


def job_named(ctx, per_host=1):
    """Through the hierarchical all-reduce, a lost peer is named as the caller's group sees it: its hosts. Hosts
    A and B of ``per_host`` ranks each (simulated); host B's leader drops its TCP mesh and leaves, every other
    rank returns its one-line error."""
    g = comm.Group(pg=ctx.tp.pg, rank=ctx.tp.rank, size=ctx.tp.size, name="tp")
    assert enable_fast_collectives(g, "auto", host_id=f"simhost{g.rank // per_host}", timeout_s=10.0)
    g.hosts = ("hostA",) * per_host + ("hostB",) * per_host    # what init_parallel sets for a group across hosts
    try:
        if g.rank == per_host:
            g.fast.leaders.fast.close()
            return ""
        with pytest.raises(comm.CollectiveError) as e:
            comm.all_reduce(torch.ones(10), g)
        return str(e.value)
    finally:
        disable_fast_collectives(g)


def test_a_lost_host_is_named_as_the_callers_group_sees_it(pools):
    msg = pools(2).run(job_named)[0]
    assert msg.startswith("all_reduce on tp group (rank 0 of 2 on host hostA; the group's other hosts: hostB "
                          "(rank 1), tensor (10,) torch.float32) failed: waiting for host "), msg
    assert "over TCP: the connection ended" in msg and "\n" not in msg


def test_a_collective_that_differs_between_ranks_is_named_on_both(pools):
    msgs = pools(2).run(job_failures, "mismatch")
    assert "rank 1 called all_reduce of 48 bytes, this rank all_reduce of 40 bytes" in msgs[0]
    assert "rank 0 called all_reduce of 40 bytes, this rank all_reduce of 48 bytes" in msgs[1]
    assert all(m.startswith("all_reduce on tp.leaders group over TCP (rank ") for m in msgs)


def test_a_peer_that_leaves_or_never_comes_fails_in_one_line_naming_it(pools):
    msg, dt = pools(2).run(job_failures, "peer_closes")[0]
    assert "failed waiting for rank 1 on host" in msg and "the connection ended" in msg and "\n" not in msg
    assert dt < 2.0                          # at once, not after the timeout
    msg, dt = pools(2).run(job_failures, "peer_silent")[0]
    assert "nothing arrived within the collective timeout" in msg and "rank 1" in msg
    assert 2.5 < dt < 5.5                    # the 3 s timeout, not the peer's 6 s


def test_an_interface_this_host_lacks_is_named_with_the_ones_it_has(monkeypatch):
    """GLOO_SOCKET_IFNAME naming no interface here: one line naming the variable, its value and the interfaces
    (gloo's own error, 'ifa != nullptr. Unable to find address for: bogus0', named neither)."""
    import socket

    from tensorpar.launch import check_socket_ifname
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "bogus0")
    with pytest.raises(ValueError, match=r"^GLOO_SOCKET_IFNAME=bogus0: no interface 'bogus0' on host .*; "
                                         r"interfaces here: .*lo"):
        check_socket_ifname()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", socket.if_nameindex()[0][1])
    check_socket_ifname()


def test_loopback_across_hosts_is_refused_before_gloo_waits(monkeypatch):
    """GLOO_SOCKET_IFNAME=lo in a run whose ranks span hosts (WORLD_SIZE > LOCAL_WORLD_SIZE): one line at once, not
    gloo's connect wait (162 s measured on the namespace testbed before this check); on one host lo is right."""
    from tensorpar.launch import check_socket_ifname
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    check_socket_ifname()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"^GLOO_SOCKET_IFNAME=lo: 'lo' is a loopback interface, which the other "
                                         r"hosts of this 4-rank run cannot reach \(host .*\); name the interface"):
        check_socket_ifname()



def test_a_lost_host_is_named_on_ranks_that_are_not_leaders(pools):
    """A rank that is not its host's leader waits in the host's shared memory, not on the link: when its leader
    stops (here: rank 0, which lost host B) or its own host's leader leaves (rank 3), it names the caller's group
    and its hosts too, not only the shared-memory step."""
    msgs = pools(4).run(job_named, 2)
    assert msgs[0].startswith("all_reduce on tp group (rank 0 of 4 on host hostA; the group's other hosts: hostB "
                              "(ranks 2, 3), tensor (10,) torch.float32) failed: waiting for host "), msgs[0]
    assert msgs[1].startswith("all_reduce on tp group (rank 1 of 4 on host hostA; the group's other hosts: hostB "
                              "(ranks 2, 3), tensor (10,) torch.float32) failed: inside host hostA: "), msgs[1]
    assert msgs[3].startswith("all_reduce on tp group (rank 3 of 4 on host hostB; the group's other hosts: hostA "
                              "(ranks 0, 1), tensor (10,) torch.float32) failed: inside host hostB: "), msgs[3]
    assert all("\n" not in m for m in msgs)
