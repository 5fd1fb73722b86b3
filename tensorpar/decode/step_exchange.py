"""A decode step's all-reduces inside its program (:class:`StepExchange`): the row step
(:class:`~tensorpar.decode.row_step.RowStep`) runs all its layers as one program of fused kernels with an
``OP_EXCHANGE`` after each row-parallel projection, and on tensorpar's shared-memory communicator the exchange runs
in C too (csrc/step.cpp, the step of :mod:`tensorpar.shm.protocol`), so a token costs one call from Python where it
cost two program calls and two exchanges per layer (SmolLM2 at tp=2: 120 calls, 1.2 ms of Python per token,
bench/results/step_overhead-xeon.md). Every other group (gloo, TCP, ``--tp-comm int8``, a hierarchical one) and a
step watched by the collective fingerprints (``--check-collectives``) stop at each exchange and run
:func:`~tensorpar.decode.fused.all_reduce_exchange` from Python, as before; results are the same bits either way
(the same copies into the same slots, summed by the same ``OP_NORM``).
"""
from __future__ import annotations

import ctypes

import torch

from tensorpar.comm import Group
from tensorpar.decode import fused

#: the context's words (csrc/step.cpp ``X_*``): mode, control words, line, W_META, spin and yield ns, source, bytes, metadata a and
#: b, this rank's slot of each parity, the C arrays of every rank's slots of each parity, their count, then what a run
#: leaves (exchanges done in C, ns waited in C, the arrival count of a step left to Python), the peers and their lines
(X_MODE, X_CTL, X_ME, X_WMETA, X_SPIN, X_YIELD, X_SRC, X_BYTES, X_A, X_B, X_SLOT0, X_SLOT1, X_PARTS0, X_PARTS1, X_NPARTS,
 X_DONE, X_WAIT_NS, X_PENDING, X_NPEERS, X_PEERS) = range(20)
#: the modes: each exchange stops for the caller; one rank (the parts are the partial sums themselves); shared memory
X_PYTHON, X_ONE, X_SHM = 0, 1, 2


