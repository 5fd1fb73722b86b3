"""Context parallelism in the one trainer (issue 25): per-step loss and grad norm at (cp 2) and (tp 2, cp 2), ring
and all2all, equal the one-process run; every gradient after one step equals tp = cp = 1's; refusals.
Hidden dropout (p = 0.1) at cp 2 and at (tp 2, cp 2, sequence parallel) equals one process with the same dropout:
the keyed masks are drawn for the whole sequence and each rank keeps its positions, so they do not depend on cp.

Setup: tests/_train_jobs.py's tiny Llama (6 query / 2 KV heads, tied embedding) on the synthetic stream, fp32,
clipping active (a gradient counted twice over cp would change the clipped update and every later loss),
seq_len 16 (two chunks of 4 per cp rank), 4 steps. At (tp 2, cp 2) each tp rank has 3 query heads, so all2all is
refused there (3 does not divide by cp 2) and ring runs; the (cp 2, dp 2) layouts need 4 ranks (slow).

Tolerance 1e-5 relative (tests/train/test_3d.py's): the ring merges softmax blocks by log-sum-exp in fp32 and the cp
ranks' loss shares and gradients are summed over cp, so sums run in another order than one process's: fp32
reordering, measured below 1e-6 here.
"""
from dataclasses import replace

import pytest
import torch

from tensorpar.parallel import ParallelConfig, ParallelContext, init_parallel
from tensorpar.testing import WorkerPool
from tests._train_jobs import BASE, gathered_grads, make_trainer

STEPS = 4
TOL = 1e-5


def run(ctx, kw):
    c = ctx.config
    cfg = replace(BASE, tp=c.tp, pp=c.pp, dp=c.dp, cp=c.cp, steps=STEPS, **kw)
    tr = make_trainer(ctx, cfg)
    grads = {}

    def keep(t):   # FSDP2 gradients are DTensors sharded over dp: gathered (every rank, same order)
        grads.update({n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in gathered_grads(t).items()})
    first = tr.train_step(inspect=keep)
    rest = [tr.train_step() for _ in range(STEPS - 1)]
    steps = [first] + rest
    return [s.loss for s in steps], [s.grad_norm for s in steps], grads, tr.evaluate(1)


def job_layouts(ctx, layouts):
    out = {}
    for name, config, kw in layouts:
        sub = init_parallel(config, rank=ctx.rank, world_size=ctx.world_size, backend="gloo", set_threads=False)
        out[name] = run(sub, kw)
    return out


def rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def reference():
    """The one-process run, with the layout's hidden dropout (the keyed masks must be the same at every cp)."""
    made = {}

    def get(kw):
        p = kw.get("hidden_dropout", 0.0)
        if p not in made:
            made[p] = run(ParallelContext.single(), dict(hidden_dropout=p))
        return made[p]
    return get


def check(results, reference, name):
    losses, norms, grads, val = reference
    for r, res in enumerate(results):
        got = res[name]
        assert rel(got[0], losses) <= TOL, f"{name} rank {r}: losses {got[0]} vs {losses}"
        assert rel(got[1], norms) <= TOL, f"{name} rank {r}: grad norms {got[1]} vs {norms}"
        mine = [n for n in grads if n in got[2]]   # a pipeline stage holds its layers' parameters only
        assert mine, f"{name} rank {r}: no parameter in common with the reference"
        for n in mine:
            g = grads[n]
            err = float((got[2][n] - g).abs().max() / g.abs().max())
            assert err <= TOL, f"{name} rank {r}: gradient {n} differs by {err:.2e} (relative to its max)"
        assert abs(got[3] - val) / val <= TOL, f"{name} rank {r}: validation loss {got[3]} vs {val}"


LAYOUTS = {
    2: [("cp2-ring-dropout", ParallelConfig(cp=2), dict(hidden_dropout=0.1)),
        ("cp2-all2all-recompute", ParallelConfig(cp=2), dict(cp_mode="all2all", recompute=True))],
    4: [("tp2-cp2-ring-recompute", ParallelConfig(tp=2, cp=2), dict(recompute=True)),
        ("tp2-cp2-sp-dropout", ParallelConfig(tp=2, cp=2), dict(sequence_parallel=True, hidden_dropout=0.1)),
        ("cp2-dp2-ddp", ParallelConfig(cp=2, dp=2), {}),
        ("cp2-dp2-fsdp", ParallelConfig(cp=2, dp=2), dict(dp_mode="fsdp", cp_mode="all2all")),
        ("cp4-ring", ParallelConfig(cp=4), {}),
        ("cp2-pp2-1f1b", ParallelConfig(cp=2, pp=2), dict(micro_batches=2, schedule="1f1b")),
        ("cp2-pp2-gpipe-all2all", ParallelConfig(cp=2, pp=2), dict(micro_batches=2, schedule="gpipe",
                                                                   cp_mode="all2all"))],
    8: [("tp2-cp2-pp2", ParallelConfig(tp=2, cp=2, pp=2), dict(micro_batches=2, schedule="1f1b"))],
}


