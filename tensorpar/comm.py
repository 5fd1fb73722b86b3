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
"""
from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from tensorpar.shard import Partition

SizesLike = Partition | Sequence[int] | None


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the collective, group and tensor."""


@dataclass
class CommCounter:
    """Per-kind tallies of the collectives issued on one group while ``enabled``.

    For a logical tensor of ``B`` bytes (all-reduce: the input; all-gather: the gathered
    output; reduce-scatter: the full input; broadcast: the tensor) on ``t`` ranks:

    * ``calls[kind]`` - number of collectives;
    * ``elements[kind]`` - elements of the logical tensor, summed over calls;
    * ``bytes[kind]`` - ``B``, summed over calls;
    * ``wire_bytes[kind]`` - bytes each rank sends under the ring algorithm: all-reduce
      ``2(t-1)/t * B``, all-gather and reduce-scatter ``(t-1)/t * B``, broadcast ``B`` from the
      source (Patarasuk & Yuan 2009, bandwidth-optimal all-reduce); a float;
    * ``seconds[kind]`` - wall seconds the calling thread spent blocked in the collective (exposed
      communication; an asynchronous collective counts only its ``wait()``).
    """

    enabled: bool = False
    calls: Counter = field(default_factory=Counter)
    elements: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    wire_bytes: Counter = field(default_factory=Counter)
    seconds: Counter = field(default_factory=Counter)
    fingerprint: Any = None  # tensorpar.fingerprint.Fingerprint when collectives are checked, else None

    def record(self, kind: str, numel: int, element_size: int, group_size: int) -> None:
        if self.fingerprint is not None:  # every collective passes here
            self.fingerprint.record(kind, numel, element_size)
        if not self.enabled:
            return
        b = numel * element_size
        t = group_size
        wire = {"all_reduce": 2 * (t - 1) / t * b, "all_gather": (t - 1) / t * b,
                "reduce_scatter": (t - 1) / t * b}.get(kind, float(b))
        self.calls[kind] += 1
        self.elements[kind] += numel
        self.bytes[kind] += b
        self.wire_bytes[kind] += wire

    def blocked(self, kind: str, t0: float | None) -> None:
        """Add the time since ``t0`` (a ``time.perf_counter()``, ``None`` when counting is off) to ``seconds``."""
        if t0 is not None:
            self.seconds[kind] += time.perf_counter() - t0

    def start(self) -> float | None:
        return time.perf_counter() if self.enabled else None

    def reset(self) -> None:
        for c in (self.calls, self.elements, self.bytes, self.wire_bytes, self.seconds):
            c.clear()

    def summary(self) -> dict[str, dict[str, float]]:
        """``{kind: {"calls", "elements", "bytes", "wire_bytes"}}`` for every kind seen (sizes only, so
        equal on every run; the times are in :meth:`exposed_seconds`)."""
        return {k: {"calls": self.calls[k], "elements": self.elements[k], "bytes": self.bytes[k],
                    "wire_bytes": self.wire_bytes[k]} for k in sorted(self.calls)}

    def exposed_seconds(self) -> dict[str, float]:
        """``{kind: seconds}``: wall time the calling thread spent blocked in each kind of collective."""
        return {k: self.seconds[k] for k in sorted(self.seconds)}


@dataclass(eq=False)
class Group:
    """A communication group as the layers see it: process group, this rank, size, counter.

    Attributes:
        pg: the torch.distributed process group, or ``None`` for a group of one rank.
        rank: this process's rank within the group.
        size: number of ranks in the group.
        name: the mesh axis it spans (``"tp"``, ``"dp"``, ``"pp"``), used in messages.
        counter: tallies of collectives, see :class:`CommCounter`.
        fast: optional same-host communicator used for CPU tensors instead of ``pg`` (it must
            offer ``all_reduce``, ``all_gather``, ``reduce_scatter`` and ``broadcast`` with the
            signatures of this module's raw collectives, minus the group).
    """

    pg: Any
    rank: int
    size: int
    name: str = "tp"
    counter: CommCounter = field(default_factory=CommCounter)
    fast: Any = None

    @classmethod
    def single(cls, name: str = "tp") -> "Group":
        """A one-rank group: every collective is the identity."""
        return cls(pg=None, rank=0, size=1, name=name)

    @classmethod
    def from_pg(cls, pg, name: str = "tp") -> "Group":
        return cls(pg=pg, rank=dist.get_rank(pg), size=dist.get_world_size(pg), name=name)

    def partition(self, n: int, *, weights=None, unit: int = 1, what: str = "dimension") -> Partition:
        return Partition.make(n, self.size, weights=weights, unit=unit, name=what)

    def __repr__(self) -> str:
        return f"Group({self.name}, rank={self.rank}, size={self.size})"


