"""All communication of tensorpar: a group handle, raw collectives, and autograd collectives.

Every collective here takes its :class:`Group` explicitly and is a no-op when the group has
one rank, so ``tp_size == 1`` runs exactly the single-device computation.

The autograd collectives are the conjugate pairs of Megatron-LM (Shoeybi et al. 2019, the
``f`` and ``g`` operators of Fig. 3; Korthikanti et al. 2022, ``g`` and ``g-bar`` of Fig. 5 for
sequence parallelism). Contract of each, forward / backward:

======================================  =================================  =================================
function                                forward                            backward
======================================  =================================  =================================
copy_to_tp_region                       identity                           all-reduce (sum)
reduce_from_tp_region                   all-reduce (sum)                   identity
scatter_to_tp_region                    split last dim, keep own shard     all-gather last dim
gather_from_tp_region                   all-gather last dim                split last dim
scatter_to_sequence_region              split ``dim``, keep own shard      all-gather ``dim``
gather_from_sequence_region             all-gather ``dim``                 reduce-scatter ``dim``
reduce_scatter_to_sequence_region       reduce-scatter ``dim``             all-gather ``dim``
======================================  =================================  =================================

The column-parallel entry that fuses the collective with the matmuls (saving only the sequence shard
under sequence parallelism, and overlapping the input-gradient collective with the weight-gradient
matmuls) is :func:`tensorpar.layers.linear.column_parallel_linears`; it uses the asynchronous raw
collectives :func:`all_reduce_async`, :func:`all_gather_async` and :func:`reduce_scatter_async`.

Unequal shard sizes work everywhere: pass the :class:`~tensorpar.shard.Partition` (or its
sizes) of the split dimension; all-gather and reduce-scatter pad to the largest shard on the
wire and trim afterwards (gloo needs equal sizes).

Counting: each :class:`Group` owns a :class:`CommCounter`, off by default; switch it on with
``with counting(group) as c:`` to record calls, elements, payload bytes and ring wire bytes of
each collective kind, and the seconds the calling thread spent blocked in them (``seconds``: the
whole call of a synchronous collective, only the ``wait()`` of an asynchronous one, so the exposed
communication time).

Compression for slow links: ``Group.compression = "int8"`` makes :func:`reduce_partial` (the forward all-reduce of
:func:`reduce_from_tp_region` and of the lean decode loop) send blockwise int8 partials in one all-gather instead
of the exact all-reduce; see :mod:`.compress`. Every other all-reduce stays exact.

Layout: :mod:`.group` (:class:`Group`, :class:`CommCounter`, :func:`counting`), :mod:`.pending` (the
asynchronous raw collectives); the synchronous raw collectives and the autograd collectives are defined here,
in one namespace, so that replacing one of them on this module (``setattr(tensorpar.comm, "all_reduce", f)``,
as the benchmarks do to time or trace collectives) also reaches the autograd collectives that call it.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tensorpar.comm.group import (_ALL_GATHER, _REDUCE_SCATTER, TP_COMM, CollectiveError, CommCounter, Group,
                                  SizesLike, _gather_sizes, _run, _sizes, _use_fast, counting)


def all_reduce(x: torch.Tensor, group: Group, op: str = "sum") -> torch.Tensor:
    """Sum (or ``op="max"``) of ``x`` over the group; returns a new tensor of ``x``'s shape."""
    if group.size == 1:
        return x
    group.counter.record("all_reduce", x.numel(), x.element_size(), group.size)
    t0 = group.counter.start()
    y = group.fast.all_reduce(x, op=op) if _use_fast(group, x) else _pg_all_reduce(x, group, op)
    group.counter.blocked("all_reduce", t0)
    return y


