"""The row step's all-reduces inside its program (tensorpar/decode/step_exchange.py, csrc/step.cpp OP_EXCHANGE): on
the shared-memory communicator the exchanges run in C, and the step's logits are bitwise those of the same program
stopping at each exchange for Python's; the collectives are counted alike; a late peer, ranks that disagree and a
peer that leaves are handled as the Python exchange handles them."""
import ctypes
import time

import pytest
import torch

from tensorpar.decode import fused, gemv_kernel
from tensorpar.decode import step_exchange as sx
from tests._ranks import run_tp
from tests.decode.test_generate import make_model_folder, prompts

needs_kernels = pytest.mark.skipif(not (gemv_kernel.available() and fused.available()),
                                   reason="TENSORPAR_GEMV_KERNEL=0, neither AVX-512 nor AVX2, no compiler")


@needs_kernels
def test_the_context_words_agree_with_the_kernel():
    """step_exchange.py's word indices end where csrc/step.cpp's enum does (X_PEERS)."""
    assert fused._lib().tp_exchange_words() == sx.X_PEERS


def job_modes(ctx, folder, ids, late_rank):
    """Two decoders of one model at batch 1, fed the same tokens: one with the exchanges in C, one forced to stop at
    each for Python's. Per step: logits of both (bitwise equal?), the C mode's exchanges done in C, the
    all-reduces counted in each mode; and how many C exchanges went back to Python for a late peer. ``late_rank``
    runs its exchanges from Python, each 5 ms late, in the first decoder's steps (the other rank's C poll gives up
    after its spin and yield phases, 2 ms, and the wait finishes in Python)."""
    from tensorpar.comm import counting
    from tensorpar.decode.lean import LeanDecoder
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.shm import disable_fast_collectives, enable_fast_collectives
    enable_fast_collectives(ctx.tp, "on")
    exchange = fused.all_reduce_exchange
    try:
        model, _ = build_parallel_model(folder, ctx.tp)
        decs = [LeanDecoder(model, ctx.tp, max_batch=1, max_len=32) for _ in range(2)]
        ex_c, ex_py = (d.row_step.program(1)[1] for d in decs)
        ex_py._mode = lambda: sx.X_PYTHON
        fast, waits, late = ctx.tp.fast, [], []
        wait = fast.c_exchange_wait
        fast.c_exchange_wait = lambda seq: waits.append(seq) or wait(seq)
        if ctx.tp.rank == late_rank:
            ex_c._mode = lambda: sx.X_PYTHON
            fused.all_reduce_exchange = lambda *a: (time.sleep(0.005) if late else None) or exchange(*a)
        mask = torch.ones_like(ids)
        pos = mask.cumsum(-1) - 1
        for d in decs:
            d.prefill(ids, mask, pos)
        out = []
        for t in range(4):
            step, w0 = [], len(waits)
            for d, ex in zip(decs, (ex_c, ex_py)):
                late[:] = [1] if ex is ex_c else []
                with counting(ctx.tp) as c:
                    y = d.decode(torch.tensor([[5 + t]]), pos[:, -1:] + 1 + t, ids.shape[1] + t)
                step.append((y, dict(c.calls), dict(c.elements), ex.done))
            (y_c, calls_c, el_c, done_c), (y_py, calls_py, el_py, done_py) = step
            out.append((torch.equal(y_c, y_py), calls_c == calls_py, el_c == el_py, done_c, done_py,
                        calls_c.get("all_reduce", 0), len(waits) - w0))
        return out, len(waits), len(model.model.layers)
    finally:
        fused.all_reduce_exchange = exchange        # the pool's processes run the next tests
        disable_fast_collectives(ctx.tp)


@needs_kernels
@pytest.mark.parametrize("late_rank", [-1, 1])
def test_exchanges_in_c_give_the_python_exchanges_bits_and_counts(pools, tmp_path, late_rank):
    """tp=2 over shared memory: every step's logits bitwise equal to the program stopping for Python's exchanges,
    the same all-reduces counted (calls and elements), two exchanges per layer run in C (none in the forced mode);
    with rank 1 running its exchanges from Python, each 5 ms late, rank 0's C poll gives up (at half of them at
    least: timing) and the wait finishes in Python, with the same bits (a C rank and a Python rank run the same
    protocol)."""
    folder = make_model_folder(tmp_path / "llama", "llama")
    ids, _ = prompts(53)
    for r, (steps, waits, layers) in enumerate(run_tp(pools, 2, job_modes, folder, ids[:1], late_rank)):
        for equal, same_calls, same_elements, done_c, done_py, all_reduces, waited in steps:
            assert equal and same_calls and same_elements, (r, steps)
            assert done_py == 0 and done_c + waited == (0 if r == late_rank else 2 * layers), (r, steps)
            assert all_reduces == 2 * layers + 1, (r, all_reduces)         # + the embedding's
        if late_rank == 1 and r == 0:
            # most of rank 0's exchanges finish in Python; not always all: a rank descheduled for 3 ms or more (2
            # cores, the suite's other work) reaches an exchange with the late part already there (seen for 1 of 16)
            waited = sum(s[-1] for s in steps)
            assert waited >= len(steps) * layers, f"rank 0 did not wait in Python for the late rank 1: {steps}"