# cp 2 in CI (~25 s on an idle 2-core machine: one 2-rank launch, two layouts); the 4-rank layouts are slow
@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
def test_cp_equals_one_process(reference, ranks):
    with WorkerPool(ranks, ParallelConfig(cp=ranks), collective_timeout_s=60.0) as pool:
        results = pool.run(job_layouts, LAYOUTS[ranks])
    for name, _, kw in LAYOUTS[ranks]:
        check(results, reference(kw), name)


def test_cp_refusals():
    from tensorpar.train.config import TrainConfig, check_against_model
    from tests._train_jobs import tiny_config

    with pytest.raises(ValueError, match=r"seq_len=20 is not divisible by 2 x cp = 8 .* use seq_len=16 or 24"):
        TrainConfig(cp=4, seq_len=20)
    with pytest.raises(ValueError, match=r"cp=2: does not run with expert parallelism \(ep=2\); cp runs with tp, "
                                         r"sequence_parallel, pp and dp \(ddp, fsdp\); use ep=1 or cp=1"):
        TrainConfig(cp=2, dp=2, ep=2)
    with pytest.raises(ValueError, match=r"cp=2: does not run with attention_dropout=0.1"):
        TrainConfig(cp=2, attention_dropout=0.1)
    with pytest.raises(ValueError, match=r"cp_mode='x': use one of ring, all2all"):
        TrainConfig(cp_mode="x")
    with pytest.raises(ValueError, match=r"seq_len=36 is not divisible by 2 x cp x tp = 8, which sequence "
                                         r"parallelism with cp=2 needs"):
        TrainConfig(cp=2, tp=2, seq_len=36, sequence_parallel=True)
    cfg = TrainConfig(cp=2, tp=2, seq_len=16, cp_mode="all2all")
    with pytest.raises(ValueError, match=r"cp_mode='all2all' needs the query heads of each tp rank \(3 at tp=2\) "
                                         r"divisible by cp=2; use cp_mode='ring'"):
        check_against_model(cfg, tiny_config(), 67)
    check_against_model(cfg.replace(cp_mode="ring"), tiny_config(), 67)
    from transformers import GPT2Config
    with pytest.raises(ValueError, match=r"cp=2: context parallelism supports llama, mistral, qwen2, qwen3, not "
                                         r"'gpt2'; use cp=1"):
        check_against_model(TrainConfig(cp=2, seq_len=16), GPT2Config(vocab_size=67, n_positions=64), 67)
    with pytest.raises(ValueError, match=r"cp=2: this mistral config has sliding_window=8"):
        from transformers import MistralConfig
        check_against_model(TrainConfig(cp=2, seq_len=16), MistralConfig(vocab_size=67, sliding_window=8), 67)


# ---------------------------------------------------------------- `tensorpar train --cp`

def run_main(argv):
    import argparse

    from tensorpar.train.cli import add_arguments, main
    p = argparse.ArgumentParser()
    add_arguments(p)
    return main(p.parse_args(argv))


