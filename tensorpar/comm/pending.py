"""The asynchronous raw collectives: issued now, waited for later (:class:`Pending`), so compute overlaps them.

:func:`all_reduce_async`, :func:`all_gather_async` and :func:`reduce_scatter_async` issue the process-group
collective with ``async_op=True`` and return a :class:`Pending` whose ``wait()`` gives the result; on one rank
or on ``group.fast`` they fall back to the synchronous collectives of :mod:`tensorpar.comm` (complete at issue).
The column-parallel entry of :mod:`tensorpar.layers.linear` uses them. Re-exported by :mod:`tensorpar.comm`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tensorpar.comm import all_gather, all_reduce, reduce_scatter
from tensorpar.comm.group import (_ALL_GATHER, _REDUCE_SCATTER, Group, SizesLike, _gather_sizes, _run, _sizes,
                                  _use_fast)


class Pending:
    """A collective that was issued and may still be running; :meth:`wait` returns its result.

    The process-group path issues the collective with ``async_op=True``, so the caller can compute while
    it runs (gloo runs it on its own thread; NCCL on its stream). ``group.fast`` (a same-host
    communicator) and one-rank groups complete at issue. Each pending collective must be waited for once,
    in the same order on every rank.
    """

    def __init__(self, kind: str, group: Group, t: torch.Tensor, work=None, finish=None, result=None):
        self._kind, self._group, self._t = kind, group, t
        self._work, self._finish, self._result = work, finish, result

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            t0 = self._group.counter.start()
            work, self._work = self._work, None
            _run(self._kind, self._group, self._t, work.wait)
            self._group.counter.blocked(self._kind, t0)
            self._result = self._finish()
        return self._result


def _async_ok(group: Group, x: torch.Tensor) -> bool:
    # ``group.fast`` (tensorpar.shm) runs synchronously, on purpose. Its collectives are memcpy and adds done by
    # the calling rank itself (no transport thread, unlike gloo), and ShmCommunicator takes one thread per rank.
    # Running them on a helper thread (one at a time, in issue order) was measured in bench/bench_train.py
    # ("overlap on a helper thread (experiment)" rows, bench/results/train*.md): 2-5% faster in the quietest
    # run (load 3), faster in two louder runs and slower in one, so not yet adopted; with one core per rank
    # the helper's copies and adds compete with the weight-gradient matmul for that core. A library version needs
    # ShmCommunicator.close() to wait for an in-flight collective on the helper (close unmaps the segment).
    return group.size > 1 and group.pg is not None and not _use_fast(group, x)


def all_reduce_async(x: torch.Tensor, group: Group) -> Pending:
    """Start the sum of ``x`` over the group; ``.wait()`` returns it. ``x`` (contiguous) is overwritten
    with the sum: pass a tensor nobody else reads. Falls back to :func:`all_reduce` (complete at issue)
    on one rank or on ``group.fast``."""
    if not _async_ok(group, x) or not x.is_contiguous():
        return Pending("all_reduce", group, x, result=all_reduce(x, group))
    group.counter.record("all_reduce", x.numel(), x.element_size(), group.size)
    work = _run("all_reduce", group, x, lambda: dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group.pg,
                                                              async_op=True))
    return Pending("all_reduce", group, x, work, lambda: x)


def all_gather_async(x: torch.Tensor, group: Group, dim: int = -1, sizes: SizesLike = None) -> Pending:
    """Start :func:`all_gather` (same shapes, unequal ``sizes`` allowed); ``.wait()`` returns the result."""
    if not _async_ok(group, x):
        return Pending("all_gather", group, x, result=all_gather(x, group, dim, sizes))
    dim = dim % x.dim()
    s = _gather_sizes(x, group, dim, sizes)
    group.counter.record("all_gather", x.numel() // max(x.shape[dim], 1) * sum(s), x.element_size(), group.size)
    m = max(s)
    xm = x.movedim(dim, 0)
    if xm.shape[0] < m:
        xm = torch.cat([xm, xm.new_zeros((m - xm.shape[0],) + xm.shape[1:])])
    xm = xm.contiguous()
    out = xm.new_empty((group.size * m,) + xm.shape[1:])
    work = _run("all_gather", group, xm, lambda: _ALL_GATHER(out, xm, group=group.pg, async_op=True))

    def finish():
        return torch.cat([out[r * m: r * m + s[r]] for r in range(group.size)]).movedim(0, dim)
    return Pending("all_gather", group, xm, work, finish)


def reduce_scatter_async(x: torch.Tensor, group: Group, dim: int = -1, sizes: SizesLike = None) -> Pending:
    """Start :func:`reduce_scatter` (same shapes, unequal ``sizes`` allowed); ``.wait()`` returns the shard."""
    if not _async_ok(group, x):
        return Pending("reduce_scatter", group, x, result=reduce_scatter(x, group, dim, sizes))
    dim = dim % x.dim()
    s = _sizes(sizes, group, x.shape[dim], f"dim {dim}")
    if sum(s) != x.shape[dim]:
        raise ValueError(f"reduce_scatter on {group.name}: dim {dim} has size {x.shape[dim]} but shard sizes {s} "
                         f"sum to {sum(s)}")
    group.counter.record("reduce_scatter", x.numel(), x.element_size(), group.size)
    m = max(s)
    xm = x.movedim(dim, 0)
    if dim == 0 and all(n == m for n in s):
        inp = xm.contiguous()
    else:
        chunks = list(torch.split(xm, s))
        inp = torch.cat([c if c.shape[0] == m else torch.cat([c, c.new_zeros((m - c.shape[0],) + c.shape[1:])])
                         for c in chunks]).contiguous()
    out = inp.new_empty((m,) + inp.shape[1:])
    work = _run("reduce_scatter", group, inp, lambda: _REDUCE_SCATTER(out, inp, group=group.pg, async_op=True))
    return Pending("reduce_scatter", group, inp, work, lambda: out[: s[group.rank]].movedim(0, dim).contiguous())
