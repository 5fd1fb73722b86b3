"""Parity harness: run a function on N gloo ranks and compare against the single-device result.

:class:`WorkerPool` starts ``world_size`` processes once (spawn, loopback TCP on a free port,
one torch thread each) and runs many jobs on them, because starting ranks costs seconds.
A job is a picklable top-level function ``fn(ctx, *args)`` run on every rank with that rank's
:class:`~tensorpar.parallel.ParallelContext`; ``run`` returns the list of per-rank return
values. If any rank raises, ``run`` raises :class:`RankFailure` carrying every failing rank's
traceback; if a rank does not answer within ``job_timeout_s``, the pool is killed and
``run`` raises. A broken pool restarts on its next use.

Tolerance policy (:func:`assert_parity`):

* ``"exact"`` - ``torch.equal``. For results produced by pure data movement (split, gather,
  the embedding lookup at tp = 1) or computations where every output element is the same
  sequence of floating-point operations at every tp.
* ``"close"`` - ``max|a - b| <= rtol * max(1, max|b|)``. For results that pass through a
  cross-rank sum (row-parallel linear, embedding all-reduce, grad-norm) or through matmuls
  whose shapes differ between tp degrees: the same terms are added in another order or with
  another blocking of the BLAS kernel. In fp32 each reordered sum of ``K`` terms errs by at
  most ~``K * 2^-24 * max|term|``; our test shapes have ``K <= 2048``, and we use
  ``rtol = 1e-5`` (fp32), ``2e-2`` (bf16, 8 mantissa bits) and ``2e-3`` (fp16).
"""
from __future__ import annotations

import inspect
import multiprocessing as mp
import os
import queue
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch

from tensorpar.launch import free_port  # noqa: F401  (library helper, re-exported for the tests)
from tensorpar.parallel import ParallelConfig, init_parallel

RTOL = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 2e-2, torch.float16: 2e-3}


class RankFailure(AssertionError):
    """One or more ranks raised, or timed out; the message holds each failing rank's traceback."""




def _takes_store(fn) -> bool:
    """Whether job ``fn`` has a ``store`` parameter (a callable without a signature: no)."""
    try:
        return "store" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _worker(rank: int, world: int, config: ParallelConfig, init_method: str, timeout_s: float, jobs, results):
    import signal

    # A runner that starts jobs in the background may ignore SIGINT; ranks must see Ctrl-C as usual.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        ctx = init_parallel(config, rank=rank, world_size=world, init_method=init_method, timeout_s=timeout_s,
                            backend="gloo", set_threads=False)
    except BaseException:
        results.put((-1, rank, "err", traceback.format_exc()))
        return
    results.put((-1, rank, "ok", None))
    store: dict = {}            # this rank's objects kept between jobs, for jobs that take ``store=`` (WorkerPool.run)
    while True:
        job = jobs.get()
        if job is None:
            break
        job_id, fn, args = job
        try:
            results.put((job_id, rank, "ok", fn(ctx, *args, **({"store": store} if _takes_store(fn) else {}))))
        except BaseException:
            results.put((job_id, rank, "err", traceback.format_exc()))
    ctx.destroy()


class WorkerPool:
    """``world_size`` gloo ranks on this host, kept alive between jobs.

    Args:
        world_size: number of ranks.
        config: parallel degrees (default ``tp = world_size``).
        collective_timeout_s: torch.distributed timeout of every collective on these ranks.
        job_timeout_s: how long :meth:`run` waits for all ranks' answers.
    """

    def __init__(self, world_size: int, config: ParallelConfig | None = None, *,
                 collective_timeout_s: float = 60.0, job_timeout_s: float = 300.0):
        self.world_size = world_size
        self.config = config or ParallelConfig(tp=world_size)
        self.config.validate(world_size)
        self.collective_timeout_s, self.job_timeout_s = collective_timeout_s, job_timeout_s
        self._procs: list = []
        self._next_job = 0

    def _start(self):
        mpc = mp.get_context("spawn")
        self._results = mpc.Queue()
        self._jobs = [mpc.Queue() for _ in range(self.world_size)]
        init = f"tcp://127.0.0.1:{free_port()}"
        self._procs = [mpc.Process(target=_worker, args=(r, self.world_size, self.config, init,
                                                         self.collective_timeout_s, self._jobs[r], self._results),
                                   daemon=True) for r in range(self.world_size)]
        for p in self._procs:
            p.start()
        self._collect(-1, timeout_s=120.0)

    def _collect(self, job_id: int, timeout_s: float) -> list[Any]:
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        while len(out) + len(errors) < self.world_size:
            left = deadline - time.monotonic()
            if errors:  # give the others a little time to fail too, then report
                left = min(left, self.collective_timeout_s + 5.0)
            try:
                jid, rank, status, value = self._results.get(timeout=max(left, 0.01))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                missing = sorted(set(range(self.world_size)) - set(out) - set(errors))
                self.close()
                msg = f"ranks {missing} gave no answer within {timeout_s:.0f} s (dead processes: {dead})"
                raise RankFailure(msg + "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
            if jid != job_id:
                continue
            (errors if status == "err" else out)[rank] = value
        if errors:
            self.close()
            raise RankFailure("".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
        return [out[r] for r in range(self.world_size)]

    def run(self, fn: Callable, *args, timeout_s: float | None = None) -> list[Any]:
        """Run ``fn(ctx, *args)`` on every rank; return the per-rank results in rank order. A ``fn`` with a
        ``store`` parameter also gets ``store=``: a dict of this rank's, the same for every job of this pool (a model
        loaded by one job, decoded by the next: ``bench/bench_tp_scaling.py``).

        Raises:
            RankFailure: a rank raised (its traceback is in the message) or did not answer in time.
        """
        if not self._procs:
            self._start()
        self._next_job += 1
        for q in self._jobs:
            q.put((self._next_job, fn, args))
        return self._collect(self._next_job, timeout_s or self.job_timeout_s)

    def close(self) -> None:
        """Stop the ranks (politely, then by force)."""
        for q, p in zip(getattr(self, "_jobs", []), self._procs):
            if p.is_alive():
                try:
                    q.put(None)
                except Exception:
                    pass
        deadline = time.monotonic() + 3.0
        for p in self._procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.05))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------- comparison


