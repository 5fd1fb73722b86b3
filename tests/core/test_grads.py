"""tensorpar.grads.grad_norm on every layout: each parameter counted once (tp shards, rows duplicated over tp, whole
experts split over ep, both, replicated ones, pipeline stages), the same bits on every rank.

The parameters are built from full tensors that every rank draws with the same seed; each rank keeps its part and
uses it as the gradient. Oracles: all gradients 1 gives sqrt(N), N the number of elements of the full parameters;
random gradients give torch's norm of the full ones (fp32, 1e-6 relative: the sums of squares are added in another
order)."""
import math

import pytest
import torch

from tensorpar.grads import clip_grad_norm_, grad_norm
from tensorpar.layers.linear import mark_sharded
from tensorpar.parallel import ParallelConfig, ParallelContext
from tensorpar.shard import Partition, UnitSelection
from tensorpar.testing import WorkerPool


def _part(full: torch.Tensor, ctx, *, tp_dim=None, tp_part=None, ep_part=None) -> torch.nn.Parameter:
    """This rank's part of ``full`` as a parameter carrying the metadata the styles set, its gradient that part."""
    t = full
    if ep_part is not None:
        a, z = ep_part.range(ctx.dp.rank)
        t = t[a:z]
    if tp_dim is not None:
        t = t.index_select(tp_dim, torch.tensor(tp_part.indices(ctx.tp.rank)))
    p = torch.nn.Parameter(t.clone())
    if tp_dim is not None:
        mark_sharded(p, tp_dim, tp_part)
    if ep_part is not None:
        p.ep_dim, p.ep_partition = 0, ep_part
    p.grad = t.clone()
    return p


def _stage(ctx, stage: int, ones: bool):
    """The parameters of pipeline stage ``stage`` on this rank, and their full tensors (stages differ in size)."""
    g = torch.Generator().manual_seed(stage)
    k = stage + 1
    draw = (lambda *s: torch.ones(s)) if ones else (lambda *s: torch.randn(s, generator=g))
    tp, ep = ctx.tp.size, ctx.dp.size
    full = dict(rep=draw(5, 3 * k), rows=draw(7 * k, 3), cols=draw(3, 9), dup=draw(6, 4 * k), experts=draw(4, 6, 2 * k))
    kv = UnitSelection(3, 2, ((0, 1), (1, 2)) if tp == 2 else ((0, 1, 2),))     # unit 1 held by both tp ranks
    ps = [_part(full["rep"], ctx),
          _part(full["rows"], ctx, tp_dim=0, tp_part=Partition.make(7 * k, tp)),
          _part(full["cols"], ctx, tp_dim=1, tp_part=Partition.make(9, tp, weights=[2, 1][:tp] if tp == 2 else None)),
          _part(full["dup"], ctx, tp_dim=0, tp_part=kv),
          _part(full["experts"], ctx, tp_dim=1, tp_part=Partition.make(6, tp), ep_part=Partition.make(4, ep))]
    return ps + [ps[0]], list(full.values())          # ps[0] again: a tied weight is counted once


def job_norm(ctx, ones: bool):
    stage = ctx.pp.rank
    ps, _ = _stage(ctx, stage, ones)
    ep = ctx.dp if ctx.dp.size > 1 else None
    got = grad_norm(ps, ctx.tp, ep=ep, pp=ctx.pp)
    fulls = [t for s in range(ctx.pp.size) for t in _stage(ctx, s, ones)[1]]
    want = torch.cat([t.flatten() for t in fulls]).norm()
    n = sum(t.numel() for t in fulls)
    err = None
    if ep is not None:
        try:
            grad_norm(ps, ctx.tp, pp=ctx.pp)
        except ValueError as e:
            err = str(e)
    return got.item(), want.item(), n, err


# tp2 x ep2 is slow-marked: test_families_moe's tp x ep test checks the same oracle on real models in CI
@pytest.mark.parametrize("layout", [pytest.param(dict(tp=2, dp=2), marks=pytest.mark.slow), dict(tp=2, pp=2)],
                         ids=["tp2xep2", "tp2xpp2"])
def test_grad_norm_counts_every_parameter_once(layout):
    with WorkerPool(4, ParallelConfig(**layout), collective_timeout_s=60.0) as pool:
        for ones in (True, False):
            out = pool.run(job_norm, ones)
            got = [g for g, *_ in out]
            assert len(set(got)) == 1, f"ranks disagree on the grad norm: {got}"   # float equality: the same bits
            _, want, n, err = out[0]
            if ones:
                assert got[0] == pytest.approx(math.sqrt(n), rel=1e-6), (got[0], math.sqrt(n))
            assert got[0] == pytest.approx(want, rel=1e-6), (got[0], want)
            if "dp" in layout:
                assert err and "pass that group as ep=" in err, err


def test_grad_norm_one_process_and_clip():
    """One rank: the norm of the tensors, a tied weight once; clipping scales to max_norm."""
    tp = ParallelContext.single().tp
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))
    a.grad, b.grad = torch.tensor([1.0, 2.0, 2.0]), torch.full((2, 2), 2.0)
    assert grad_norm([a, b, a], tp).item() == pytest.approx(5.0, rel=1e-7)
    assert clip_grad_norm_([a, b], 1.0, tp).item() == pytest.approx(5.0, rel=1e-7)
    assert grad_norm([a, b], tp).item() == pytest.approx(1.0, rel=1e-6)
