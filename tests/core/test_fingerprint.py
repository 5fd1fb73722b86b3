"""Collective fingerprints: divergent collectives and inputs across tp ranks become named errors."""
import time

import pytest
import torch
from torch import nn

from tensorpar import comm
from tensorpar.fingerprint import CollectiveMismatch, check, disable, enable, enable_from_env
from tensorpar.generate import SamplingConfig, generate_tokens


def _run(ctx, fn):
    try:
        fn()
    except CollectiveMismatch as e:
        return str(e)
    finally:
        disable(ctx.tp)          # the pool's ranks run other tests' jobs next
    return None


def job_skip(ctx):
    tp = ctx.tp
    fp = enable(tp, every=1, timeout_s=3.0, sync_every=0)   # compared per step only

    def step(skip):
        comm.all_reduce(torch.ones(4), tp)                  # #1 (#3 in step 1)
        if not skip:
            comm.all_reduce(torch.ones(6), tp)              # #2 (#4): the one rank 1 skips in step 1
        return check(tp)

    assert step(False)                                      # step 0: every rank agrees
    assert fp.log == []
    try:
        return _run(ctx, lambda: step(tp.rank == 1))
    except comm.CollectiveError as e:                       # rank 0: waits in the all-reduce rank 1 skipped
        return "CollectiveError: " + str(e)


def job_swap(ctx, sync_every):
    tp = ctx.tp
    enable(tp, every=1, timeout_s=5.0, sync_every=sync_every)

    def body():
        comm.all_reduce(torch.ones(4), tp)
        # the same 24 bytes, but rank 1 sends them as 3 float64 (a dtype bug): nothing hangs, the values are garbage
        comm.broadcast(torch.ones(6) if tp.rank == 0 else torch.ones(3, dtype=torch.float64), tp)
        check(tp)
    return _run(ctx, body)