def reduce_partial(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum the partial results of a tensor-parallel region over ``group`` as ``group.compression`` says.

    ``"fp32"``: :func:`all_reduce` (exact, in ``x``'s dtype); ``"int8"``:
    :func:`tensorpar.comm.compress.all_reduce_int8` (blockwise int8 partials, one all-gather, float32 sum in rank order; every rank gets the same bits; per block
    error at most ``absmax / 254`` of each rank's partial). Shapes: ``x`` any shape -> same shape and dtype.
    """
    if group.size == 1:
        return x
    if group.compression == "int8":
        from tensorpar.comm.compress import all_reduce_int8
        return all_reduce_int8(x, group)
    return all_reduce(x, group)


def _pg_all_reduce(x: torch.Tensor, group: Group, op: str) -> torch.Tensor:
    y = x.contiguous().clone()
    rop = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    _run("all_reduce", group, y, lambda: dist.all_reduce(y, op=rop, group=group.pg))
    return y


def all_gather(x: torch.Tensor, group: Group, dim: int = -1, sizes: SizesLike = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order.

    Shapes: local ``[..., sizes[rank], ...]`` -> global ``[..., sum(sizes), ...]``.
    """
    if group.size == 1:
        return x
    dim = dim % x.dim()
    s = _gather_sizes(x, group, dim, sizes)
    group.counter.record("all_gather", x.numel() // max(x.shape[dim], 1) * sum(s), x.element_size(), group.size)
    t0 = group.counter.start()
    y = group.fast.all_gather(x, dim=dim, sizes=s) if _use_fast(group, x) else _pg_all_gather(x, group, dim, s)
    group.counter.blocked("all_gather", t0)
    return y


def _pg_all_gather(x: torch.Tensor, group: Group, dim: int, s: list[int]) -> torch.Tensor:
    m = max(s)
    xm = x.movedim(dim, 0)
    if xm.shape[0] < m:
        xm = torch.cat([xm, xm.new_zeros((m - xm.shape[0],) + xm.shape[1:])])
    xm = xm.contiguous()
    out = xm.new_empty((group.size * m,) + xm.shape[1:])
    _run("all_gather", group, xm, lambda: _ALL_GATHER(out, xm, group=group.pg))
    parts = [out[r * m: r * m + s[r]] for r in range(group.size)]
    return torch.cat(parts).movedim(0, dim)


def reduce_scatter(x: torch.Tensor, group: Group, dim: int = -1, sizes: SizesLike = None) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's shard along ``dim``.

    Shapes: global ``[..., sum(sizes), ...]`` -> local ``[..., sizes[rank], ...]``.
    """
    if group.size == 1:
        return x
    dim = dim % x.dim()
    s = _sizes(sizes, group, x.shape[dim], f"dim {dim}")
    if sum(s) != x.shape[dim]:
        raise ValueError(f"reduce_scatter on {group.name}: dim {dim} has size {x.shape[dim]} but shard sizes {s} "
                         f"sum to {sum(s)}")
    group.counter.record("reduce_scatter", x.numel(), x.element_size(), group.size)
    t0 = group.counter.start()
    y = (group.fast.reduce_scatter(x, dim=dim, sizes=s) if _use_fast(group, x)
         else _pg_reduce_scatter(x, group, dim, s))
    group.counter.blocked("reduce_scatter", t0)
    return y


def _pg_reduce_scatter(x: torch.Tensor, group: Group, dim: int, s: list[int]) -> torch.Tensor:
    m = max(s)
    xm = x.movedim(dim, 0)
    chunks = list(torch.split(xm, s))
    padded = [c if c.shape[0] == m else torch.cat([c, c.new_zeros((m - c.shape[0],) + c.shape[1:])]) for c in chunks]
    inp = torch.cat(padded).contiguous()
    out = inp.new_empty((m,) + inp.shape[1:])
    _run("reduce_scatter", group, inp, lambda: _REDUCE_SCATTER(out, inp, group=group.pg))
    return out[: s[group.rank]].movedim(0, dim).contiguous()


def broadcast(x: torch.Tensor, group: Group, src: int = 0) -> torch.Tensor:
    """Every rank gets group-rank ``src``'s ``x`` (same shape and dtype on all ranks)."""
    if group.size == 1:
        return x
    group.counter.record("broadcast", x.numel(), x.element_size(), group.size)
    if _use_fast(group, x):
        return group.fast.broadcast(x, src=src)
    return _pg_broadcast(x, group, src)


def _pg_broadcast(x: torch.Tensor, group: Group, src: int) -> torch.Tensor:
    y = x.contiguous().clone()
    gsrc = dist.get_global_rank(group.pg, src)
    _run("broadcast", group, y, lambda: dist.broadcast(y, src=gsrc, group=group.pg))
    return y


def split(x: torch.Tensor, group: Group, dim: int = -1, sizes: SizesLike = None) -> torch.Tensor:
    """This rank's shard of ``x`` along ``dim`` (no communication)."""
    if group.size == 1:
        return x
    dim = dim % x.dim()
    s = _sizes(sizes, group, x.shape[dim], f"dim {dim}")
    if sum(s) != x.shape[dim]:
        raise ValueError(f"split on {group.name}: dim {dim} has size {x.shape[dim]} but shard sizes {s} sum to {sum(s)}")
    start = sum(s[: group.rank])
    return x.narrow(dim, start, s[group.rank]).contiguous()


def all_gather_json(obj: Any, pg) -> list:
    """Every rank's ``obj`` (anything ``json`` encodes), in group-rank order, over the process group ``pg``.

    The exchange of tensorpar's start-up metadata: JSON bytes in a uint8 tensor, never pickle (torch's
    ``all_gather_object`` unpickles what the peers send). Collective over ``pg``: two sum all-reduces (each rank's
    length in its slot, then its bytes in its row of ``[ranks, longest]`` zeros), because all-reduce is the one
    collective torch runs on a process group it has not registered (the hierarchical all-reduce's leaders'
    group, :func:`tensorpar.shm.hierarchical.make_hierarchical`); on the current CUDA device when ``pg`` is NCCL.
    """
    import json

    data = json.dumps(obj, separators=(",", ":")).encode()
    device = torch.device("cuda", torch.cuda.current_device()) if pg.name() == "nccl" else None
    n, me = pg.size(), pg.rank()
    sizes = torch.zeros(n, dtype=torch.long, device=device)
    sizes[me] = len(data)
    dist.all_reduce(sizes, group=pg)
    m = int(sizes.max())
    out = torch.zeros(n, m, dtype=torch.uint8, device=device)
    if data:
        out[me, : len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(out.device)
    dist.all_reduce(out, group=pg)
    out = out.cpu()
    return [json.loads(bytes(out[r, : int(sizes[r])].tolist()).decode()) for r in range(n)]


class _CopyToTP(torch.autograd.Function):
    """forward: identity; backward: all-reduce."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """forward: all-reduce (:func:`reduce_partial`: compressed when ``group.compression`` says so); backward: identity
    (the exact all-reduce's gradient, also under compression: straight-through)."""

    @staticmethod
    def forward(ctx, x, group):
        return reduce_partial(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Scatter(torch.autograd.Function):
    """forward: split ``dim``; backward: all-gather ``dim``."""

    @staticmethod
    def forward(ctx, x, group, dim, sizes):
        ctx.group, ctx.dim, ctx.sizes = group, dim, sizes
        return split(x, group, dim, sizes)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.group, ctx.dim, ctx.sizes), None, None, None


class _Gather(torch.autograd.Function):
    """forward: all-gather ``dim``; backward: split ``dim``."""

    @staticmethod
    def forward(ctx, x, group, dim, sizes):
        ctx.group, ctx.dim, ctx.sizes = group, dim, sizes
        return all_gather(x, group, dim, sizes)

    @staticmethod
    def backward(ctx, g):
        return split(g, ctx.group, ctx.dim, ctx.sizes), None, None, None


class _GatherSeq(torch.autograd.Function):
    """forward: all-gather ``dim``; backward: reduce-scatter ``dim``."""

    @staticmethod
    def forward(ctx, x, group, dim, sizes):
        ctx.group, ctx.dim, ctx.sizes = group, dim, sizes
        return all_gather(x, group, dim, sizes)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter(g, ctx.group, ctx.dim, ctx.sizes), None, None, None


class _ReduceScatterSeq(torch.autograd.Function):
    """forward: reduce-scatter ``dim``; backward: all-gather ``dim``."""

    @staticmethod
    def forward(ctx, x, group, dim, sizes):
        ctx.group, ctx.dim, ctx.sizes = group, dim, sizes
        return reduce_scatter(x, group, dim, sizes)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.group, ctx.dim, ctx.sizes), None, None, None


def _needs_grad(x: torch.Tensor) -> bool:
    # Without autograd (inference) the raw collective runs directly: Function.apply costs ~15 us.
    return torch.is_grad_enabled() and x.requires_grad


def copy_to_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter a tensor-parallel region with a replicated input. fwd identity / bwd all-reduce."""
    if group.size == 1 or not _needs_grad(x):
        return x
    return _CopyToTP.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum partial results of a tensor-parallel region. fwd all-reduce (:func:`reduce_partial`, so int8 on the wire
    when ``group.compression == "int8"``) / bwd identity."""
    if group.size == 1:
        return x
    return _ReduceFromTP.apply(x, group) if _needs_grad(x) else reduce_partial(x, group)


def scatter_to_tp_region(x: torch.Tensor, group: Group, sizes: SizesLike = None) -> torch.Tensor:
    """Keep this rank's slice of the last dim. fwd split / bwd all-gather. ``[.., n] -> [.., sizes[r]]``."""
    if group.size == 1:
        return x
    return _Scatter.apply(x, group, -1, sizes) if _needs_grad(x) else split(x, group, -1, sizes)


def gather_from_tp_region(x: torch.Tensor, group: Group, sizes: SizesLike = None) -> torch.Tensor:
    """Concatenate last-dim shards. fwd all-gather / bwd split. ``[.., sizes[r]] -> [.., n]``."""
    if group.size == 1:
        return x
    return _Gather.apply(x, group, -1, sizes) if _needs_grad(x) else all_gather(x, group, -1, sizes)


def scatter_to_sequence_region(x: torch.Tensor, group: Group, dim: int = 1, sizes: SizesLike = None) -> torch.Tensor:
    """Enter a sequence-parallel region from a replicated tensor. fwd split ``dim`` / bwd all-gather."""
    if group.size == 1:
        return x
    return _Scatter.apply(x, group, dim, sizes) if _needs_grad(x) else split(x, group, dim, sizes)


def gather_from_sequence_region(x: torch.Tensor, group: Group, dim: int = 1, sizes: SizesLike = None) -> torch.Tensor:
    """Leave a sequence-parallel region into a tensor-parallel one (Korthikanti et al. 2022, ``g``).

    fwd all-gather ``dim`` / bwd reduce-scatter ``dim``. ``[b, s_r, h] -> [b, s, h]`` for ``dim=1``.
    """
    if group.size == 1:
        return x
    return _GatherSeq.apply(x, group, dim, sizes) if _needs_grad(x) else all_gather(x, group, dim, sizes)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: Group, dim: int = 1, sizes: SizesLike = None) -> torch.Tensor:
    """Sum partial results into a sequence-parallel region (Korthikanti et al. 2022, ``g-bar``).

    fwd reduce-scatter ``dim`` / bwd all-gather ``dim``. ``[b, s, h] -> [b, s_r, h]`` for ``dim=1``.
    """
    if group.size == 1:
        return x
    return (_ReduceScatterSeq.apply(x, group, dim, sizes) if _needs_grad(x)
            else reduce_scatter(x, group, dim, sizes))


# the asynchronous raw collectives call the synchronous ones above: imported once these exist
from tensorpar.comm.pending import (Pending, all_gather_async, all_reduce_async,  # noqa: E402
                                    reduce_scatter_async)

__all__ = ["CollectiveError", "CommCounter", "Group", "SizesLike", "TP_COMM", "counting", "all_reduce",
           "reduce_partial", "all_gather",
           "reduce_scatter", "broadcast", "split", "all_gather_json", "Pending", "all_reduce_async",
           "all_gather_async", "reduce_scatter_async", "copy_to_tp_region", "reduce_from_tp_region",
           "scatter_to_tp_region", "gather_from_tp_region", "scatter_to_sequence_region",
           "gather_from_sequence_region", "reduce_scatter_to_sequence_region"]