def random_model(config, *, seed: int = 0, scale: float = 0.05, auto_class=None, **kwargs) -> torch.nn.Module:
    """The unsharded reference of a parity check: ``auto_class.from_config(config, **kwargs)`` (default
    ``AutoModelForCausalLM``) in fp32, built after ``torch.manual_seed(seed)``, every parameter then perturbed by
    ``scale`` x N(0, 1) so that biases, norm weights (Gemma's ``1 + w`` norms start at 0) and every expert matter.
    Same seed, same weights on every rank. Returns the model in train mode (``from_config``'s)."""
    if auto_class is None:
        from transformers import AutoModelForCausalLM as auto_class
    torch.manual_seed(seed)
    model = auto_class.from_config(config, **kwargs).float()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model


@dataclass
class Diff:
    """Result of one comparison: name, kind (exact/close), max abs difference, bound."""

    name: str
    kind: str
    max_abs: float
    bound: float

    @property
    def ok(self) -> bool:
        return self.max_abs <= self.bound


def diff(name: str, actual: torch.Tensor, expected: torch.Tensor, kind: str = "close") -> Diff:
    """Compare two tensors under the policy above (shapes must match exactly)."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a, b = actual.detach().double(), expected.detach().double()
    max_abs = (a - b).abs().max().item() if a.numel() else 0.0
    if kind == "exact":
        return Diff(name, kind, 0.0 if torch.equal(actual.detach(), expected.detach()) else max(max_abs, 1e-300), 0.0)
    bound = RTOL[expected.dtype] * max(1.0, b.abs().max().item() if b.numel() else 0.0)
    return Diff(name, kind, max_abs, bound)


def assert_parity(name: str, actual: torch.Tensor, expected: torch.Tensor, kind: str = "close") -> Diff:
    """:func:`diff`, raising AssertionError with both values' scale if out of tolerance."""
    d = diff(name, actual, expected, kind)
    if not d.ok:
        raise AssertionError(f"{name}: max |diff| {d.max_abs:.3e} exceeds the {kind} bound {d.bound:.3e} "
                             f"(max |expected| {expected.detach().abs().max().item():.3e})")
    return d


def local_slice(full: torch.Tensor, param: torch.nn.Parameter, tp_rank: int) -> torch.Tensor:
    """The slice of a full-shape tensor that ``param`` (a shard, or a replicated tensor) holds on ``tp_rank``."""
    dim = getattr(param, "tp_dim", None)
    if dim is None:
        return full
    idx = torch.tensor(param.tp_partition.indices(tp_rank), device=full.device)
    return full.index_select(dim, idx)


def compare_grads(model: torch.nn.Module, reference: torch.nn.Module, tp_rank: int,
                  name_map: Callable[[str], str] = lambda n: n) -> list[Diff]:
    """Compare every parameter gradient of a sharded ``model`` with the matching slice of ``reference``'s.

    ``name_map`` turns a parameter name of ``model`` into the reference's name.
    Raises AssertionError naming the first parameter out of tolerance, or one without a gradient.
    """
    ref = dict(reference.named_parameters())
    diffs = []
    for n, p in model.named_parameters():
        rp = ref[name_map(n)]
        if p.grad is None or rp.grad is None:
            raise AssertionError(f"{n}: gradient missing (sharded: {p.grad is None}, reference: {rp.grad is None})")
        diffs.append(assert_parity(f"grad {n}", p.grad, local_slice(rp.grad, p, tp_rank)))
    return diffs