@pytest.mark.parametrize("argv,msg", [
    (["--cp", "2", "--seq-len", "30"], "seq_len=30 is not divisible by 2 x cp = 4 (each cp rank holds two equal "
                                       "chunks, one early and one late); use seq_len=28 or 32"),
    (["--tp", "2", "--cp", "4", "--cp-mode", "all2all"],
     "--cp-mode all2all needs the query heads of each tp rank (2 at --tp 2) divisible by --cp 4; use --cp-mode ring"),
    (["--cp", "2", "--attention-dropout", "0.1"], "--cp 2: does not run with attention_dropout=0.1"),
    (["--cp", "2", "--plan", "auto", "--nproc", "2"], "--plan auto and --cp 2 both set the layout"),
])
def test_cli_refuses_before_launch(tmp_path, capsys, argv, msg):
    rc = run_main(argv + ["--model", "tiny", "--data", "shakespeare", "--out", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and msg in err[0], err


@pytest.mark.parametrize("argv,note", [
    (["--cp-mode", "all2all"], "tensorpar: warning: --cp-mode all2all has no effect at --cp 1 (it is how attention "
                               "crosses the cp ranks); ignored (use --cp 2 or more for context parallelism)"),
    (["--cp", "1", "--cp-mode", "ring"], "tensorpar: warning: --cp-mode ring has no effect at --cp 1"),
    (["--cp", "2", "--cp-mode", "all2all"], None),
    (["--cp", "1"], None),
])
def test_cp_mode_at_cp1_is_reported(argv, note):
    """--cp-mode without --cp > 1 changes nothing: one warning line (it was silently ignored), as --schedule at pp 1."""
    import argparse

    from tensorpar.train.cli import add_arguments, config_from_args, drop_no_ops
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(argv + ["--seq-len", "16"])
    _, notes = drop_no_ops(args, config_from_args(args))
    if note is None:
        assert notes == []
    else:
        assert len(notes) == 1 and notes[0].startswith(note), notes


@pytest.mark.slow
@pytest.mark.network
def test_cli_cp2_run_then_resume_at_tp2_and_cp2(tmp_path):
    """A launched `--cp 2` run on Shakespeare, resumed from its checkpoint at (tp 2), then at cp 2 again (all2all):
    the checkpoint holds no cp."""
    import os
    import subprocess
    import sys

    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    common = ["--model", "tiny", "--data", "shakespeare", "--seq-len", "32", "--batch-size", "4", "--out", str(out),
              "--no-progress"]
    r = subprocess.run([sys.executable, "-m", "tensorpar", "train", "--cp", "2", "--steps", "3"] + common,
                       capture_output=True, text=True, env=env, timeout=500)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "done: step 3" in r.stdout
    r = subprocess.run([sys.executable, "-m", "tensorpar", "train", "--tp", "2", "--resume", "--steps", "4"] + common,
                       capture_output=True, text=True, env=env, timeout=500)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "done: step 4" in r.stdout
    r = subprocess.run([sys.executable, "-m", "tensorpar", "train", "--cp", "2", "--cp-mode", "all2all", "--resume",
                        "--steps", "5"] + common, capture_output=True, text=True, env=env, timeout=500)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "done: step 5" in r.stdout


# ---------------------------------------------------------------- the setting: Shakespeare at 2048

# 4 query heads on 1 KV head: at tp 2 the KV head is on both ranks (1 does not divide by tp), and under all2all
# the single local KV head does not divide by cp either, so it is repeated to the query heads before the exchange
LONG_MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=2048)
LONG = replace(BASE, model="tiny-2048", data="shakespeare", seq_len=2048, batch_size=2, steps=10, warmup_steps=2,
               lr=3e-3, grad_clip=0.5)


def run_long(ctx, kw):
    from tensorpar.train.data import load_data
    from tensorpar.train.loop import Trainer
    from tensorpar.train.model import ModelSource, build_model
    from tests._train_jobs import tiny_config

    c = ctx.config
    cfg = replace(LONG, tp=c.tp, dp=c.dp, cp=c.cp, **kw)
    data = load_data("shakespeare", "bytes", val_fraction=cfg.val_fraction, progress=False)
    src = ModelSource(tiny_config(vocab_size=data.vocab_size, **LONG_MODEL), None, None)
    model, plan = build_model(cfg, src, ctx.tp, data.vocab_size, cp=ctx.cp)
    tr = Trainer(cfg, ctx, model, plan, data)
    steps = [tr.train_step() for _ in range(cfg.steps)]
    return [s.loss for s in steps], [s.grad_norm for s in steps]


def job_long(ctx, layouts):
    out = {}
    for name, config, kw in layouts:
        sub = init_parallel(config, rank=ctx.rank, world_size=ctx.world_size, backend="gloo", set_threads=False)
        out[name] = run_long(sub, kw)
    return out


LONG_LAYOUTS = {
    2: [("cp2-ring", ParallelConfig(cp=2), {}), ("cp2-all2all", ParallelConfig(cp=2), dict(cp_mode="all2all"))],
    4: [("tp2-cp2-ring", ParallelConfig(tp=2, cp=2), {}),
        ("tp2-cp2-all2all", ParallelConfig(tp=2, cp=2), dict(cp_mode="all2all")),
        ("cp2-dp2", ParallelConfig(cp=2, dp=2), {}), ("cp4-ring", ParallelConfig(cp=4), {})],
}


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.parametrize("ranks", [2, 4])
def test_shakespeare_2048_equals_one_process(ranks):
    """10 fp32 steps on Shakespeare at sequence 2048: per-step loss and grad norm within 1e-5 of one process."""
    losses, norms = run_long(ParallelContext.single(), {})
    with WorkerPool(ranks, ParallelConfig(cp=ranks), collective_timeout_s=120.0, job_timeout_s=1200.0) as pool:
        results = pool.run(job_long, LONG_LAYOUTS[ranks])
    for name, _, _ in LONG_LAYOUTS[ranks]:
        for r, res in enumerate(results):
            got = res[name]
            assert rel(got[0], losses) <= TOL, f"{name} rank {r}: losses {got[0]} vs {losses}"
            assert rel(got[1], norms) <= TOL, f"{name} rank {r}: grad norms {got[1]} vs {norms}"
