"""Shared-memory collectives: parity with gloo, determinism, chunking, autograd, bad input.

Exactness policy (see tensorpar.testing): the shared-memory sum is taken in rank order and
every rank computes (or copies) the same bits, so results are bit-identical across ranks
always; against gloo they are bit-identical at 2 ranks (``x0 + x1 == x1 + x0``) and ``close``
at 3 and 4 ranks (gloo's ring adds the same terms in another order). Data movement (all-gather,
broadcast) and max are exact at every size.
"""
import pytest
import torch

from tensorpar import comm
from tensorpar.comm import CollectiveError
from tensorpar.shm import disable_fast_collectives, enable_fast_collectives
from tensorpar.testing import assert_parity
from tests.core import test_collectives
from tests._shm import fast_twin, fingerprint, with_tp

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# 1 element .. 1 MiB of fp32, odd sizes included; with a 64 KiB slot the large ones take many chunks
NUMELS = (1, 7, 1000, 1024, 16 * 1024 + 3, 262_144)


def _x(r, numel, dtype, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + r)
    return torch.randn(numel, generator=g).to(dtype)


def _compare(name, fast, ref, n, exact_at_2=True):
    if n == 2 and exact_at_2:
        assert torch.equal(fast, ref), f"{name}: not bit-identical to gloo at 2 ranks"
    else:
        assert_parity(name, fast, ref, "close")


def job_all_reduce_vs_gloo(ctx, slot_bytes, oneshot_bytes, numels):
    plain, n, r = ctx.tp, ctx.tp.size, ctx.tp.rank
    g = fast_twin(ctx, slot_bytes=slot_bytes, oneshot_bytes=oneshot_bytes)
    prints = []
    try:
        for dtype in DTYPES:
            for numel in numels:
                x = _x(r, numel, dtype)
                fast = comm.all_reduce(x, g)
                _compare(f"sum {dtype} x{numel}", fast, comm.all_reduce(x, plain), n)
                mx = comm.all_reduce(x, g, op="max")
                assert torch.equal(mx, comm.all_reduce(x, plain, op="max")), f"max {dtype} x{numel}"
                prints.append((fingerprint(fast), fingerprint(mx)))
        assert g.fast.calls == 2 * len(DTYPES) * len(numels)
    finally:
        disable_fast_collectives(g)
    return prints


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_all_reduce_matches_gloo_and_is_identical_on_every_rank(pools, tp):
    # one-shot up to 256 KiB in 2 MiB slots; two-shot above 4 KiB in 64 KiB slots (chunked)
    for slot, oneshot, numels in ((2 << 20, 256 << 10, NUMELS), (64 << 10, 4 << 10, NUMELS[-2:])):
        prints = pools(tp).run(job_all_reduce_vs_gloo, slot, oneshot, numels)
        assert all(p == prints[0] for p in prints), f"ranks disagree (slot {slot}, oneshot {oneshot})"