def job_inputs(ctx, what):
    from transformers import LlamaConfig, AutoModelForCausalLM
    from tensorpar.hf.apply import parallelize
    from tensorpar.hf.plan import make_plan
    tp = ctx.tp
    enable(tp, every=50)
    cfg = LlamaConfig(vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = parallelize(AutoModelForCausalLM.from_config(cfg), make_plan(cfg, tp.size), tp).eval()
    prompt = torch.tensor([[1, 2, 3, 4 + (tp.rank if what == "prompt" else 0)]])
    seed = 7 + (tp.rank if what == "seed" else 0)
    sampling = SamplingConfig(max_new_tokens=2, temperature=1.0, seed=seed)

    def run():
        check(tp, {"prompt token ids": prompt, "sampling seed": seed})   # step 0: compared
        generate_tokens(model, tp, prompt, sampling=sampling)
    return _run(ctx, run)


class _Reduce(nn.Module):
    """One all-reduce of ``x`` over ``tp`` (a row-parallel layer's collective)."""

    def __init__(self, tp):
        super().__init__()
        self.tp = tp

    def forward(self, x):
        return comm.all_reduce(x, self.tp)


class _Net(nn.Module):
    """Three layers ``a``, ``b``, ``c`` that issue all-reduces of 4, 6 and 8 elements."""

    def __init__(self, tp):
        super().__init__()
        self.a, self.b, self.c = _Reduce(tp), _Reduce(tp), _Reduce(tp)


def job_reorder(ctx):
    """Rank 1 runs layers ``a`` and ``b`` in the other order: same collective kinds and sizes, other modules."""
    tp = ctx.tp
    net = _Net(tp)
    enable(tp, every=1, timeout_s=20.0, model=net)
    order = [net.b, net.a] if tp.rank == 1 else [net.a, net.b]

    def step():
        for layer in order:
            layer(torch.ones(4))
        check(tp)
    return _run(ctx, step)


def job_skip_mid_step(ctx, last: bool):
    """Rank 1 skips layer ``b``'s all-reduce in step 1 (``last``: ``b`` is the step's last collective)."""
    tp = ctx.tp
    net = _Net(tp)
    enable(tp, every=1, timeout_s=30.0, model=net)
    layers = [net.a, net.b] if last else [net.a, net.b, net.c]
    sizes = {net.a: 4, net.b: 6, net.c: 8}

    def step(skip):
        for layer in layers:
            if not (skip and layer is net.b):
                layer(torch.ones(sizes[layer]))
        check(tp)
    step(False)                                          # step 0: every rank agrees
    t0 = time.monotonic()
    try:
        msg = _run(ctx, lambda: step(tp.rank == 1))
    except comm.CollectiveError as e:                    # the old behaviour: the collective timeout
        msg = "CollectiveError: " + str(e)
    return msg, time.monotonic() - t0


def test_rank_that_skips_an_all_reduce_is_named():
    from tensorpar.testing import WorkerPool
    with WorkerPool(2, collective_timeout_s=8.0) as pool:   # its own pool: the skip leaves rank 0's collective dead
        m0, m1 = pool.run(job_skip)
    assert m1 == ("tp rank 0 did not arrive within 3 s: rank 0 was last at the end of step 0 after 2 collectives "
                  "(last: #2 all_reduce of 6 elements x 4 bytes in test_fingerprint.py:step); rank 1 is at the end of "
                  "step 1 after 3 collectives (last: #3 all_reduce of 4 elements x 4 bytes in "
                  "test_fingerprint.py:step); the missing rank is blocked in a collective the others did not issue (a "
                  "skipped or extra collective) or hung"), m1
    assert m0.startswith("CollectiveError: all_reduce on tp group (rank 0 of 2, tensor (6,)"), m0


def test_reordered_layers_are_named(pools):
    """Ranks that run two layers in another order (same collective kinds and shapes): before, every check
    agreed and the logits were silently wrong; now the call sites differ at the first reordered collective."""
    msgs = pools(2).run(job_reorder)
    for m in msgs:
        assert m == ("tp ranks are about to issue different collectives: #1 (rank 0: all_reduce of 4 elements x 4 "
                     "bytes in a at step 0; rank 1: all_reduce of 4 elements x 4 bytes in b at step 0); a rank "
                     "skipped, reordered or changed a collective"), m


@pytest.mark.parametrize("last", [pytest.param(False, marks=pytest.mark.slow), True])  # False: as reorder, slow
def test_collective_skipped_inside_a_step_is_named_before_the_timeout(last):
    """Rank 1 skips one all-reduce inside a step. Before, both ranks waited for the collective timeout (60 s here)
    and got a generic collective error; now both name the skipped call within seconds."""
    from tensorpar.testing import WorkerPool
    with WorkerPool(2, collective_timeout_s=60.0) as pool:  # its own pool: the skip may leave a collective dead
        (m0, t0), (m1, t1) = pool.run(job_skip_mid_step, last)
    if not last:  # rank 1 goes on to layer c: the two records of collective #5 differ
        want = ("tp ranks are about to issue different collectives: #5 (rank 0: all_reduce of 6 elements x 4 bytes "
                "in b at step 1; rank 1: all_reduce of 8 elements x 4 bytes in c at step 1); a rank skipped, "
                "reordered or changed a collective")
        assert m0 == want and m1 == want, (m0, m1)
    else:  # rank 1 is at the end of step 1, rank 0 waits to issue b's all-reduce: each names the other's place
        assert m0 == ("tp ranks parted: rank 1 is at the end of step 1 after 3 collectives (last: #3 all_reduce of 4 "
                      "elements x 4 bytes in a), rank 0 at collective #4 (all_reduce of 6 elements x 4 bytes in b) at "
                      "step 1; a rank skipped, reordered or added a collective"), m0
        assert m1 == ("tp ranks parted: rank 0 is at collective #4 (all_reduce of 6 elements x 4 bytes in b) at step "
                      "1, rank 1 at the end of step 1 after 3 collectives (last: #3 all_reduce of 4 elements x 4 "
                      "bytes in a); a rank skipped, reordered or added a collective"), m1
    # named by the store side channel, not by the collective timeout (60 s); generous for a loaded machine
    assert max(t0, t1) < 15, (t0, t1)


@pytest.mark.parametrize("sync_every", [0, pytest.param(1, marks=pytest.mark.slow)])  # 1: as reorder, slow
def test_first_differing_collective_is_named(sync_every):
    from tensorpar.testing import WorkerPool
    with WorkerPool(2, collective_timeout_s=8.0) as pool:
        msgs = pool.run(job_swap, sync_every)
    site = "test_fingerprint.py:body"  # no model given: the calling function
    for m in msgs:
        if sync_every:  # compared before the broadcast runs
            assert m == (f"tp ranks are about to issue different collectives: #2 (rank 0: broadcast of 6 elements x 4 "
                         f"bytes in {site} at step 0; rank 1: broadcast of 3 elements x 8 bytes in {site} at step 0); "
                         f"a rank skipped, reordered or changed a collective"), m
        else:  # compared at the step's check
            assert m == (f"tp ranks issued different collectives at step 0: collective #2 differs (rank 0: broadcast "
                         f"of 6 elements x 4 bytes in {site}; rank 1: broadcast of 3 elements x 8 bytes in {site}); a "
                         f"rank skipped, reordered or changed a collective"), m


@pytest.mark.parametrize("what,name", [("prompt", "prompt token ids"), ("seed", "sampling seed")])
def test_divergent_inputs_are_named(pools, what, name):
    msgs = pools(2).run(job_inputs, what)
    for m in msgs:
        assert m == f"input {name!r} differs across tp ranks at step 0: rank 0 vs rank 1 were given different values"


def test_same_inputs_pass(pools):
    assert pools(2).run(job_inputs, "none") == [None, None]


def test_off_by_default_and_env(monkeypatch):
    g = comm.Group.single()
    assert check(g) is False and g.counter.fingerprint is None
    monkeypatch.setenv("TENSORPAR_CHECK_COLLECTIVES", "1")
    assert enable_from_env(g, every=3) is g.counter.fingerprint and g.counter.fingerprint.every == 3
    monkeypatch.setenv("TENSORPAR_CHECK_COLLECTIVES", "yes")
    with pytest.raises(ValueError, match="TENSORPAR_CHECK_COLLECTIVES='yes'"):
        enable_from_env(g)
    with pytest.raises(ValueError, match="every=0"):
        enable(g, every=0)
