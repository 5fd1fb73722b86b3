"""Data parallelism with FSDP2 (``dp_mode="fsdp"``: ``fully_shard`` on the dp axis) equals the single-process run
and the DDP run: per-step fp32 loss and grad norm over the harness of tests/train/test_3d.py (small Llama, 5 query heads
and 1 KV head, so at tp 2 the KV head is duplicated; tied embedding; clipping active), for (tp2, dp2), (dp2),
(tp2, dp2) with sequence parallelism and (pp2, dp2). Tolerance: test_3d's 1e-5 relative.

All grid checks run in one 4-rank launch (tp 2 x dp 2): the (dp 2) and (pp 2, dp 2) layouts reuse its groups
(:func:`as_layout`): the tp pairs become independent dp-only runs, or pipelines over the tp pairs' ranks.
"""
from dataclasses import replace

import pytest
import torch

from tensorpar.comm import Group
from tensorpar.parallel import ParallelConfig, ParallelContext
from tensorpar.testing import WorkerPool
from tests._train_jobs import BASE, synthetic_data, tiny_config
from tests.train.test_3d import MODEL, STEPS, job_save_resume

GRID = ParallelConfig(tp=2, dp=2)


def as_layout(ctx, layout: str):
    """A context for ``layout`` on the ranks of the (tp 2, dp 2) ``ctx``: "tp2-dp2" is ``ctx``; "dp2": tp = 1, so
    the two tp columns run as two independent dp-2 jobs; "pp2-dp2": the tp pairs are pipelines. The dp groups (and
    the mesh's dp axis) are ``ctx``'s in every case. "one": ``ctx`` is the one-process context, kept."""
    if layout == "one":
        return ctx
    mesh = ctx.mesh  # every rank builds it (collective group creation) before any trainer asks for it
    if layout == "tp2-dp2":
        return ctx
    if layout == "dp2":
        return replace(ctx, config=ParallelConfig(dp=2), tp=Group.single("tp"),
                       grid=ctx.grid[..., ctx.tp.rank:ctx.tp.rank + 1], _mesh=mesh)
    assert layout == "pp2-dp2"
    pp = Group(pg=ctx.tp.pg, rank=ctx.tp.rank, size=ctx.tp.size, name="pp")
    return replace(ctx, config=ParallelConfig(pp=2, dp=2), tp=Group.single("tp"), pp=pp,
                   grid=ctx.grid.transpose(1, 3).contiguous(), _mesh=mesh)   # [dp, pp, cp, tp]: tp <-> pp


def job_fsdp(ctx, layout, cfg_kw):
    """Train STEPS steps; return losses, grad norms, AdamW state bytes on this rank, (pp) whether the tied
    embedding is identical on the first and last stage, and the validation loss after training."""
    import torch.distributed as dist

    from tensorpar.grads import local_tensor
    from tensorpar.train.loop import Trainer
    from tensorpar.train.model import ModelSource, build_model
    ctx = as_layout(ctx, layout)
    c = ctx.config
    cfg = replace(BASE, tp=c.tp, pp=c.pp, dp=c.dp, steps=STEPS, **cfg_kw)
    data = synthetic_data()
    model, plan = build_model(cfg, ModelSource(tiny_config(**MODEL), None, None), ctx.tp, data.vocab_size)
    tr = Trainer(cfg, ctx, model, plan, data)
    out = [tr.train_step() for _ in range(STEPS)]
    tied_same = None
    if tr.embed_group is not None:
        p = local_tensor(tr._tied_param().detach()).clone()
        other = p.clone()
        dist.all_reduce(other, group=tr.embed_group)
        tied_same = torch.equal(other, 2 * p)
    return dict(loss=[r.loss for r in out], norm=[r.grad_norm for r in out], state_bytes=tr.optimizer_state_bytes(),
                tied_same=tied_same, dtensor=type(tr.params[0]).__name__, val=tr.evaluate(2))


@pytest.fixture(scope="module")
def reference():
    from tests.train.test_3d import job_3d
    return job_3d(ParallelContext.single(), {})


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(GRID.world_size, GRID, collective_timeout_s=60.0)
    yield p
    p.close()


CASES = [
    ("tp2-dp2", dict(micro_batches=2)),                       # gradient accumulation: one reduce-scatter per step
    ("dp2", dict()),
    ("tp2-dp2", dict(sequence_parallel=True)),
    ("pp2-dp2", dict(micro_batches=2, schedule="1f1b")),      # FSDP on each stage's module, tied embedding
]


@pytest.mark.parametrize("layout,kw", CASES, ids=[f"{a}-{'-'.join(map(str, b.values())) or 'plain'}"
                                                   for a, b in CASES])