def job_all_reduce_parts(ctx, oneshot_bytes):
    """all_reduce_parts of one tensor within the one-shot size and of one above it: the rank-order sum of the
    returned copies, as a tensor, against all_reduce."""
    import ctypes
    g = fast_twin(ctx, slot_bytes=64 << 10, oneshot_bytes=oneshot_bytes)
    out = []
    try:
        for numel in (oneshot_bytes // 4, oneshot_bytes // 4 + 5, 3 * oneshot_bytes):
            x = _x(ctx.tp.rank, numel, torch.float32, seed=numel)
            addrs = g.fast.all_reduce_parts(x)
            parts = [torch.frombuffer((ctypes.c_float * numel).from_address(a), dtype=torch.float32).clone()
                     for a in addrs]
            got = parts[0]
            for p in parts[1:]:
                got = got + p
            out.append((len(addrs), torch.equal(got, comm.all_reduce(x, g)), fingerprint(got)))
    finally:
        disable_fast_collectives(g)
    return out


@pytest.mark.parametrize("tp", [2, 3])
def test_all_reduce_parts_above_the_one_shot_size_is_the_all_reduce(pools, tp):
    """Within the one-shot size every rank's copy comes back (the caller adds them in rank order); above it (a
    decode step of many rows of a wide model) one address, of the two-shot sum: both give all_reduce's bits."""
    res = pools(tp).run(job_all_reduce_parts, 4 << 10)
    for r, out in enumerate(res):
        assert [n for n, _, _ in out] == [tp, 1, 1], f"rank {r}: {out}"
        assert all(same for _, same, _ in out), f"rank {r}: differs from all_reduce"
        assert [f for _, _, f in out] == [f for _, _, f in res[0]], f"rank {r} differs from rank 0"


def job_64mb(ctx):
    g = fast_twin(ctx)
    try:
        x = _x(ctx.tp.rank, 16 * 1024 * 1024, torch.float32)  # 64 MiB
        fast = comm.all_reduce(x, g)
        same = torch.equal(fast, comm.all_reduce(x, ctx.tp))
        return same, fingerprint(fast)
    finally:
        disable_fast_collectives(g)


def test_64mb_all_reduce_equals_gloo(pools):
    out = pools(2).run(job_64mb)
    assert all(same for same, _ in out), "64 MiB all-reduce differs from gloo"
    assert out[0][1] == out[1][1]


def job_gather_scatter_broadcast(ctx, slot_bytes):
    plain, n, r = ctx.tp, ctx.tp.size, ctx.tp.rank
    g = fast_twin(ctx, slot_bytes=slot_bytes)
    try:
        for dtype in DTYPES:
            # unequal shards, one of them empty, along the first, a middle and the last dim
            sizes = [(3 * i + 1) % 5 for i in range(n)]
            for dim, shape in ((0, (None, 3, 70)), (1, (2, None, 300)), (2, (4, 33, None))):
                shp = tuple(sizes[r] if d is None else d for d in shape)
                x = torch.randn(shp, generator=torch.Generator().manual_seed(r)).to(dtype)
                assert torch.equal(comm.all_gather(x, g, dim=dim, sizes=sizes),
                                   comm.all_gather(x, plain, dim=dim, sizes=sizes)), f"all_gather {dtype} dim {dim}"
                full = list(shp)
                full[dim] = sum(sizes)
                y = torch.randn(full, generator=torch.Generator().manual_seed(10 + r)).to(dtype)
                rs = comm.reduce_scatter(y, g, dim=dim, sizes=sizes)
                ref = comm.reduce_scatter(y, plain, dim=dim, sizes=sizes)
                _compare(f"reduce_scatter {dtype} dim {dim}", rs, ref, n)
            for src in range(n):
                x = _x(r, 5000 + src, dtype).view(-1, 1)
                b = comm.broadcast(x, g, src=src)
                assert torch.equal(b, _x(src, 5000 + src, dtype).view(-1, 1)), f"broadcast {dtype} src {src}"
        # results are new tensors: a second call must not change the first one's value
        a = comm.broadcast(torch.full((4,), float(r)), g, src=0)
        comm.broadcast(torch.full((4,), 7.0), g, src=0)
        assert torch.equal(a, torch.zeros(4))
    finally:
        disable_fast_collectives(g)
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_all_gather_reduce_scatter_broadcast_match_gloo(pools, tp):
    assert all(pools(tp).run(job_gather_scatter_broadcast, 2 << 20))
    assert all(pools(tp).run(job_gather_scatter_broadcast, 8192))   # chunked through 8 KiB slots


def job_core_jobs_through_shm(ctx):
    g = fast_twin(ctx)
    try:
        fctx = with_tp(ctx, g)
        assert test_collectives.job_raw(fctx) and test_collectives.job_autograd(fctx)
        before = g.fast.calls
        summary = test_collectives.job_counter(fctx)
        return summary, g.fast.calls - before
    finally:
        disable_fast_collectives(g)


@pytest.mark.parametrize("tp", [2, 3])
def test_core_collective_tests_pass_through_shm(pools, tp):
    out = pools(tp).run(job_core_jobs_through_shm)
    summary, shm_calls = out[0]
    assert shm_calls == 3, "the counter job's three collectives should have run through shared memory"
    assert summary["all_reduce"]["calls"] == 1 and summary["all_reduce"]["bytes"] == 96


# ---------------------------------------------------------------- bad input


def _error_of(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


def job_mismatches(ctx):
    g = fast_twin(ctx)
    r = g.rank
    try:
        msgs = {
            "numel": _error_of(lambda: comm.all_reduce(torch.ones(8 + r), g)),
            "numel_large": _error_of(lambda: comm.all_reduce(torch.ones(100_000 * (1 + r)), g)),
            # one-shot on rank 0, two-shot on rank 1: still one step each before the check
            "numel_mixed": _error_of(lambda: comm.all_reduce(torch.ones(1000 if r == 0 else 100_000), g)),
            "dtype": _error_of(lambda: comm.all_reduce(torch.ones(8, dtype=(torch.float32, torch.bfloat16)[r % 2]), g)),
            "shape": _error_of(lambda: comm.all_reduce(torch.ones((2, 4) if r else (4, 2)), g)),
            "op": _error_of(lambda: comm.all_reduce(torch.ones(8), g, op="min")),
            "kind": _error_of(lambda: comm.broadcast(torch.ones(8), g) if r else comm.all_reduce(torch.ones(8), g)),
            # each rank's own shard matches its own list, but the lists differ: [1, 2] vs [2, 2]
            "sizes": _error_of(lambda: comm.all_gather(torch.ones(2, 1 + r), g, dim=1, sizes=[1 + r, 2])),
        }
        # the communicator survives bad input
        ok = torch.equal(comm.all_reduce(torch.ones(3), g), torch.full((3,), float(g.size)))
    finally:
        disable_fast_collectives(g)
    return msgs, ok


def test_mismatched_tensors_raise_value_error_on_every_rank(pools):
    for msgs, ok in pools(2).run(job_mismatches):
        assert ok
        assert ("rank 0: all_reduce(op=sum, 8 x torch.float32); rank 1: all_reduce(op=sum, 9 x torch.float32)"
                in msgs["numel"])
        assert "100000 x" in msgs["numel_large"] and "200000 x" in msgs["numel_large"]
        assert "1000 x" in msgs["numel_mixed"] and "100000 x" in msgs["numel_mixed"]
        assert "torch.bfloat16" in msgs["dtype"] and "torch.float32" in msgs["dtype"]
        assert "other shape" in msgs["shape"]
        assert "op must be one of" in msgs["op"]
        assert "broadcast(" in msgs["kind"] and "all_reduce(" in msgs["kind"]
        assert "rank 0: all_gather(6 x torch.float32); rank 1: all_gather(8 x torch.float32)" in msgs["sizes"]


def job_mode(ctx, mode, host_of_rank):
    g = comm.Group(pg=ctx.tp.pg, rank=ctx.tp.rank, size=ctx.tp.size)
    try:
        return enable_fast_collectives(g, mode, host_id=host_of_rank[g.rank]), g.fast is not None
    except ValueError as e:
        return str(e), g.fast is not None
    finally:
        disable_fast_collectives(g)


def test_modes_and_mixed_hosts(pools):
    p = pools(2)
    assert p.run(job_mode, "auto", [None, None]) == [(True, True)] * 2
    assert p.run(job_mode, "off", [None, None]) == [(False, False)] * 2
    assert p.run(job_mode, "auto", ["hostA", "hostB"]) == [(True, True)] * 2     # hierarchical, TCP between hosts
    for msg, installed in p.run(job_mode, "on", ["hostA", "hostB"]):
        assert not installed
        assert "needs every rank of the tp group on one host" in msg and "'hostB': ranks [1]" in msg


def test_bad_settings_raise_value_error_naming_them():
    g = comm.Group.single()
    with pytest.raises(ValueError, match="mode must be one of"):
        enable_fast_collectives(g, "fast")
    with pytest.raises(ValueError, match="slot_bytes must be a positive multiple of 4096, got 1000"):
        enable_fast_collectives(g, slot_bytes=1000)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        enable_fast_collectives(g, timeout_s=0)
    assert enable_fast_collectives(g, "on") is False     # one rank: nothing to share


def job_disabled_after_error_is_unusable(ctx):
    g = fast_twin(ctx)
    g.fast.close()
    try:
        comm.all_reduce(torch.ones(2), g)
    except CollectiveError as e:
        return str(e)
    finally:
        disable_fast_collectives(g)
    return "no error"


def test_closed_communicator_raises(pools):
    for msg in pools(2).run(job_disabled_after_error_is_unusable):
        assert "unusable because it was closed" in msg
