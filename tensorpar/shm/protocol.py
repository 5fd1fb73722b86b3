"""The step protocol under :class:`~tensorpar.shm.collectives.ShmCommunicator`: the constants and the packing
of a step's metadata word, and :class:`StepProtocol`, which holds a communicator's state in the shared segment,
its arrival and barrier, the checks that the ranks agree, the breaking of a communicator on failure, the chunked
reduce-scatter and all-gather that the collectives are built from, and closing.

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
"""
from __future__ import annotations

import ctypes
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


class StepProtocol:
    """The state and steps that :class:`~tensorpar.shm.collectives.ShmCommunicator` (its constructor's arguments are
    documented there) runs its collectives with: one barrier per step over two alternating buffers, metadata checks,
    breaking on failure, the chunked building blocks and closing. Not used on its own."""

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
        self._slot_addrs = [tuple(segment.base + lay.slot(r, p) for r in range(size)) for p in (0, 1)]
        self._slots = [[segment.data[lay.slot(r, p): lay.slot(r, p) + lay.slot_bytes] for r in range(size)]
                       for p in (0, 1)]
        self._spin_ns = int(self.policy.spin_us * 1e3)
        self._seq = self._ctl[self._me + W_ARRIVED]
        self._calls = 0
        self._plans: dict = {}                    # call signature -> metadata words and slot views
        self._big: torch.Tensor | None = None      # all_reduce_parts' sum of a tensor too large for one shot
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
        self._await(seq, p, a, b, kind)

    def _await(self, seq: int, p: int, a: int, b: int, kind: int) -> None:
        """Wait until every peer's arrival count reaches ``seq``, then compare their metadata of parity ``p`` with
        ours, ``(a, b)`` (the second half of :meth:`_arrive`; also after a step a C caller began,
        :meth:`~tensorpar.shm.collectives.ShmCommunicator.c_exchange_wait`)."""
        ctl = self._ctl
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

    def _remember(self, key, plan):
        if len(self._plans) >= _MAX_CACHED_PLANS:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def close(self) -> None:
        """Tell the peers this rank is gone (their next wait on it fails at once) and unmap. Idempotent."""
        if self.segment is None:
            return
        if self._broken is None:
            self._ctl[self._me + W_STATE] = STATE_CLOSED
        self._plans.clear()
        self._big = None
        self._slots = None
        self._ctl = None
        seg, self.segment = self.segment, None
        seg.close()
        self._broken = self._broken or "it was closed"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
