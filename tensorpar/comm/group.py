"""The communication group handle, its collective counter, and the plumbing every collective shares.

:class:`Group` is a group as the layers see it (process group, rank, size, an optional same-host communicator
``fast``); :class:`CommCounter` tallies its collectives while :func:`counting` switches it on; :func:`_run` turns
a failing collective into a :class:`CollectiveError` naming it, and :func:`_sizes` checks the shard sizes of an
uneven split. Re-exported by :mod:`tensorpar.comm`.
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
from tensorpar.cli import TP_COMM  # noqa: E402,F401  the values of ``Group.compression`` (= ``--tp-comm``)


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
        hosts: the hostname of each group rank when the group spans several hosts (set by
            :func:`tensorpar.parallel.init_parallel`), else ``None``: a failed collective names them (which host
            a lost peer is on is what a user needs to look at).
        compression: how :func:`tensorpar.comm.reduce_partial` sums the partials of tensor-parallel regions:
            ``"fp32"`` (default; the exact all-reduce in the tensor's dtype) or ``"int8"`` (blockwise int8 on
            the wire, :func:`tensorpar.comm.compress.all_reduce_int8`); ``--tp-comm`` sets it.
    """

    pg: Any
    rank: int
    size: int
    name: str = "tp"
    counter: CommCounter = field(default_factory=CommCounter)
    fast: Any = None
    compression: str = "fp32"
    hosts: tuple[str, ...] | None = None

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


def _gather_sizes(x: torch.Tensor, group: Group, dim: int, sizes: SizesLike) -> list[int]:
    """Every rank's shard size along ``dim`` for an all-gather of ``x`` (``sizes``, or ``x``'s size on every rank).
    Raises ValueError when ``x`` is not this rank's shard."""
    s = list(sizes.sizes if isinstance(sizes, Partition) else sizes) if sizes is not None else [x.shape[dim]] * group.size
    if len(s) != group.size or s[group.rank] != x.shape[dim]:
        raise ValueError(f"all_gather on {group.name}: local size {x.shape[dim]} along dim {dim} does not match "
                         f"shard sizes {s} at rank {group.rank}")
    return s


def _run(kind: str, group: Group, t: torch.Tensor, fn):
    try:
        return fn()
    except (RuntimeError, dist.DistError) as e:  # gloo timeouts and peer failures land here
        raise failed(kind, group, t, str(e)) from e


def failed(kind: str, group: Group, t: torch.Tensor, why: str) -> CollectiveError:
    """The error of collective ``kind`` on ``group`` for tensor ``t``: one line naming the collective, the group,
    this rank and, for a group across hosts, this rank's host and the group's other hosts, then ``why``."""
    where = ""
    if group.hosts is not None:     # across hosts: which host this rank is on and which hosts it waited for
        others = sorted({h for i, h in enumerate(group.hosts) if i != group.rank and h != group.hosts[group.rank]})

        def ranks(h):
            on = [str(i) for i, x in enumerate(group.hosts) if x == h]
            return f"rank{'s' if len(on) > 1 else ''} {', '.join(on)}"
        peers = ", ".join(f"{h} ({ranks(h)})" for h in others)
        where = f" on host {group.hosts[group.rank]}; the group's other hosts: {peers}"
    return CollectiveError(f"{kind} on {group.name} group (rank {group.rank} of {group.size}{where}, tensor "
                           f"{tuple(t.shape)} {t.dtype}) failed: {why}")


# torch >= 2.10 renamed the tensor forms of all-gather and reduce-scatter; use whichever exists.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _use_fast(group: Group, t: torch.Tensor) -> bool:
    return group.fast is not None and t.is_cpu
