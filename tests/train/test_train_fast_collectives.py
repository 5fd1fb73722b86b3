"""Training with the tp group's collectives on shared memory (``fast_collectives``) equals gloo and one process.

Setup: the tiny Llama of ``tests/_train_jobs.py`` (uneven vocabulary shards, tied embedding, grouped-query
attention), fp32, dropout off, clipping active, 8 steps, at tp = 2 with and without sequence parallelism. In one
launch every run trains twice: with ``fast_collectives="on"`` (tensorpar.shm, installed the way
``tensorpar train`` does) and with ``"off"`` (gloo).

Tolerances:
* shm vs gloo at tp = 2: **bit-identical** losses, gradient norms and every gathered gradient. Every collective of
  two ranks adds exactly two terms per element, ``x0 + x1`` in the tensor's dtype, in both transports (gloo's ring
  and the shared-memory one-shot/two-shot sums alike), IEEE addition is commutative, and every other operation is
  the same on the same rank, so no rounding can differ.
* either vs one process: the parity policy of ``tests/train/test_train_parity.py`` (losses and norms within 1e-5
  relative, gradients within the harness's "close" bound): the cross-rank sums reorder additions.
"""
import pytest
import torch

from tensorpar.parallel import ParallelContext
from tensorpar.testing import assert_parity
from tests._ranks import run_tp
from tests._train_jobs import BASE, train_run

CFG = BASE.replace(steps=8)
GRAD_STEPS = (1, 8)


def job_fast_and_gloo(ctx, specs):
    """``{name: {"shm": result, "gloo": result}}``; each shm result also records how many collectives the
    shared-memory communicator ran (proof that the fast path was taken) and whether it was installed."""
    from tensorpar.shm import disable_fast_collectives
    from tensorpar.train.cli import enable_tp_fast_collectives

    out = {}
    for name, cfg in specs:
        cfg = cfg.replace(tp=ctx.tp.size)
        res = {}
        for transport, mode in (("shm", "on"), ("gloo", "off")):
            on = enable_tp_fast_collectives(cfg.replace(fast_collectives=mode), ctx, 60.0)
            try:
                fast = ctx.tp.fast
                r = train_run(ctx, cfg.replace(fast_collectives=mode), grad_steps=GRAD_STEPS)
                r["installed"] = on
                r["shm_calls"] = fast.calls if fast is not None else 0
            finally:
                disable_fast_collectives(ctx.tp)
            res[transport] = r
        out[name] = res
    return out


@pytest.fixture(scope="module")
def runs(pools):
    single = train_run(ParallelContext.single(), CFG, grad_steps=GRAD_STEPS)
    tp2 = run_tp(pools, 2, job_fast_and_gloo, [("plain", CFG), ("sp", CFG.replace(sequence_parallel=True))])
    return single, tp2


def rel(a, b):
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("variant", ["plain", "sp"])
def test_shm_training_is_bit_identical_to_gloo(runs, variant):
    _, tp2 = runs
    for rank, per in enumerate(tp2):
        shm, gloo = per[variant]["shm"], per[variant]["gloo"]
        assert shm["installed"] and not gloo["installed"]
        assert shm["shm_calls"] > 0 and gloo["shm_calls"] == 0
        assert shm["loss"] == gloo["loss"], f"rank {rank} {variant}: {shm['loss']} vs {gloo['loss']}"
        assert shm["norm"] == gloo["norm"], f"rank {rank} {variant}: grad norms differ"
    shm, gloo = tp2[0][variant]["shm"], tp2[0][variant]["gloo"]
    for step in GRAD_STEPS:
        assert set(shm["grads"][step]) == set(gloo["grads"][step])
        for name, g in gloo["grads"][step].items():
            assert torch.equal(shm["grads"][step][name], g), f"{variant} step {step} grad {name}"


@pytest.mark.parametrize("variant", ["plain", "sp"])
def test_shm_training_matches_one_process(runs, variant):
    single, tp2 = runs
    got = tp2[0][variant]["shm"]
    assert rel(got["loss"], single["loss"]) <= 1e-5, (got["loss"], single["loss"])
    assert rel(got["norm"], single["norm"]) <= 1e-5
    assert sum(n > CFG.grad_clip for n in single["norm"]) >= 2    # clipping was active
    for step in GRAD_STEPS:
        assert set(got["grads"][step]) == set(single["grads"][step])
        for name, g in single["grads"][step].items():
            assert_parity(f"tp=2 shm {variant} step {step} grad {name}", got["grads"][step][name], g)


