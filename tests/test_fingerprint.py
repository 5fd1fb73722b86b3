"""Collective fingerprints: divergent collectives and inputs across tp ranks become named errors."""
import pytest
import torch

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
    fp = enable(tp, every=1, timeout_s=3.0)

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


def job_swap(ctx):
    tp = ctx.tp
    enable(tp, every=1, timeout_s=5.0)
    comm.all_reduce(torch.ones(4), tp)
    # the same 24 bytes, but rank 1 sends them as 3 float64 (a dtype bug): nothing hangs, the values are garbage
    comm.broadcast(torch.ones(6) if tp.rank == 0 else torch.ones(3, dtype=torch.float64), tp)
    return _run(ctx, lambda: check(tp))


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


def test_rank_that_skips_an_all_reduce_is_named():
    from tensorpar.testing import WorkerPool
    with WorkerPool(2, collective_timeout_s=8.0) as pool:   # its own pool: the skip leaves rank 0's collective dead
        m0, m1 = pool.run(job_skip)
    assert m1 == ("tp rank 0 did not reach the collective check at step 1 within 3 s, while rank 1 did after 3 "
                  "collectives (last here: #3 all_reduce of 4 elements x 4 bytes); the missing ranks are blocked in a "
                  "collective the others did not issue (a skipped or extra collective) or hung"), m1
    assert m0.startswith("CollectiveError: all_reduce on tp group (rank 0 of 2, tensor (6,)"), m0


def test_first_differing_collective_is_named():
    from tensorpar.testing import WorkerPool
    with WorkerPool(2, collective_timeout_s=8.0) as pool:
        msgs = pool.run(job_swap)
    for m in msgs:
        assert m == ("tp ranks issued different collectives at step 0: collective #2 differs (rank 0: broadcast of 6 "
                     "elements x 4 bytes; rank 1: broadcast of 3 elements x 8 bytes); a rank skipped, reordered or "
                     "changed a collective"), m


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