@contextlib.contextmanager
def counting(group: Group, reset: bool = True) -> Iterator[CommCounter]:
    """Enable ``group.counter`` for the ``with`` body and yield it."""
    c = group.counter
    if reset:
        c.reset()
    prev, c.enabled = c.enabled, True
    try:
        yield c
    finally:
        c.enabled = prev


def _sizes(sizes: SizesLike, group: Group, n: int, dim_name: str) -> list[int]:
    if sizes is None:
        if n % group.size:
            raise ValueError(f"{dim_name} of size {n} is not divisible by {group.name} size {group.size}; "
                             f"pass the Partition of the uneven split")
        return [n // group.size] * group.size
    s = list(sizes.sizes if isinstance(sizes, Partition) else sizes)
    if len(s) != group.size:
        raise ValueError(f"{len(s)} shard sizes given for a {group.name} group of size {group.size}")
    return s


def _run(kind: str, group: Group, t: torch.Tensor, fn):
    try:
        return fn()
    except (RuntimeError, dist.DistError) as e:  # gloo timeouts and peer failures land here
        raise CollectiveError(
            f"{kind} on {group.name} group (rank {group.rank} of {group.size}, tensor {tuple(t.shape)} "
            f"{t.dtype}) failed: {e}"
        ) from e


# torch >= 2.10 renamed the tensor forms of all-gather and reduce-scatter; use whichever exists.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _use_fast(group: Group, t: torch.Tensor) -> bool:
    return group.fast is not None and t.is_cpu


# ---------------------------------------------------------------- raw collectives (no autograd)
#
# Each public collective validates, records on the counter, then runs either ``group.fast`` (CPU
# tensors, when set) or the torch.distributed implementation ``_pg_*`` below. The ``_pg_*``
# functions take already-validated arguments and are also used by ``tensorpar.shm`` for the
# collectives its hierarchical communicator does not replace.

def all_reduce(x: torch.Tensor, group: Group, op: str = "sum") -> torch.Tensor:
    """Sum (or ``op="max"``) of ``x`` over the group; returns a new tensor of ``x``'s shape."""
    if group.size == 1:
        return x
    group.counter.record("all_reduce", x.numel(), x.element_size(), group.size)
    t0 = group.counter.start()
    y = group.fast.all_reduce(x, op=op) if _use_fast(group, x) else _pg_all_reduce(x, group, op)
    group.counter.blocked("all_reduce", t0)
    return y


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
    s = list(sizes.sizes if isinstance(sizes, Partition) else sizes) if sizes is not None else [x.shape[dim]] * group.size
    if len(s) != group.size or s[group.rank] != x.shape[dim]:
        raise ValueError(f"all_gather on {group.name}: local size {x.shape[dim]} along dim {dim} does not match "
                         f"shard sizes {s} at rank {group.rank}")
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
    ``all_gather_object`` unpickles what the peers send). Collective over ``pg``: two all-gathers (the lengths,
    then the bytes padded to the longest); on the current CUDA device when ``pg`` is NCCL.
    """
    import json

    data = json.dumps(obj, separators=(",", ":")).encode()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(pg) == "nccl" else None
    n = dist.get_world_size(pg)
    size = torch.tensor([len(data)], dtype=torch.long, device=device)
    sizes = torch.empty(n, dtype=torch.long, device=device)
    _ALL_GATHER(sizes, size, group=pg)
    m = int(sizes.max())
    buf = torch.zeros(m, dtype=torch.uint8, device=device)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(buf.device)
    out = torch.empty(n * m, dtype=torch.uint8, device=device)
    _ALL_GATHER(out, buf, group=pg)
    out = out.cpu()
    return [json.loads(bytes(out[r * m: r * m + int(sizes[r])].tolist()).decode()) for r in range(n)]


# ---------------------------------------------------------------- asynchronous raw collectives


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
    s = list(sizes.sizes if isinstance(sizes, Partition) else sizes) if sizes is not None else [x.shape[dim]] * group.size
    if len(s) != group.size or s[group.rank] != x.shape[dim]:
        raise ValueError(f"all_gather on {group.name}: local size {x.shape[dim]} along dim {dim} does not match "
                         f"shard sizes {s} at rank {group.rank}")
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


# ---------------------------------------------------------------- autograd collectives

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
    """forward: all-reduce; backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

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
    """Sum partial results of a tensor-parallel region. fwd all-reduce / bwd identity."""
    if group.size == 1:
        return x
    return _ReduceFromTP.apply(x, group) if _needs_grad(x) else all_reduce(x, group)


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
