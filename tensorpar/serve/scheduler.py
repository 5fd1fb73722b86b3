"""Rank 0's iteration-level scheduler: admits requests into free slots, plans each step, streams tokens back.

Requests arrive from the HTTP thread (:meth:`Scheduler.submit`, thread-safe) and wait in FIFO order until a
slot is free (a request that does not fit waits; only more than ``max_waiting`` waiting requests are refused).
Each iteration the scheduler frees the slots of finished or cancelled requests, admits waiting ones (their
prefill runs in this step), adds one decode row per running request, broadcasts the plan and runs it
(:class:`~tensorpar.serve.engine.Engine`), then hands each request its token. When idle it broadcasts a
heartbeat every ``heartbeat_s`` so the other ranks' collectives never reach their timeout.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tensorpar.serve.engine import Engine
from tensorpar.serve.plan import Row, StepPlan


class QueueFull(Exception):
    """More than ``max_waiting`` requests are waiting for a slot."""


@dataclass
class Request:
    """One generation request as the scheduler sees it.

    ``emit(event)`` is called from the scheduler thread with ``("token", token, logprob, top)``,
    ``("done", finish_reason)`` or ``("error", message)``; it must be thread-safe and non-blocking.
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
    slot: int = -1
    out: list[int] = field(default_factory=list)
    last_t: float = 0.0
    gen: Any = None

    def cancel(self) -> None:
        """Ask the scheduler to drop this request at its next step (its slot is freed)."""
        self.cancelled = True


class Scheduler:
    """Continuous batching over ``engine.max_batch`` slots; runs on tp rank 0's main thread (:meth:`run`).

    Args:
        engine: rank 0's engine.
        eos: token ids that end a request.
        metrics: a :class:`~tensorpar.serve.metrics.ServeMetrics` (or ``None``).
        max_waiting: most requests waiting for a slot; beyond it :meth:`submit` raises :class:`QueueFull`.
        heartbeat_s: idle interval between heartbeat plans.
    """

    def __init__(self, engine: Engine, *, eos: set[int], metrics=None, max_waiting: int = 256,
                 heartbeat_s: float = 1.0):
        self.engine, self.eos, self.metrics = engine, set(eos), metrics
        self.max_waiting, self.heartbeat_s = max_waiting, heartbeat_s
        self.incoming: queue.Queue[Request] = queue.Queue()
        self.waiting: list[Request] = []
        self.running: dict[int, Request] = {}
        self.stop_event = threading.Event()
        self.failed: str | None = None
        self._lock = threading.Lock()
        self._pending = 0               # submitted and not yet in a slot
        self._closed = False            # set (under the lock) when run() ends: submit refuses from then on

    # ------------------------------------------------------------------ HTTP thread side
    def submit(self, req: Request) -> None:
        """Queue ``req`` (thread-safe). Raises :class:`QueueFull` or RuntimeError (engine stopped/failed).

        Every queued request gets an end event: a token stream ending in ``"done"``, or ``"error"`` when the
        scheduler stops or fails (queueing and :meth:`run`'s final drain hold the same lock, so no request is
        queued after that drain)."""
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

    def _finish(self, req: Request, reason: str) -> None:
        self.running.pop(req.slot, None)
        req.emit(("done", reason))
        if self.metrics:
            self.metrics.finished(req, reason)

    def _plan(self) -> tuple[StepPlan, list[Request]]:
        for slot, req in list(self.running.items()):
            if req.cancelled:
                self._finish(req, "abort")
        self.waiting = [r for r in self.waiting if not (r.cancelled and self._dequeue(r))]
        free = [s for s in range(self.engine.max_batch) if s not in self.running]
        new: list[Request] = []
        while self.waiting and free:
            req = self.waiting.pop(0)
            self._dequeue(req)
            req.slot = free.pop(0)
            seed = req.seed if req.seed is not None else int.from_bytes(os.urandom(7), "little")
            try:
                req.gen = torch.Generator().manual_seed(seed)
            except (RuntimeError, ValueError, OverflowError) as e:   # one request's problem, not the server's
                free.insert(0, req.slot)
                req.emit(("error", f"cannot seed this request's generator: {e}"))
                continue
            self.running[req.slot] = req
            new.append(req)
        rows, order = [], []
        for req in new:
            rows.append(Row(req.slot, list(req.prompt), 0, req.temperature > 0, req.logprobs))
            order.append(req)
        for req in self.running.values():
            if req.out:
                rows.append(Row(req.slot, [req.out[-1]], len(req.prompt) + len(req.out) - 1,
                                req.temperature > 0, req.logprobs))
                order.append(req)
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
                plan, order = self._plan()
                if self.metrics:
                    self.metrics.queue(len(self.running), len(self.waiting), len(plan.rows))
                if not plan.rows:
                    self.engine.exchange(StepPlan("noop"))
                    continue
                self.engine.exchange(plan)
                samplers = [self._sampler(r) if r.temperature > 0 else None for r in order]
                res = self.engine.step(plan, samplers)
                now = time.perf_counter()
                for i, req in enumerate(order):
                    self._deliver(req, res.tokens[i], res.logprobs[i], res.top[i], now)
                if self.metrics:
                    self.metrics.queue(len(self.running), len(self.waiting), 0)
        except BaseException as e:
            from tensorpar.launch import one_line
            self.failed = f"the model ranks failed: {one_line(e)}"
            self._end_all(self.failed)
            raise
        self._end_all("the server is shutting down")
        self.engine.exchange(StepPlan("stop"))

    def _end_all(self, message: str) -> None:
        """Refuse new requests and end every running, waiting and queued request with ``("error", message)``."""
        with self._lock:
            self._closed = True
            self._drain(block=False)
        for req in list(self.running.values()) + self.waiting:
            req.emit(("error", message))
        self.running.clear()
        self.waiting.clear()

    def _deliver(self, req: Request, tok: int, lp, top, now: float) -> None:
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