def test_fsdp_equals_single_process_and_ddp(pool, reference, layout, kw):
    ref_loss, ref_norm, _ = reference
    ddp = pool.run(job_fsdp, layout, dict(kw, dp_mode="ddp"))
    fsdp = pool.run(job_fsdp, layout, dict(kw, dp_mode="fsdp"))
    for r, (d, f) in enumerate(zip(ddp, fsdp)):
        assert f["dtensor"] == "DTensor" and d["dtensor"] == "Parameter", f"rank {r}: FSDP did not shard"
        for other, what in ((ref_loss, "single process"), (d["loss"], "DDP")):
            assert f["loss"] == pytest.approx(other, rel=1e-5), f"rank {r}: losses {f['loss']} vs {what} {other}"
        for other, what in ((ref_norm, "single process"), (d["norm"], "DDP")):
            assert f["norm"] == pytest.approx(other, rel=1e-5), f"rank {r}: grad norms {f['norm']} vs {what} {other}"
        assert f["val"] == pytest.approx(d["val"], rel=1e-5), f"rank {r}: validation loss {f['val']} vs {d['val']}"
        if f["tied_same"] is not None:
            assert f["tied_same"], f"rank {r}: tied embedding differs between first and last stage"
    # the distributed optimizer: the dp replicas of one tp/pp position hold disjoint parts of DDP's AdamW state
    # (ranks r and r + 2 are the two dp replicas of one position on the tp2 x dp2 grid)
    for r in range(2):
        assert fsdp[r]["state_bytes"] + fsdp[r + 2]["state_bytes"] == ddp[r]["state_bytes"] > 0, f"rank {r}"


def job_clip(ctx):
    """One fsdp step at (tp 2, dp 2); on its complete DTensor gradients, grads.clip_grad_norm_ returns the trainer's
    global norm and leaves grad_norm at the limit; grad_norm without the dp group refuses DTensor gradients."""
    from tensorpar import grads
    from tensorpar.train.loop import Trainer
    from tensorpar.train.model import ModelSource, build_model
    cfg = replace(BASE, tp=2, dp=2, steps=STEPS, dp_mode="fsdp", grad_clip=0.0)
    data = synthetic_data()
    model, plan = build_model(cfg, ModelSource(tiny_config(**MODEL), None, None), ctx.tp, data.vocab_size)
    tr = Trainer(cfg, ctx, model, plan, data)
    seen = {}

    def inspect(t):
        seen["trainer"] = float(t.global_grad_norm())
        seen["clip"] = float(grads.clip_grad_norm_(t.params, 0.25, t.ctx.tp, t.ctx.dp))
        seen["after"] = float(grads.grad_norm(t.params, t.ctx.tp, t.ctx.dp))
        try:
            grads.grad_norm(t.params, t.ctx.tp)
        except ValueError as e:
            seen["error"] = str(e)
    tr.train_step(inspect=inspect)
    return seen


def test_clip_grad_norm_on_fsdp_gradients(pool):
    for r, s in enumerate(pool.run(job_clip)):
        assert s["clip"] == pytest.approx(s["trainer"], rel=1e-6) and s["trainer"] > 0.25, f"rank {r}: {s}"
        assert s["after"] == pytest.approx(0.25, rel=1e-5), f"rank {r}: {s}"
        assert "pass the dp group" in s.get("error", ""), f"rank {r}: {s}"


def test_fsdp_at_dp1_changes_nothing(reference):
    """--dp-mode fsdp at dp = 1 is accepted and is a no-op: plain parameters, the reference losses."""
    res = job_fsdp(ParallelContext.single(), "one", dict(micro_batches=2, dp_mode="fsdp"))
    assert res["dtensor"] == "Parameter"
    assert res["loss"] == pytest.approx(reference[0], rel=1e-5) and res["norm"] == pytest.approx(reference[1], rel=1e-5)


def test_fsdp_checkpoint_resumes_on_one_process(pool, reference, tmp_path):
    """A (tp2, dp2, fsdp) run saved after 2 steps continues at tp = 1 on one process with the reference losses;
    and a single-process checkpoint resumes under fsdp (parameters and AdamW state re-sharded over dp)."""
    kw = dict(micro_batches=2, dp_mode="fsdp")
    pool.run(job_save_resume, kw, str(tmp_path / "fsdp"), 2)
    rest = job_save_resume(ParallelContext.single(), {}, str(tmp_path / "fsdp"), 0)
    assert rest == pytest.approx(reference[0][2:], rel=1e-5)
    job_save_resume(ParallelContext.single(), {}, str(tmp_path / "single"), 2)
    again = pool.run(job_save_resume, kw, str(tmp_path / "single"), 0)
    for r, losses in enumerate(again):
        assert losses == pytest.approx(reference[0][2:], rel=1e-5), f"rank {r}"


def test_dp_mode_is_checked():
    import argparse

    from tensorpar.train.cli import add_arguments, config_from_args
    with pytest.raises(ValueError, match=r"dp_mode='zero': use one of ddp, fsdp"):
        replace(BASE, dp_mode="zero")
    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--dp-mode", "zero"])
    assert config_from_args(p.parse_args(["--dp", "2", "--dp-mode", "fsdp"])).dp_mode == "fsdp"
    assert config_from_args(p.parse_args([])).dp_mode == "ddp"


def test_plan_names_fsdp_for_the_distributed_optimizer(capsys):
    """``tensorpar plan``'s dist-opt column is run by ``--dp-mode fsdp``; the table says so when it shows one."""
    from tensorpar import cli
    from tests.planner.test_planner_cli import GPT3
    assert cli.main(["plan", *GPT3, "--top", "3"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "distopt=on" in out and "dist-opt on = `tensorpar train --dp-mode fsdp`" in out