def test_fast_collectives_flag_reaches_the_config():
    import argparse

    from tensorpar.train.cli import add_arguments, config_from_args
    from tensorpar.train.config import TrainConfig

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert config_from_args(p.parse_args([])).fast_collectives == "auto"
    assert config_from_args(p.parse_args(["--fast-collectives", "off"])).fast_collectives == "off"
    with pytest.raises(ValueError, match="fast_collectives='fast'.*auto, on, off"):
        TrainConfig(fast_collectives="fast")


def test_fast_collectives_on_refused_before_ranks_start_on_non_x86(monkeypatch, tmp_path, capsys):
    import argparse
    import platform

    from tensorpar.train.cli import add_arguments, main

    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    # an earlier in-process one-rank run (run_ranks(fn, 1)) leaves RANK/WORLD_SIZE set, which reads as torchrun
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--tp", "2", "--fast-collectives", "on", "--out", str(tmp_path / "run")])
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--fast-collectives on" in err and "not x86" in err
    assert not (tmp_path / "run").exists()


def job_3d_fast_and_gloo(ctx, layouts):
    """``tests/train/test_3d.py``'s job (the Trainer: pipeline, data-parallel replicas) with the tp group on shared
    memory and on gloo: ``[(shm result, gloo result, shm calls)]`` per layout."""
    from tensorpar.shm import disable_fast_collectives
    from tensorpar.train.cli import enable_tp_fast_collectives
    from tests.train.test_3d import job_3d

    out = []
    for kw in layouts:
        assert enable_tp_fast_collectives(CFG.replace(fast_collectives="on"), ctx, 60.0)
        fast = ctx.tp.fast
        try:
            shm = job_3d(ctx, kw)
        finally:
            disable_fast_collectives(ctx.tp)
        out.append((shm, job_3d(ctx, kw), fast.calls))
    return out


@pytest.mark.parametrize("grid,layouts", [
    ((2, 2, 1), [dict(micro_batches=2, schedule="1f1b"), dict(micro_batches=2, sequence_parallel=True)]),
    # CI keeps tp2-pp2 (30 s each); fsdp and ddp at tp2-dp2 are in test_fsdp's CI cases
    pytest.param((2, 1, 2), [dict(dp_mode="fsdp", sequence_parallel=True), dict(dp_mode="ddp")],
                 marks=pytest.mark.slow),
], ids=["tp2-pp2", "tp2-dp2"])
def test_3d_layouts_with_shm_tp_equal_gloo_and_one_process(grid, layouts):
    """tp x pp and tp x dp with the tp group on shared memory: the same bits as on gloo (two-term sums, see the
    module docstring), and within 1e-5 relative of one process (tests/train/test_3d.py's tolerance)."""
    from tensorpar.parallel import ParallelConfig
    from tensorpar.testing import WorkerPool
    from tests.train.test_3d import job_3d

    tp, pp, dp = grid
    ref = job_3d(ParallelContext.single(), {})
    with WorkerPool(4, ParallelConfig(tp=tp, pp=pp, dp=dp), collective_timeout_s=60.0) as pool:
        per_rank = pool.run(job_3d_fast_and_gloo, layouts)
    for rank, results in enumerate(per_rank):
        for kw, (shm, gloo, calls) in zip(layouts, results):
            assert calls > 0, f"rank {rank} {kw}: the shared-memory path was not used"
            assert shm[0] == gloo[0] and shm[1] == gloo[1], f"rank {rank} {kw}: {shm} vs {gloo}"
            assert shm[0] == pytest.approx(ref[0], rel=1e-5), f"rank {rank} {kw}: losses {shm[0]} vs {ref[0]}"
            assert shm[1] == pytest.approx(ref[1], rel=1e-5), f"rank {rank} {kw}: grad norms {shm[1]} vs {ref[1]}"
