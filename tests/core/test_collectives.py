"""Each collective and autograd collective at tp = 1..4, unequal shard sizes, counting, timeouts."""
import pytest
import torch

from tensorpar import comm
from tensorpar.testing import WorkerPool
from tests._ranks import run_tp


def _rank_tensor(r, shape, seed=0):
    g = torch.Generator().manual_seed(seed * 100 + r)
    return torch.randn(shape, generator=g)


def job_raw(ctx):
    tp = ctx.tp
    r, n = tp.rank, tp.size
    xs = [_rank_tensor(i, (3, 5)) for i in range(n)]
    # all_reduce: sum and max, exact against the rank-order sum for n <= 2 and close otherwise
    s = comm.all_reduce(xs[r], tp)
    assert torch.allclose(s, sum(xs), rtol=1e-6, atol=1e-6), (s - sum(xs)).abs().max()
    m = comm.all_reduce(xs[r], tp, op="max")
    assert torch.equal(m, torch.stack(xs).amax(0))
    # all_gather with unequal sizes along dim 1 and dim 0
    sizes = [i + 1 for i in range(n)]
    parts = [_rank_tensor(i, (2, sizes[i], 3), seed=1) for i in range(n)]
    g = comm.all_gather(parts[r], tp, dim=1, sizes=sizes)
    assert torch.equal(g, torch.cat(parts, 1))
    # reduce_scatter with unequal sizes
    fulls = [_rank_tensor(i, (sum(sizes), 4), seed=2) for i in range(n)]
    rs = comm.reduce_scatter(fulls[r], tp, dim=0, sizes=sizes)
    want = sum(fulls).split(sizes)[r]
    assert torch.allclose(rs, want, rtol=1e-6, atol=1e-6)
    # broadcast from the last rank
    b = comm.broadcast(xs[r], tp, src=n - 1)
    assert torch.equal(b, xs[n - 1])
    # split is the inverse of gather
    assert torch.equal(comm.split(g, tp, dim=1, sizes=sizes), parts[r])
    return True


def job_autograd(ctx):
    tp = ctx.tp
    r, n = tp.rank, tp.size
    sizes = [3 + (i % 2) for i in range(n)]       # unequal: 3, 4, 3, 4
    # copy_to: fwd identity, bwd all-reduce
    x = _rank_tensor(0, (2, 5)).requires_grad_()
    y = comm.copy_to_tp_region(x, tp)
    assert torch.equal(y, x)
    gy = _rank_tensor(r, (2, 5), seed=3)
    y.backward(gy)
    assert torch.allclose(x.grad, sum(_rank_tensor(i, (2, 5), seed=3) for i in range(n)), atol=1e-6)
    # reduce_from: fwd all-reduce, bwd identity
    x = _rank_tensor(r, (2, 5)).requires_grad_()
    y = comm.reduce_from_tp_region(x, tp)
    y.backward(gy)
    assert torch.equal(x.grad, gy)
    # scatter_to (last dim): fwd split, bwd all-gather
    full = _rank_tensor(0, (2, sum(sizes))).requires_grad_()
    y = comm.scatter_to_tp_region(full, tp, sizes)
    assert torch.equal(y, full.split(sizes, -1)[r])
    gparts = [_rank_tensor(i, (2, sizes[i]), seed=4) for i in range(n)]
    y.backward(gparts[r])
    assert torch.equal(full.grad, torch.cat(gparts, -1))
    # gather_from (last dim): fwd all-gather, bwd split
    x = _rank_tensor(r, (2, sizes[r]), seed=5).requires_grad_()
    y = comm.gather_from_tp_region(x, tp, sizes)
    assert torch.equal(y, torch.cat([_rank_tensor(i, (2, sizes[i]), seed=5) for i in range(n)], -1))
    gfull = _rank_tensor(0, (2, sum(sizes)), seed=6)
    y.backward(gfull)
    assert torch.equal(x.grad, gfull.split(sizes, -1)[r])
    # sequence pair: gather (bwd reduce-scatter) and reduce-scatter (bwd all-gather), dim 1
    x = _rank_tensor(r, (2, sizes[r], 3), seed=7).requires_grad_()
    y = comm.gather_from_sequence_region(x, tp, dim=1, sizes=sizes)
    gs = [_rank_tensor(i, (2, sum(sizes), 3), seed=8) for i in range(n)]
    y.backward(gs[r])
    assert torch.allclose(x.grad, sum(gs).split(sizes, 1)[r], atol=1e-6)
    x = _rank_tensor(r, (2, sum(sizes), 3), seed=9).requires_grad_()
    y = comm.reduce_scatter_to_sequence_region(x, tp, dim=1, sizes=sizes)
    want = sum(_rank_tensor(i, (2, sum(sizes), 3), seed=9) for i in range(n)).split(sizes, 1)[r]
    assert torch.allclose(y, want, atol=1e-6)
    gp = [_rank_tensor(i, (2, sizes[i], 3), seed=10) for i in range(n)]
    y.backward(gp[r])
    assert torch.equal(x.grad, torch.cat(gp, 1))
    x = _rank_tensor(0, (2, sum(sizes), 3), seed=11).requires_grad_()
    y = comm.scatter_to_sequence_region(x, tp, dim=1, sizes=sizes)
    y.backward(gp[r])
    assert torch.equal(x.grad, torch.cat(gp, 1))
    return True


def job_counter(ctx):
    tp = ctx.tp
    x = torch.ones(4, 6)
    with comm.counting(tp) as c:
        comm.all_reduce(x, tp)
        comm.all_gather(x, tp, dim=0)
        comm.reduce_scatter(torch.ones(4 * tp.size, 6), tp, dim=0)
    return c.summary()


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_raw_collectives(pools, tp):
    assert all(run_tp(pools, tp, job_raw))


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_autograd_collectives(pools, tp):
    assert all(run_tp(pools, tp, job_autograd))


@pytest.mark.parametrize("tp", [1, 3])
def test_counter(pools, tp):
    s = run_tp(pools, tp, job_counter)[0]
    if tp == 1:
        assert s == {}  # collectives at group size 1 are no-ops and issue nothing
        return
    assert s["all_reduce"] == {"calls": 1, "elements": 24, "bytes": 96, "wire_bytes": 2 * 2 / 3 * 96}
    assert s["all_gather"]["elements"] == 24 * tp and s["all_gather"]["wire_bytes"] == pytest.approx(2 / 3 * 96 * 3)
    assert s["reduce_scatter"]["calls"] == 1 and s["reduce_scatter"]["bytes"] == 4 * 3 * 6 * 4


def job_missing_rank(ctx):
    if ctx.tp.rank == 1:
        return "skipped"
    try:
        comm.all_reduce(torch.ones(8), ctx.tp)
    except comm.CollectiveError as e:
        return str(e)
    return "no error"


def test_rank_that_never_joins_fails_within_timeout():
    import time
    with WorkerPool(2, collective_timeout_s=3.0) as pool:
        t0 = time.monotonic()
        out = pool.run(job_missing_rank, timeout_s=60)
        took = time.monotonic() - t0
    assert out[1] == "skipped"
    assert out[0].startswith("all_reduce on tp group (rank 0 of 2"), out[0]
    assert took < 30, took


def job_raises(ctx):
    if ctx.tp.rank == 1:
        raise ValueError("boom on rank 1")
    return 0


def test_rank_failure_shows_traceback():
    from tensorpar.testing import RankFailure
    with WorkerPool(2, collective_timeout_s=5.0) as pool:
        with pytest.raises(RankFailure, match=r"(?s)rank 1.*ValueError: boom on rank 1"):
            pool.run(job_raises)
