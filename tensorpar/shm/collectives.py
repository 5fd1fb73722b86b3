"""Collectives over one shared segment: all-reduce, all-gather, reduce-scatter, broadcast, reduce.

Protocol. Every collective is a sequence of *steps*. In a step each rank copies (at most
``slot_bytes`` of) its contribution into its own slot of buffer ``p = arrivals % 2``, writes the
step's metadata into its control line, then stores its new arrival count; it then waits until
every peer's count has reached the same value, checks that every peer described the same
collective, and reads what it needs from the peers' slots of buffer ``p``. One barrier per step
is enough because of the two buffers: a rank writes buffer ``p`` again only two steps later,
after the intermediate step's barrier, which no peer passes before it has finished reading
buffer ``p`` (the read is program-ordered before its next arrival).

Memory ordering relied on (x86-64, TSO): the data copy and the metadata stores are issued
before the store of the arrival count, and x86-64 never makes a store visible before an earlier
one; a reader that loads the new count therefore sees the data (loads are not reordered with
older loads either). glibc's ``memmove`` ends its non-temporal-store path with ``sfence``, so
large copies are ordered too. Each control word is an aligned int64 written by one rank only, so
its loads and stores are single atomic accesses; no read-modify-write is ever needed. The
compiler cannot reorder across these points because each is a separate call from Python.

Determinism: reductions add the ranks' contributions in rank order, ``((x0 + x1) + x2) + ...``,
in the tensor's own dtype (as gloo does), and every element is reduced by exactly one rank
(small messages: by every rank, identically) from identical inputs with identical slot
alignment, so every rank gets the same bits. For two ranks this is ``x0 + x1``, which equals
gloo's result bit for bit because IEEE addition is commutative.

Algorithms: an all-reduce of at most ``oneshot_bytes`` is one step in which every rank sums all
slots ("one-shot"); a larger one is a reduce-scatter (each rank sums its ``1/n`` of each chunk)
followed by an all-gather ("two-shot"), which reads ``2 B`` per rank instead of ``n B``. Messages
larger than a slot go through in slot-sized chunks, one step each.
"""
from __future__ import annotations

import ctypes
import math
import time
import types
import zlib

import torch

from tensorpar.comm import CollectiveError
from tensorpar.shm.segment import (G_ABORT_PEER, G_ABORT_RANK, G_ABORT_WHY, STATE_ACTIVE, STATE_BROKEN, STATE_CLOSED,
                                   W_ARRIVED, W_META, W_STATE, Segment)
from tensorpar.shm.sync import Peer, WaitPolicy, wait_slow

KINDS = ("", "all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")
K_AR, K_AG, K_RS, K_BC, K_RD = 1, 2, 3, 4, 5
OPS = types.MappingProxyType({"sum": 1, "max": 2})
OP_INVALID = 15
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
DTYPE_CODES = types.MappingProxyType({dt: i + 1 for i, dt in enumerate(_DTYPES)})
_NUMEL_BITS = 40
_ALIGN_ELEMS = 64          # two-shot portions start on a 64-element boundary (whole cache lines)
_MAX_CACHED_PLANS = 256   # distinct call signatures remembered (prefill lengths vary; decode repeats)


def _dtype_code(dt: torch.dtype) -> int:
    code = DTYPE_CODES.get(dt)
    return code if code is not None else 0x80 | (zlib.crc32(str(dt).encode()) & 0x7F)


def _meta(kind: int, op: int, dtype: torch.dtype, numel: int) -> int:
    """Pack a step's description into one int64 word: numel (40 bits), dtype, op, kind."""
    if numel >= 1 << _NUMEL_BITS:
        raise ValueError(f"shared-memory collectives take at most 2**{_NUMEL_BITS} elements, got {numel}")
    return numel | _dtype_code(dtype) << 40 | op << 48 | kind << 52


def _describe(a: int) -> str:
    numel, code, op, kind = a & ((1 << _NUMEL_BITS) - 1), (a >> 40) & 0xFF, (a >> 48) & 0xF, (a >> 52) & 0xF
    dtype = next((str(dt) for dt, c in DTYPE_CODES.items() if c == code), f"dtype#{code}")
    ops = {v: k for k, v in OPS.items()}
    kname = KINDS[kind] if kind < len(KINDS) else f"kind#{kind}"
    return f"{kname}({'op=' + ops.get(op, repr('invalid')) + ', ' if kind in (K_AR, K_RD) else ''}{numel} x {dtype})"


