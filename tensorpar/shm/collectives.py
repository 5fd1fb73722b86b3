"""Collectives over one shared segment: all-reduce, all-gather, reduce-scatter, broadcast, reduce.

This module holds :class:`ShmCommunicator` and its collectives; the step protocol they run on (steps and
barriers, memory ordering, determinism) is :mod:`tensorpar.shm.protocol`.

Algorithms: an all-reduce of at most ``oneshot_bytes`` is one step in which every rank sums all
slots ("one-shot"); a larger one is a reduce-scatter (each rank sums its ``1/n`` of each chunk)
followed by an all-gather ("two-shot"), which reads ``2 B`` per rank instead of ``n B``. Messages
larger than a slot go through in slot-sized chunks, one step each.
"""
from __future__ import annotations

import math

import torch

from tensorpar.shm.protocol import K_AG, K_AR, K_BC, K_RD, K_RS, OP_INVALID, OPS, StepProtocol, _meta
from tensorpar.shm.segment import W_ARRIVED, W_META


class ShmCommunicator(StepProtocol):
    """Collectives among ``size`` processes of one host that have mapped the same
    :class:`~tensorpar.shm.segment.Segment`.

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
        peers: :class:`~tensorpar.shm.sync.Peer` (pid, start time) of every rank, in rank order.
        group_name: axis name used in messages.
        timeout_s: how long to wait for a peer at any one step.
        policy: the spin / yield / sleep schedule.
        oneshot_bytes: all-reduces up to this size use the one-shot algorithm.
    """

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

    def all_reduce_parts(self, x: torch.Tensor) -> tuple[int, ...]:
        """The exchange of a one-shot sum :meth:`all_reduce` of ``x`` without the sum, for a caller that adds the
        ranks' copies itself (fused with what follows, e.g. :func:`tensorpar.decode.fused.all_reduce_add_rms_norm`:
        the residual add and the next norm in one pass): ``x`` (contiguous, at most ``oneshot_bytes``) is copied into
        this rank's slot and one step runs with the metadata of ``all_reduce(x)``; returns the addresses of every
        rank's copy, in rank order. The caller must add them in rank order (``((x0 + x1) + x2) ...``, what
        :meth:`all_reduce` computes) and finish reading them before its next collective on this communicator: a slot
        is written again only after every rank has passed the next step's barrier.

        A tensor larger than ``oneshot_bytes`` (a decode step of many rows of a wide model: 64 rows of 2048 fp32) is
        summed by :meth:`all_reduce`'s two-shot algorithm into a buffer this communicator keeps; its address is
        returned alone (as :meth:`tensorpar.comm.tcp.TcpMesh.all_reduce_parts` does), the same bits as
        :meth:`all_reduce`.

        Shapes: ``x`` any shape, the same on every rank (``[rows, h]`` in decode). Raises ValueError (on every rank)
        if ``x`` is not contiguous; a peer's failure as :meth:`all_reduce` does.
        """
        if self._broken is not None:
            self._check_usable(K_AR)
        self._calls += 1
        try:
            key = (K_AR, x.dtype, x.shape, "sum")
            plan = self._plans.get(key)
            if plan is None:
                plan = self._plan_all_reduce(key, x, "sum")
            if not x.is_contiguous():
                raise ValueError(f"all_reduce_parts takes a contiguous tensor, got {tuple(x.shape)} {x.dtype}")
            if plan[4] is None:                   # too large for one shot: the two-shot sum into a kept buffer
                y = self._all_reduce(x, "sum").view(-1)
                big = self._big
                if big is None or big.numel() < y.numel() or big.dtype != y.dtype:
                    big = self._big = torch.empty_like(y)
                big[:y.numel()].copy_(y)
                return (big.data_ptr(),)
            p = self._seq & 1
            self._memmove(self._addr[p], x.data_ptr(), plan[0])
            self._arrive(p, plan[1], plan[2], K_AR)
            return self._slot_addrs[p]
        except ValueError:
            raise
        except BaseException as e:
            self._break(e, K_AR)
            raise

    def c_exchange_words(self, x: torch.Tensor) -> dict | None:
        """What a C caller needs to run the step of :meth:`all_reduce_parts` of ``x`` itself, exchange after exchange
        (csrc/step.cpp's ``OP_EXCHANGE``, :class:`tensorpar.decode.step_exchange.StepExchange`): the control words'
        address ``ctl``, this rank's line ``me``, the metadata's offset in a line ``w_meta``, the wait policy's spin
        and yield phases ``spin_ns``, ``yield_ns`` (the yield phase at most ``check_ms``; the sleep phase, with its
        liveness and deadline checks, is Python's),
        the copy's ``nbytes``, the metadata words ``a``, ``b``, this rank's slot of each parity ``slots``, every
        rank's slots of each parity ``parts`` (rank order) and the peers' lines ``peers``; ``None`` where ``x`` is
        too large for one shot or not contiguous (the caller runs :meth:`all_reduce_parts`). The caller's steps must
        be followed by :meth:`c_exchange_done`, and a step whose peers were late past the spin or disagreed by
        :meth:`c_exchange_wait`. Raises :class:`~tensorpar.comm.CollectiveError` if this communicator is unusable."""
        self._check_usable(K_AR)
        key = (K_AR, x.dtype, x.shape, "sum")
        plan = self._plans.get(key) or self._plan_all_reduce(key, x, "sum")
        if plan[4] is None or not x.is_contiguous():
            return None
        # the yield phase in C at most one check interval: the abort word, the peers' liveness and the deadline are
        # checked in Python's wait (sync.wait_slow), every check_ms
        yield_us = min(self.policy.yield_us, self.policy.check_ms * 1e3)
        return dict(ctl=self.segment.base, me=self._me, w_meta=W_META, spin_ns=self._spin_ns,
                    yield_ns=int(yield_us * 1e3), nbytes=plan[0],
                    a=plan[1], b=plan[2], slots=tuple(self._addr), parts=tuple(self._slot_addrs),
                    peers=tuple(line for _, line in self._others))

    def c_exchange_wait(self, seq: int) -> tuple[int, ...]:
        """Finish a step a C caller began (copy, metadata, arrival count ``seq`` stored) and left because a peer was
        late past its spin or described another collective: wait and compare as :meth:`all_reduce_parts` does;
        returns every rank's slot address, rank order. Raises as :meth:`all_reduce_parts` (a ValueError on a
        mismatch; else the communicator breaks)."""
        self._calls += 1
        self._seq = seq
        p = (seq - 1) & 1
        try:
            ctl = self._ctl
            self._await(seq, p, ctl[self._me + W_META + 2 * p], ctl[self._me + W_META + 2 * p + 1], K_AR)
            return self._slot_addrs[p]
        except ValueError:
            raise
        except BaseException as e:
            self._break(e, K_AR)
            raise

    def check_usable(self) -> None:
        """Raise :class:`~tensorpar.comm.CollectiveError` if an earlier collective broke this communicator (what
        every collective checks first; a C caller checks before its steps)."""
        self._check_usable(K_AR)

    def c_exchange_done(self, steps: int) -> None:
        """Count ``steps`` exchanges a C caller ran to the end itself, and take its arrival count as this rank's."""
        self._calls += steps
        self._seq = self._ctl[self._me + W_ARRIVED]

    def _plan_all_reduce(self, key, x: torch.Tensor, op: str):
        """``(nbytes, meta a, meta b, op code, per-parity slot views or None)`` for this call signature."""
        n, opc = x.numel(), OPS.get(op, OP_INVALID)
        nbytes = n * x.element_size()
        views = None
        if nbytes <= self.oneshot_bytes and opc != OP_INVALID:
            views = [[s.view(x.dtype)[:n].view(x.shape) for s in self._slots[p]] for p in (0, 1)]
        plan = (nbytes, _meta(K_AR, opc, x.dtype, n), hash(x.shape), opc, views)
        return self._remember(key, plan)

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

    def __repr__(self) -> str:
        return (f"ShmCommunicator({self.group_name}, rank={self.rank}, size={self.size}, "
                f"slot_bytes={self.slot_bytes}, segment={self.segment.name if self.segment else None})")