def job_disagree(ctx, what):
    """One program of an exchange and an add (OP_NORM without a norm's output) on partial sums of 8 elements on rank
    0 and ``8 * (rank + 1)`` on the others (``what`` "shape"), or with rank 1 closing its communicator instead of
    arriving ("leave"). Returns the exception's type and message, and whether an all-reduce still runs after it."""
    from tensorpar.comm import CollectiveError
    from tensorpar.shm import disable_fast_collectives, enable_fast_collectives
    enable_fast_collectives(ctx.tp, "on")
    try:
        n = 8 * (ctx.tp.rank + 1) if what == "shape" else 8
        p, x = torch.full((1, n), float(ctx.tp.rank + 1)), torch.zeros(1, n)
        ex = sx.StepExchange(p, ctx.tp)
        prog = fused.program([ex.op(), (fused.OP_NORM, x.data_ptr(), 1, n, 0, 0, None)])
        step = (ctypes.c_int64 * fused.STEP_TABLES)()
        if what == "leave" and ctx.tp.rank == 1:
            disable_fast_collectives(ctx.tp)
            return None
        try:
            ex.run(ctypes.addressof(prog), step)
            err = None
        except (ValueError, CollectiveError) as e:
            err = (type(e).__name__, str(e))
        if what == "shape":                           # still usable: a ValueError does not break the communicator
            y = ctx.tp.fast.all_reduce(torch.ones(4))
            return err, torch.equal(y, torch.full((4,), 2.0))
        return err, x.tolist()
    finally:
        disable_fast_collectives(ctx.tp)


@needs_kernels
def test_ranks_that_disagree_get_one_value_error_and_stay_usable(pools):
    """Partial sums of different sizes on the two ranks: both raise the shared-memory all-reduce's ValueError naming
    both ranks' tensors, and an all-reduce after it gives the right sum."""
    for r, (err, usable) in enumerate(run_tp(pools, 2, job_disagree, "shape")):
        assert err is not None and err[0] == "ValueError" and "different tensors" in err[1], (r, err)
        assert "rank 0: all_reduce(op=sum, 8 x torch.float32); rank 1: all_reduce(op=sum, 16 x" in err[1], err[1]
        assert usable, r


@needs_kernels
def test_a_peer_that_leaves_is_a_collective_error(pools):
    """Rank 1 closes its communicator instead of arriving: rank 0's exchange goes back to Python's wait, which raises
    CollectiveError naming rank 1 (no hang), and x is left unadded."""
    got = run_tp(pools, 2, job_disagree, "leave")
    err, x = got[0]
    assert err is not None and err[0] == "CollectiveError" and "rank 1" in err[1], err
    assert x == [[0.0] * 8]


def job_leave_midway(ctx):
    """Rank 0 runs a program of three exchanges; rank 1 joins two of them (its own two-exchange program), then closes
    its communicator. Rank 0: the error, the communicator's call count and arrival count after it, and the error of a
    second run (the communicator is broken by then)."""
    from tensorpar.comm import CollectiveError
    from tensorpar.shm import disable_fast_collectives, enable_fast_collectives
    enable_fast_collectives(ctx.tp, "on")
    try:
        p, x = torch.ones(1, 8), torch.zeros(1, 8)
        ex = sx.StepExchange(p, ctx.tp)
        norm = (fused.OP_NORM, x.data_ptr(), 1, 8, 0, 0, None)
        prog = fused.program([ex.op(), norm] * (3 if ctx.tp.rank == 0 else 2))
        step = (ctypes.c_int64 * fused.STEP_TABLES)()
        fast = ctx.tp.fast
        if ctx.tp.rank == 1:
            ex.run(ctypes.addressof(prog), step)
            disable_fast_collectives(ctx.tp)
            return None
        errs = []
        for _ in range(2):
            try:
                ex.run(ctypes.addressof(prog), step)
            except CollectiveError as e:
                errs.append(str(e))
        return errs, fast.calls, fast._seq, ex.done
    finally:
        disable_fast_collectives(ctx.tp)


@needs_kernels
def test_a_failure_after_c_exchanges_names_the_right_call_and_breaks_the_communicator(pools):
    """Rank 1 leaves after two of rank 0's three exchanges (run in C): rank 0's CollectiveError names call #3 and
    step 3, as the Python exchanges would (the C exchanges are counted before the wait in Python); a second run
    fails at once with "unusable" instead of writing into the segment again."""
    (errs, calls, seq, done), _ = run_tp(pools, 2, job_leave_midway)
    assert len(errs) == 2 and "rank 1" in errs[0], errs
    assert f"call #{calls}, step {seq})" in errs[0] and calls == seq, (errs[0], calls, seq)
    assert "unusable" in errs[1], errs[1]