class StepExchange:
    """The all-reduces of one program's ``OP_EXCHANGE`` ops over group ``tp``, each of the partial sums ``partial``
    ``[rows, H]`` fp32 (the same buffer every time, per rank its row-parallel projection's partial sums; the sum over
    the ranks, in rank order, is what the next ``OP_NORM`` adds). :meth:`op` is the op to put in the program;
    :meth:`run` runs the program. Collectives: per exchange one all-reduce of ``[rows, H]`` on ``tp``, counted (and
    fingerprinted) as :func:`tensorpar.comm.all_reduce`'s."""

    def __init__(self, partial: torch.Tensor, tp: Group, dtype: torch.dtype = torch.float32):
        self.partial, self.tp, self.dtype = partial, tp, dtype      # dtype: the model's (fused.all_reduce_exchange)
        self.fast = None                    # the shared-memory communicator the words were built for
        self.done = 0                       # exchanges the last run ran to the end in C
        self.words = (ctypes.c_int64 * (X_PEERS + max(tp.size - 1, 0)))()
        self.parts: dict = {}               # all_reduce_exchange's C arrays, per set of addresses
        self.keep: list = []                # the C arrays the words point to
        one = (ctypes.c_int64 * 1)(partial.data_ptr())
        w = self.words
        if tp.size == 1:
            w[X_MODE], w[X_PARTS0], w[X_NPARTS], self.keep = X_ONE, ctypes.addressof(one), 1, [one]

    def op(self) -> tuple[int, int]:
        """The program op ``(OP_EXCHANGE, address of the context words)``."""
        return fused.OP_EXCHANGE, ctypes.addressof(self.words)

    def _mode(self) -> int:
        """This step's mode: ``X_ONE`` at one rank; ``X_SHM`` on a shared-memory communicator (the words built at
        the first step on it) with no fingerprint watching; else ``X_PYTHON``."""
        tp, w = self.tp, self.words
        if tp.size == 1:
            return X_ONE
        fast = tp.fast
        if (tp.compression != "fp32" or tp.counter.fingerprint is not None or fast is None
                or not hasattr(fast, "c_exchange_words")):
            return X_PYTHON
        if fast is self.fast:
            fast.check_usable()             # broken by an earlier failure: raise as the Python exchange does
        else:
            c = fast.c_exchange_words(self.partial)     # raises for a broken communicator too
            if c is None:
                return X_PYTHON
            arrays = [(ctypes.c_int64 * tp.size)(*c["parts"][p]) for p in (0, 1)]
            vals = {X_CTL: c["ctl"], X_ME: c["me"], X_WMETA: c["w_meta"], X_SPIN: c["spin_ns"], X_YIELD: c["yield_ns"],
                    X_SRC: self.partial.data_ptr(), X_BYTES: c["nbytes"], X_A: c["a"], X_B: c["b"],
                    X_SLOT0: c["slots"][0], X_SLOT1: c["slots"][1], X_PARTS0: ctypes.addressof(arrays[0]),
                    X_PARTS1: ctypes.addressof(arrays[1]), X_NPARTS: tp.size, X_NPEERS: len(c["peers"])}
            for k, v in vals.items():
                w[k] = v
            for i, line in enumerate(c["peers"]):
                w[X_PEERS + i] = line
            self.fast, self.keep = fast, arrays
        return X_SHM

    def _count_done(self) -> None:
        """Hand the exchanges C ran to the end since the last call to the communicator (its call count and arrival
        count) and add them to ``done``."""
        w = self.words
        n, w[X_DONE] = w[X_DONE], 0
        self.done += n
        self.fast.c_exchange_done(n)

    def run(self, prog: int, step) -> None:
        """Run program ``prog`` (an address) with step words ``step`` (a ctypes int64 array; ``STEP_PARTS`` and
        ``STEP_NPARTS`` are set at each exchange) to its end. Raises what the exchanges raise
        (:meth:`tensorpar.shm.ShmCommunicator.all_reduce_parts`: ValueError when the ranks disagree,
        :class:`~tensorpar.comm.CollectiveError` for a lost peer) and RuntimeError for a malformed program."""
        w, tp = self.words, self.tp
        w[X_MODE] = mode = self._mode()
        w[X_DONE] = w[X_WAIT_NS] = w[X_PENDING] = 0
        sp, at = ctypes.addressof(step), ctypes.c_int64(0)
        P, N = fused.STEP_PARTS, fused.STEP_NPARTS
        keep, waited, counter = None, 0, tp.counter
        self.done = 0                       # exchanges run to the end in C (the communicator counted, X_DONE zeroed)
        try:
            while True:
                r = fused.run_at(prog, sp, at)
                if r == fused.RUN_END:
                    break
                if r == fused.RUN_EXCHANGE:
                    step[P], step[N], keep = fused.all_reduce_exchange(self.partial, tp, self.parts, self.dtype)
                elif r in (fused.RUN_WAIT, fused.RUN_MISMATCH):
                    pending, w[X_PENDING] = w[X_PENDING], 0
                    self._count_done()      # the C exchanges before it: the communicator's call numbers in messages
                    waited += 1
                    t0 = counter.start()
                    parts = self.fast.c_exchange_wait(pending)
                    counter.blocked("all_reduce", t0)
                    step[P], step[N] = w[X_PARTS1 if (pending - 1) & 1 else X_PARTS0], len(parts)
                else:
                    raise RuntimeError(f"decode step program: unknown op at word {at.value}")
        finally:
            if mode == X_SHM:
                self._count_done()
                if counter.enabled:
                    for _ in range(self.done + waited):
                        counter.record("all_reduce", self.partial.numel(), 4, tp.size)
                    counter.seconds["all_reduce"] += w[X_WAIT_NS] * 1e-9
        del keep
