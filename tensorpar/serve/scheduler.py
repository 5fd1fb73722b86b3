"""Rank 0's iteration-level scheduler: admits requests while KV blocks are free, plans each step, streams tokens
back.

Requests arrive from the HTTP thread (:meth:`Scheduler.submit`, thread-safe) and wait in FIFO order until they
can run: fewer than ``engine.max_batch`` requests running and enough free blocks of the engine's KV pool for
their prompt (:class:`~tensorpar.serve.blocks.BlockAllocator`, on rank 0 only; a request that does not fit waits;
only more than ``max_waiting`` waiting requests are refused). Each iteration the scheduler ends cancelled and
timed-out requests (their blocks freed), gives every running request the block its next token needs (when none
is free, the newest running request is preempted: its blocks are freed and it waits at the head of the queue,
to be recomputed from its prompt and the tokens it already produced), admits waiting ones (with prefix caching,
reusing the cached blocks of their longest cached prompt prefix and computing only the rest), broadcasts the plan
(every row's tokens, start position and block table: the other ranks only execute it) and runs it
(:class:`~tensorpar.serve.engine.Engine`), then hands each request its token. When idle it broadcasts a
heartbeat every ``heartbeat_s`` so the other ranks' collectives never reach their timeout.

With pipeline stages (``--pp P``, the engine's ``pp`` group of ``P`` ranks) the requests run in ``P`` batches
(vLLM's virtual engines), each with its own plan in flight: at tick ``t`` the scheduler plans batch ``t mod P``
(whose previous plan has just come back from the last stage), and the engine's :meth:`~Engine.tick` runs stage
``s`` on the plan of tick ``t - s``, so every stage computes every tick. A request joins a batch when admitted
(the batch being planned, while it holds fewer than ``ceil((running + waiting) / P)`` requests and at most
``max_batch``); cancellation, timeouts, block growth and preemption touch only the batch being planned, whose
requests are not in flight. The KV block pool is shared.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tensorpar.serve.blocks import BlockAllocator, block_hashes
from tensorpar.serve.engine import Engine
from tensorpar.serve.plan import Row, StepPlan


class QueueFull(Exception):
    """More than ``max_waiting`` requests are waiting for a slot."""


@dataclass(eq=False)                    # requests compare by identity (the scheduler's lists hold them)
class Request:
    """One generation request as the scheduler sees it.

    ``emit(event)`` is called from the scheduler thread with ``("token", token, logprob, top, is_eos)``,
    ``("done", finish_reason)`` or ``("error", message[, http_status])``; it must be thread-safe and
    non-blocking.
    ``finish(tokens) -> str | None`` is asked after each token whether the request ends there
    (``"stop"``, ``"length"``) besides EOS and ``max_tokens``; it runs on the scheduler thread.
    """

    prompt: list[int]
    max_tokens: int
    emit: Callable[[tuple], None]
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: int = -1
    finish: Callable[[list[int]], str | None] | None = None
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    # scheduler state
    out: list[int] = field(default_factory=list)
    last_t: float = 0.0
    gen: Any = None
    blocks: list[int] = field(default_factory=list)     # block table (held references)
    computed: int = 0               # tokens of prompt + out whose K/V are in the blocks
    hashes: list = field(default_factory=list)          # prompt-prefix hash of each full prompt block
    registered: int = 0             # of them named in the prefix cache
    admitted: bool = False
    batch: int = 0                  # the batch (of the pipeline's P) it runs in

    def cancel(self) -> None:
        """Ask the scheduler to drop this request at its next step (its blocks are freed)."""
        self.cancelled = True


class Scheduler:
    """Continuous batching over the engine's KV block pool; runs on tp rank 0's main thread (:meth:`run`).

    Args:
        engine: rank 0's engine (``max_batch`` rows per step, ``num_blocks`` blocks of ``block_size``).
        eos: token ids that end a request.
        metrics: a :class:`~tensorpar.serve.metrics.ServeMetrics` (or ``None``).
        max_waiting: most requests waiting to run; beyond it :meth:`submit` raises :class:`QueueFull`.
        heartbeat_s: idle interval between heartbeat plans.
        prefix_caching: reuse cached full prompt blocks (:class:`~tensorpar.serve.blocks.BlockAllocator`).
        timeout_s: a request still running this long after it arrived ends with an error (``None``: never).
    """

    def __init__(self, engine: Engine, *, eos: set[int], metrics=None, max_waiting: int = 256,
                 heartbeat_s: float = 1.0, prefix_caching: bool = False, timeout_s: float | None = None):
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"--request-timeout must be > 0 seconds, got {timeout_s}")
        self.engine, self.eos, self.metrics = engine, set(eos), metrics
        self.max_waiting, self.heartbeat_s, self.timeout_s = max_waiting, heartbeat_s, timeout_s
        self.block_size = getattr(engine, "block_size", engine.max_len)
        self.blocks = BlockAllocator(getattr(engine, "num_blocks", engine.max_batch), self.block_size,
                                     caching=prefix_caching)
        self.incoming: queue.Queue[Request] = queue.Queue()
        self.waiting: list[Request] = []
        self.running: list[Request] = []        # in admission order: the last is preempted first
        self.preemptions = 0
        self.stop_event = threading.Event()
        self.failed: str | None = None
        self._lock = threading.Lock()
        self._pending = 0               # submitted and not yet admitted
        self._closed = False            # set (under the lock) when run() ends: submit refuses from then on
        pp = getattr(engine, "pp", None)
        self.depth = pp.size if pp is not None else 1      # batches in flight: one per pipeline stage
        self._flight: deque = deque()   # (plan, requests) of the ticks in flight, oldest first
        self._ticks = 0

    # ------------------------------------------------------------------ HTTP thread side
    def submit(self, req: Request) -> None:
        """Queue ``req`` (thread-safe). Raises :class:`QueueFull`, ValueError (the request needs more KV blocks
        than the pool has: it could never run) or RuntimeError (engine stopped/failed).

        Every queued request gets an end event: a token stream ending in ``"done"``, or ``"error"`` when the
        scheduler stops or fails (queueing and :meth:`run`'s final drain hold the same lock, so no request is
        queued after that drain)."""
        need = -(-(len(req.prompt) + req.max_tokens - 1) // self.block_size)   # the last token is never fed
        if need > self.blocks.num_blocks:
            raise ValueError(f"the request needs {len(req.prompt)} + {req.max_tokens} tokens: {need} KV blocks of "
                             f"{self.block_size}; the pool has {self.blocks.num_blocks} (--kv-cache-memory): "
                             f"shorten the prompt or max_tokens")
        with self._lock:
            if self._closed or self.failed or self.stop_event.is_set():
                raise RuntimeError(self.failed or "the server is shutting down")
            if self._pending >= self.max_waiting:
                raise QueueFull(f"the waiting queue is full: {self._pending} request(s) wait for a slot "
                                f"(--max-waiting {self.max_waiting}); retry later")
            self._pending += 1
            self.incoming.put(req)

    @property
    def healthy(self) -> bool:
        """False once the model ranks failed or the server is stopping (``/health`` then answers 503)."""
        return not (self.failed or self._closed or self.stop_event.is_set())

    def stop(self) -> None:
        self.stop_event.set()

    # ------------------------------------------------------------------ scheduler thread
    def _drain(self, block: bool) -> None:
        try:
            item = self.incoming.get(timeout=self.heartbeat_s) if block else self.incoming.get_nowait()
            self.waiting.append(item)
            while True:
                self.waiting.append(self.incoming.get_nowait())
        except queue.Empty:
            pass

    def _sampler(self, req: Request):
        from tensorpar.serve.tokens import SamplingConfig, sampler
        return sampler(SamplingConfig(1, req.temperature, req.top_k, req.top_p, 0), req.gen)

    def _release(self, req: Request) -> None:
        self.blocks.release(req.blocks)
        req.blocks, req.computed = [], 0

    def _finish(self, req: Request, reason: str, error: tuple | None = None) -> None:
        """End running ``req``: its blocks freed, ``("done", reason)`` (or the ``error`` event) emitted."""
        self.running.remove(req)
        self._release(req)
        req.emit(error or ("done", reason))
        if self.metrics:
            self.metrics.finished(req, reason)

    def _timed_out(self, req: Request, now: float) -> bool:
        return self.timeout_s is not None and now - req.arrived > self.timeout_s

    def _timeout_event(self) -> tuple:
        return ("error", f"the request ran longer than --request-timeout {self.timeout_s:g} s", 504)

    def _preempt(self, req: Request) -> None:
        """Free running ``req``'s blocks and put it at the head of the queue: it is recomputed (its prompt and
        the tokens it produced) when blocks are free again."""
        self.running.remove(req)
        self._release(req)
        self.waiting.insert(0, req)
        self.preemptions += 1
        if self.metrics:
            self.metrics.preempted()

    def _admit(self, req: Request, computing: set) -> bool:
        """Give waiting ``req`` the blocks of its known tokens (prompt and any produced before a preemption):
        the cached ones of its longest cached prompt prefix (not the block of its last token, which must be
        computed), then new ones. False (nothing taken) when too few are free, or when the next block of its
        prefix is being computed by a running request (``computing``: those hashes): it then waits a step and
        reuses it instead of computing it again (a burst of requests sharing a system prompt computes it once)."""
        bs, known = self.block_size, len(req.prompt) + len(req.out)
        if not req.hashes and self.blocks.caching:
            req.hashes = block_hashes(req.prompt, bs)
        cap = req.hashes[:(known - 1) // bs]
        hit = self.blocks.match(cap)
        if len(hit) < len(cap) and cap[len(hit)] in computing:
            self.blocks.release(hit)
            return False
        new = self.blocks.allocate(-(-known // bs) - len(hit))
        if new is None:
            self.blocks.release(hit)
            return False
        req.blocks, req.computed, req.registered = hit + new, len(hit) * bs, len(hit)
        if not req.admitted and self.blocks.caching:
            self.blocks.queries += len(req.prompt)
            self.blocks.hits += len(hit) * bs
        return True

    def _plan(self, batch: int = 0) -> tuple[StepPlan, list[Request]]:
        """The next plan of ``batch`` (one of :attr:`depth`) and its requests in row order; only that batch's
        requests (none in flight) are ended, grown, preempted or admitted."""
        now = time.perf_counter()
        for req in [r for r in self.running if r.batch == batch]:
            if req.cancelled:
                self._finish(req, "abort")
            elif self._timed_out(req, now):
                self._finish(req, "timeout", self._timeout_event())
        keep = []
        for r in self.waiting:
            if r.cancelled or self._timed_out(r, now):
                if not r.admitted:
                    self._dequeue(r)
                if not r.cancelled:
                    r.emit(self._timeout_event())
                if self.metrics:
                    self.metrics.finished(r, "abort" if r.cancelled else "timeout")
            else:
                keep.append(r)
        self.waiting = keep
        bs = self.block_size
        for req in [r for r in self.running if r.batch == batch]:    # oldest first: the block its next token needs
            while req in self.running:
                need = -(-(len(req.prompt) + len(req.out)) // bs) - len(req.blocks)
                got = self.blocks.allocate(need) if need > 0 else []
                if got is not None:
                    req.blocks += got
                    break
                self._preempt([r for r in self.running if r.batch == batch][-1])   # the batch's newest gives back
        computing = {h for r in self.running for h in r.hashes[r.registered:]} if self.blocks.caching else set()
        share = -(-(len(self.running) + len(self.waiting)) // self.depth)     # the batches about equal
        n = sum(r.batch == batch for r in self.running)
        while self.waiting and n < min(self.engine.max_batch, share):
            req = self.waiting[0]
            if not self._admit(req, computing):
                break                               # FIFO: it waits, and so do the ones behind it
            computing.update(req.hashes[req.registered:])
            self.waiting.pop(0)
            if not req.admitted:
                self._dequeue(req)
                req.admitted = True
                seed = req.seed if req.seed is not None else int.from_bytes(os.urandom(7), "little")
                try:
                    req.gen = torch.Generator().manual_seed(seed)
                except (RuntimeError, ValueError, OverflowError) as e:   # one request's problem, not the server's
                    self._release(req)
                    req.emit(("error", f"cannot seed this request's generator: {e}", 400))
                    continue
            req.batch = batch
            self.running.append(req)
            n += 1
        order = [r for r in self.running if r.batch == batch]
        rows = []
        for req in order:            # the tokens not in its blocks: the last one (decode), or after a prefix hit
            n = len(req.prompt) + len(req.out)   # or a preemption the rest of its prompt and produced tokens
            toks = [req.out[-1]] if req.out and req.computed == n - 1 else (req.prompt + req.out)[req.computed:]
            rows.append(Row(req.blocks[0], toks, req.computed, req.temperature > 0, req.logprobs, list(req.blocks)))
        return StepPlan("step", rows), order

    def _dequeue(self, req: Request) -> bool:
        with self._lock:
            self._pending -= 1
        return True

    def run(self) -> None:
        """Serve until :meth:`stop`; then end every request and broadcast ``"stop"`` to the other ranks.

        A failing step (a rank died, a collective timed out) ends every request with an error, sets
        :attr:`failed` and re-raises, so the process exits non-zero.
        """
        try:
            while not self.stop_event.is_set():
                self._drain(block=not self.running and not self.waiting)
                plan, order = self._plan(self._ticks % self.depth)
                if self.metrics:
                    self.metrics.queue(len(self.running), len(self.waiting), len(plan.rows))
                    self.metrics.blocks(self.blocks)
                if not plan.rows and not any(p.rows for p, _ in self._flight):
                    self.engine.exchange(StepPlan("noop"))
                    continue
                self._tick(plan, order, deliver=True)
                if self.metrics:
                    self.metrics.queue(len(self.running), len(self.waiting), 0)
                    self.metrics.blocks(self.blocks)
        except BaseException as e:
            from tensorpar.launch import one_line
            self.failed = f"the model ranks failed: {one_line(e)}"
            self._end_all(self.failed)
            raise
        self._end_all("the server is shutting down")
        while any(p.rows for p, _ in self._flight):     # the plans still in the pipeline, their tokens dropped
            self._tick(StepPlan("step"), [], deliver=False)
        self.engine.exchange(StepPlan("stop"))

    def _tick(self, plan: StepPlan, order: list[Request], *, deliver: bool) -> None:
        """Send ``plan`` to every rank and run it: the engine's step at pp 1, one tick of the pipeline
        (:meth:`~tensorpar.serve.engine.Engine.tick`) at pp > 1; hand each request of the plan that completes
        (this one at pp 1, the one of ``depth - 1`` ticks ago otherwise) its token."""
        self.engine.exchange(plan)
        samplers = [self._sampler(r) if r.temperature > 0 else None for r in order]
        res = (self.engine.step(plan, samplers) if self.depth == 1 else self.engine.tick(plan, samplers))
        self._ticks += 1
        self._flight.append((plan, order))
        if len(self._flight) < self.depth:
            return
        _, done = self._flight.popleft()
        now = time.perf_counter()
        for i, req in enumerate(done if deliver else []):
            self._deliver(req, res.tokens[i], res.logprobs[i], res.top[i], now)

    def _end_all(self, message: str) -> None:
        """Refuse new requests and end every running, waiting and queued request with ``("error", message)``."""
        with self._lock:
            self._closed = True
            self._drain(block=False)
        for req in self.running + self.waiting:
            req.emit(("error", message))
            self._release(req)
        self.running.clear()
        self.waiting.clear()

    def _deliver(self, req: Request, tok: int, lp, top, now: float) -> None:
        req.computed = len(req.prompt) + len(req.out)       # the step fed every known token
        bs = self.block_size
        while req.registered < len(req.hashes) and (req.registered + 1) * bs <= req.computed:
            self.blocks.register(req.blocks[req.registered], req.hashes[req.registered])   # a full prompt block
            req.registered += 1
        if self.metrics:
            self.metrics.token(req, now)
        req.last_t = now
        if tok in self.eos:
            req.out.append(tok)
            req.emit(("token", tok, lp, top, True))
            self._finish(req, "stop")
            return
        req.out.append(tok)
        req.emit(("token", tok, lp, top, False))
        reason = req.finish(req.out) if req.finish else None
        if reason is None and len(req.out) >= req.max_tokens:
            reason = "length"
        if reason is None and len(req.prompt) + len(req.out) >= self.engine.max_len:
            reason = "length"
        if reason is not None:
            self._finish(req, reason)