def _reduce_into(dst: torch.Tensor, parts: list[torch.Tensor], opc: int) -> torch.Tensor:
    """``dst = ((parts[0] op parts[1]) op parts[2]) ...`` in rank order."""
    if opc == 1:
        torch.add(parts[0], parts[1], out=dst)
        for v in parts[2:]:
            dst.add_(v)
    else:
        torch.maximum(parts[0], parts[1], out=dst)
        for v in parts[2:]:
            torch.maximum(dst, v, out=dst)
    return dst


class ShmCommunicator:
    """Collectives among ``size`` processes of one host that have mapped the same :class:`Segment`.

    Built by :func:`tensorpar.shm.enable_fast_collectives` (or the hierarchical builder), which
    create the segment and exchange its name; every method is collective: all ranks must call
    the same methods in the same order with matching tensors. Every method takes CPU tensors,
    returns a new tensor (never a view of shared memory) and raises:

    * ``ValueError`` on every rank if the ranks disagree on the collective, dtype, element count,
      shape or shard sizes (the communicator stays usable);
    * :class:`~tensorpar.comm.CollectiveError` if a peer does not arrive within ``timeout_s``,
      exits, closes, or broke an earlier collective; the communicator is then unusable and
      every later call raises at once.

    Not thread-safe: one thread per rank issues the collectives.

    Args:
        segment: the mapped segment (this object owns and closes it).
        rank, size: this process's rank in the group and the group's size (>= 2).
        peers: :class:`Peer` (pid, start time) of every rank, in rank order.
        group_name: axis name used in messages.
        timeout_s: how long to wait for a peer at any one step.
        policy: the spin / yield / sleep schedule.
        oneshot_bytes: all-reduces up to this size use the one-shot algorithm.
    """

    def __init__(self, segment: Segment, rank: int, size: int, peers: list[Peer], *, group_name: str = "tp",
                 timeout_s: float = 120.0, policy: WaitPolicy | None = None, oneshot_bytes: int = 256 * 1024):
        if size < 2 or not 0 <= rank < size or len(peers) != size:
            raise ValueError(f"ShmCommunicator needs size >= 2, 0 <= rank < size and one peer per rank; got "
                             f"rank={rank}, size={size}, {len(peers)} peers")
        self.segment, self.rank, self.size, self.peers = segment, rank, size, peers
        self.group_name, self.timeout_s = group_name, timeout_s
        self.policy = policy or WaitPolicy()
        lay = segment.layout
        self.slot_bytes = lay.slot_bytes
        self.oneshot_bytes = min(oneshot_bytes, lay.slot_bytes)
        self._ctl = segment.ctl
        self._lines = [lay.line(r) for r in range(size)]
        self._me = self._lines[rank]
        self._others = [(r, self._lines[r]) for r in range(size) if r != rank]
        self._addr = [segment.base + lay.slot(rank, p) for p in (0, 1)]
        self._slots = [[segment.data[lay.slot(r, p): lay.slot(r, p) + lay.slot_bytes] for r in range(size)]
                       for p in (0, 1)]
        self._spin_ns = int(self.policy.spin_us * 1e3)
        self._seq = self._ctl[self._me + W_ARRIVED]
        self._calls = 0
        self._plans: dict = {}                    # call signature -> metadata words and slot views
        self._broken: str | None = None
        self._waiting_for = -1                     # peer of the current slow wait, for abort messages
        self._deadline_ns = 0
        self._memmove = ctypes.memmove
        self._ctl[self._me + W_STATE] = STATE_ACTIVE

    @property
    def calls(self) -> int:
        """Number of collectives started on this communicator."""
        return self._calls

    # ------------------------------------------------------------ protocol

    def _arrive(self, p: int, a: int, b: int, kind: int) -> None:
        """Publish metadata ``(a, b)`` and the next arrival count, wait for all peers, compare metadata."""
        ctl, me = self._ctl, self._me
        ctl[me + W_META + 2 * p] = a
        ctl[me + W_META + 2 * p + 1] = b
        seq = self._seq + 1
        self._seq = seq
        ctl[me] = seq                                  # W_ARRIVED == 0: the release store
        self._deadline_ns = 0                          # set by the first slow wait of this step
        for r, line in self._others:
            if ctl[line] < seq:
                self._wait(r, line, seq, kind)
        for r, line in self._others:
            if ctl[line + W_META + 2 * p] != a or ctl[line + W_META + 2 * p + 1] != b:
                self._mismatch(p, a, b, kind)

    def _wait(self, r: int, line: int, target: int, kind: int) -> None:
        ctl = self._ctl
        self._waiting_for = r
        end = time.perf_counter_ns() + self._spin_ns
        while ctl[line] < target:
            if time.perf_counter_ns() > end:
                if not self._deadline_ns:              # one deadline per step, however many peers are late
                    self._deadline_ns = time.monotonic_ns() + int(self.timeout_s * 1e9)
                wait_slow(ctl, line, target, self.peers[r], self.policy, self._deadline_ns, self._what(kind))
                return

    def _what(self, kind: int) -> str:
        return (f"shared-memory {KINDS[kind]} (call #{self._calls}, step {self._seq}) on {self.group_name} group, "
                f"rank {self.rank} of {self.size}, timeout {self.timeout_s:g} s")

    def _mismatch(self, p: int, a: int, b: int, kind: int) -> None:
        rows = []
        for r, line in enumerate(self._lines):
            ra, rb = self._ctl[line + W_META + 2 * p], self._ctl[line + W_META + 2 * p + 1]
            rows.append(f"rank {r}: {_describe(ra)}" + ("" if ra != a or rb == b else " (other shape or sizes)"))
        raise ValueError(f"{KINDS[kind]} on {self.group_name} group: the ranks passed different tensors or "
                         f"arguments; " + "; ".join(rows) + ". Every rank must pass the same dtype, shape (all-reduce, "
                         f"broadcast), shard sizes and dim (all-gather, reduce-scatter) and op")

    def _break(self, exc: BaseException, kind: int) -> None:
        """Mark the communicator unusable here and for the peers (they fail at their next wait)."""
        why = 2 if isinstance(exc, KeyboardInterrupt) else 1 if isinstance(exc, CollectiveError) else 3
        self._broken = f"{KINDS[kind]} failed earlier: {type(exc).__name__}: {exc}"
        ctl = self._ctl
        ctl[self._me + W_STATE] = STATE_BROKEN
        if not ctl[G_ABORT_RANK]:
            ctl[G_ABORT_WHY] = why
            ctl[G_ABORT_PEER] = self._waiting_for
            ctl[G_ABORT_RANK] = self.rank + 1

    def _check_usable(self, kind: int) -> None:
        if self._broken is not None:
            raise CollectiveError(f"{self._what(kind)}: this communicator is unusable because {self._broken}")

    def _run(self, kind: int, fn, *args):
        self._check_usable(kind)
        self._calls += 1
        try:
            return fn(*args)
        except ValueError:
            raise                                      # raised identically on every rank; protocol intact
        except BaseException as e:
            self._break(e, kind)
            raise

    # ------------------------------------------------------------ building blocks

    def _rs_flat(self, flat: torch.Tensor, ranges: list[tuple[int, int]], opc: int, a: int, b: int,
                 kind: int) -> torch.Tensor:
        """Reduce ``flat`` over the ranks; return this rank's ``flat[lo:hi]`` of the sum (``ranges[rank]``)."""
        el, dtype = flat.element_size(), flat.dtype
        per = self.slot_bytes // el
        n = flat.numel()
        lo, hi = ranges[self.rank]
        res = flat.new_empty(hi - lo)
        src = flat.data_ptr()
        for c0 in range(0, max(n, 1), per):
            c1 = min(n, c0 + per)
            p = self._seq & 1
            self._memmove(self._addr[p], src + c0 * el, (c1 - c0) * el)
            self._arrive(p, a, b, kind)
            if opc not in (1, 2):
                raise ValueError(f"{KINDS[kind]}: op must be one of {sorted(OPS)}")
            i0, i1 = max(lo, c0), min(hi, c1)
            if i0 < i1:
                parts = [s.view(dtype)[i0 - c0: i1 - c0] for s in self._slots[p]]
                _reduce_into(res[i0 - lo: i1 - lo], parts, opc)
        return res

    def _ag_flat(self, mine: torch.Tensor, counts: list[int], a: int, b: int, kind: int) -> torch.Tensor:
        """Concatenate every rank's flat ``mine`` (``counts[r]`` elements each) in rank order."""
        el, dtype = mine.element_size(), mine.dtype
        per = self.slot_bytes // el
        offs = [0]
        for c in counts:
            offs.append(offs[-1] + c)
        out = mine.new_empty(offs[-1])
        src, own = mine.data_ptr(), counts[self.rank]
        for c0 in range(0, max(max(counts), 1), per):
            p = self._seq & 1
            if own > c0:
                self._memmove(self._addr[p], src + c0 * el, (min(own, c0 + per) - c0) * el)
            self._arrive(p, a, b, kind)
            for r in range(self.size):
                c1 = min(counts[r], c0 + per)
                if c1 > c0:
                    out[offs[r] + c0: offs[r] + c1].copy_(self._slots[p][r].view(dtype)[: c1 - c0])
        return out

    def _even_ranges(self, n: int) -> list[tuple[int, int]]:
        step = -(-n // self.size)
        step = -(-step // _ALIGN_ELEMS) * _ALIGN_ELEMS
        return [(min(n, r * step), min(n, (r + 1) * step)) for r in range(self.size)]

    # ------------------------------------------------------------ collectives

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Elementwise ``op`` ("sum" or "max") of ``x`` over the ranks, reduced in rank order.

        Shapes: ``x`` any shape, same on every rank -> new tensor of that shape and dtype.
        """
        # The body of _run, inlined: this is the decode hot path, where every call layer costs.
        if self._broken is not None:
            self._check_usable(K_AR)
        self._calls += 1
        try:
            return self._all_reduce(x, op)
        except ValueError:
            raise
        except BaseException as e:
            self._break(e, K_AR)
            raise

    def _all_reduce(self, x: torch.Tensor, op: str) -> torch.Tensor:
        if not x.is_contiguous():
            x = x.contiguous()
        key = (K_AR, x.dtype, x.shape, op)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan_all_reduce(key, x, op)
        nbytes, a, b, opc, views = plan
        if views is None:                              # large (or invalid op): two-shot, chunked
            n = x.numel()
            ranges = self._even_ranges(n)
            res = self._rs_flat(x.view(-1), ranges, opc, a, b, K_AR)
            return self._ag_flat(res, [hi - lo for lo, hi in ranges], a, b, K_AR).view(x.shape)
        p = self._seq & 1
        views = views[p]
        self._memmove(self._addr[p], x.data_ptr(), nbytes)
        self._arrive(p, a, b, K_AR)
        if opc == 1:
            out = torch.add(views[0], views[1])
            for v in views[2:]:
                out.add_(v)
        else:
            out = torch.maximum(views[0], views[1])
            for v in views[2:]:
                torch.maximum(out, v, out=out)
        return out

    def _plan_all_reduce(self, key, x: torch.Tensor, op: str):
        """``(nbytes, meta a, meta b, op code, per-parity slot views or None)`` for this call signature."""
        n, opc = x.numel(), OPS.get(op, OP_INVALID)
        nbytes = n * x.element_size()
        views = None
        if nbytes <= self.oneshot_bytes and opc != OP_INVALID:
            views = [[s.view(x.dtype)[:n].view(x.shape) for s in self._slots[p]] for p in (0, 1)]
        plan = (nbytes, _meta(K_AR, opc, x.dtype, n), hash(x.shape), opc, views)
        return self._remember(key, plan)

    def _remember(self, key, plan):
        if len(self._plans) >= _MAX_CACHED_PLANS:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def all_gather(self, x: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` in rank order.

        Shapes: rank r's ``x`` is ``[..., sizes[r], ...]`` (other dims equal) -> ``[..., sum(sizes), ...]``.
        """
        return self._run(K_AG, self._all_gather, x, dim, sizes)

    def _all_gather(self, x: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        if not x.is_contiguous():
            x = x.contiguous()
        dim %= x.dim()
        key = (K_AG, x.dtype, x.shape, tuple(sizes), dim)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan_all_gather(key, x, dim, list(sizes))
        nbytes, a, b, counts, views = plan
        if views is not None:                          # every shard fits a slot: one step
            p = self._seq & 1
            self._memmove(self._addr[p], x.data_ptr(), nbytes)
            self._arrive(p, a, b, K_AG)
            return torch.cat(views[p], dim)
        shape = x.shape
        flat = self._ag_flat(x.view(-1), counts, a, b, K_AG)
        if math.prod(shape[:dim]) == 1:
            return flat.view(shape[:dim] + (sum(sizes),) + shape[dim + 1:])
        offs = [sum(counts[:r]) for r in range(self.size)]
        return torch.cat([flat[o: o + c].view(shape[:dim] + (s,) + shape[dim + 1:])
                          for o, c, s in zip(offs, counts, sizes)], dim)

    def _plan_all_gather(self, key, x: torch.Tensor, dim: int, sizes: list[int]):
        """``(own nbytes, meta a, meta b, elements per rank, per-parity slot views or None)``."""
        shape = x.shape
        unit = math.prod(shape[:dim] + shape[dim + 1:])
        counts = [s * unit for s in sizes]
        a = _meta(K_AG, 0, x.dtype, sum(counts))
        b = hash((tuple(sizes), dim, tuple(shape[:dim]), tuple(shape[dim + 1:])))
        views = None
        if max(counts) * x.element_size() <= self.slot_bytes:
            shapes = [shape[:dim] + (s,) + shape[dim + 1:] for s in sizes]
            views = [[self._slots[p][r].view(x.dtype)[: counts[r]].view(shapes[r]) for r in range(self.size)]
                     for p in (0, 1)]
        return self._remember(key, (counts[self.rank] * x.element_size(), a, b, counts, views))

    def reduce_scatter(self, x: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        """Sum ``x`` over the ranks (rank order) and keep this rank's shard along ``dim``.

        Shapes: ``[..., sum(sizes), ...]`` on every rank -> ``[..., sizes[rank], ...]``.
        """
        return self._run(K_RS, self._reduce_scatter, x, dim, list(sizes))

    def _reduce_scatter(self, x: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        dim %= x.dim()
        xm = x.movedim(dim, 0).contiguous()
        unit = math.prod(xm.shape[1:])
        ranges, lo = [], 0
        for s in sizes:
            ranges.append((lo, lo + s * unit))
            lo += s * unit
        a = _meta(K_RS, 1, x.dtype, x.numel())
        b = hash((tuple(sizes), dim, tuple(x.shape)))
        mine = self._rs_flat(xm.view(-1), ranges, 1, a, b, K_RS)
        return mine.view((sizes[self.rank],) + xm.shape[1:]).movedim(0, dim).contiguous()

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Every rank gets rank ``src``'s ``x`` (same shape and dtype on every rank), as a new tensor."""
        return self._run(K_BC, self._broadcast, x, src)

    def _broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        if not 0 <= src < self.size:
            raise ValueError(f"broadcast on {self.group_name} group: src must be in [0, {self.size}), got {src}")
        if not x.is_contiguous():
            x = x.contiguous()
        key = (K_BC, x.dtype, x.shape, src)
        plan = self._plans.get(key)
        if plan is None:
            n = x.numel()
            views = None
            if n * x.element_size() <= self.slot_bytes:
                views = [self._slots[p][src].view(x.dtype)[:n].view(x.shape) for p in (0, 1)]
            plan = self._remember(key, (n * x.element_size(), _meta(K_BC, 0, x.dtype, n), hash((x.shape, src)), views))
        nbytes, a, b, views = plan
        if views is not None:                          # fits a slot: one step
            p = self._seq & 1
            if self.rank == src:
                self._memmove(self._addr[p], x.data_ptr(), nbytes)
            self._arrive(p, a, b, K_BC)
            return views[p].clone()
        counts = [0] * self.size
        counts[src] = x.numel()
        return self._ag_flat(x.view(-1), counts, a, b, K_BC).view(x.shape)

    def reduce(self, x: torch.Tensor, dst: int = 0, op: str = "sum") -> torch.Tensor | None:
        """``op`` of ``x`` over the ranks, in rank order, delivered to rank ``dst`` only (others get None)."""
        return self._run(K_RD, self._reduce, x, dst, op)

    def _reduce(self, x: torch.Tensor, dst: int, op: str) -> torch.Tensor | None:
        if not 0 <= dst < self.size:
            raise ValueError(f"reduce on {self.group_name} group: dst must be in [0, {self.size}), got {dst}")
        x = x.contiguous()
        n = x.numel()
        opc = OPS.get(op, OP_INVALID)
        ranges = [(0, n) if r == dst else (0, 0) for r in range(self.size)]
        res = self._rs_flat(x.view(-1), ranges, opc, _meta(K_RD, opc, x.dtype, n), hash((tuple(x.shape), dst)), K_RD)
        return res.view(x.shape) if self.rank == dst else None

    # ------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Tell the peers this rank is gone (their next wait on it fails at once) and unmap. Idempotent."""
        if self.segment is None:
            return
        if self._broken is None:
            self._ctl[self._me + W_STATE] = STATE_CLOSED
        self._plans.clear()
        self._slots = None
        self._ctl = None
        seg, self.segment = self.segment, None
        seg.close()
        self._broken = self._broken or "it was closed"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return (f"ShmCommunicator({self.group_name}, rank={self.rank}, size={self.size}, "
                f"slot_bytes={self.slot_bytes}, segment={self.segment.name if self.segment else None})")
