"""Settings of the one trainer hold at every layout (issue 27 item 1, issue 22 item 2): bf16 autocast and the skip of
a batch without any target token at (dp 2), (pp 2), (tp 2, pp 2) and (tp 2, dp 2) under FSDP; and a pipeline rank
that reads and materialises only its stage of a pretrained model (issue 22 item 2).

Setup: the small Llama of tests/train/test_3d.py (5 query heads, 1 KV head, tied embedding), clipping active, 4 steps.
The 2-rank layouts share one launch, the 4-rank ones another (each layout builds its own groups on the ranks).

Tolerances (measured on this setup, per-step maximum over 4 steps, relative):
- bf16 at a layout against bf16 at tp = 1: 5e-3, about one bf16 unit in the last place (2^-8 = 3.9e-3). Autocast
  rounds every matmul input to bf16; splitting a matmul over tp ranks, a batch over micro-batches or replicas, or a
  model over stages changes which partial sums are rounded, so the runs drift apart by bf16 rounding compounded over
  the steps: measured 1.8e-4 (dp2), 2.4e-4 (pp2), 1.8e-3 (tp2 pp2), 1.8e-3 (tp2 dp2 fsdp). With a tp split this is
  as large as bf16's own effect, so "closer to bf16 at tp 1 than to fp32" cannot be asserted; the next check proves
  that autocast ran.
- bf16 against fp32 at the same layout: more than 1e-4 at some step. A run that ignores --bf16 gives the fp32 losses
  bit for bit (0.0, the fault of issue 27); with autocast: 1.7e-3 (dp2, pp2), 9.1e-4 (tp2 pp2), 9.6e-4 (tp2 dp2
  fsdp), 1.5e-3 at tp 1. fp32 at each layout is within 1.2e-7 of fp32 at tp 1 (bound 1e-5, tests/train/test_3d.py's).
"""
from dataclasses import replace

import pytest
import torch

from tensorpar.parallel import ParallelConfig, ParallelContext
from tensorpar.testing import WorkerPool
from tests._train_jobs import BASE, synthetic_data, tiny_config
from tests.train.test_3d import MODEL

STEPS = 4
LAYOUTS = {
    2: [("dp2", ParallelConfig(dp=2), {}),
        ("pp2", ParallelConfig(pp=2), dict(micro_batches=2, schedule="1f1b"))],
    4: [("tp2-pp2", ParallelConfig(tp=2, pp=2), dict(micro_batches=2, schedule="1f1b")),
        ("tp2-dp2-fsdp", ParallelConfig(tp=2, dp=2), dict(dp_mode="fsdp"))],
}


def make(ctx, kw):
    from tensorpar.train.loop import Trainer
    from tensorpar.train.model import ModelSource, build_model
    c = ctx.config
    cfg = replace(BASE, tp=c.tp, pp=c.pp, dp=c.dp, steps=STEPS, **kw)
    data = synthetic_data()
    model, plan = build_model(cfg, ModelSource(tiny_config(**MODEL), None, None), ctx.tp, data.vocab_size)
    return Trainer(cfg, ctx, model, plan, data)


def losses(ctx, kw):
    tr = make(ctx, kw)
    return [tr.train_step().loss for _ in range(STEPS)]


def skip_then_step(ctx, kw):
    """A first batch whose labels are all ignore_index, then a real one: (skipped, step, weights unchanged by the
    empty batch, the next loss is finite)."""
    tr = make(ctx, kw)
    x, y = next(tr.batches)
    tr.batches = iter([(x, torch.full_like(y, -100)), (x, y)])
    before = [p.detach().clone() for p in tr.params]
    r = tr.train_step()
    same = all(torch.equal(b, p.detach()) for b, p in zip(before, tr.params))
    return bool(getattr(r, "skipped", False)), r.step, same, bool(torch.isfinite(torch.tensor(tr.train_step().loss)))


def masked(ctx, kw):
    """(loss, grad norm) per step of batches whose first half of rows has no target at all (a dp replica or a
    micro-batch without targets) and whose other rows lose a random 30 % of their targets: the loss is the global
    batch's mean over its target tokens, as one device computes it."""
    tr = make(ctx, kw)
    g = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(STEPS):
        x, y = next(tr.batches)
        y = y.clone()
        y[: y.shape[0] // 2] = -100
        y[torch.rand(y.shape, generator=g) < 0.3] = -100
        batches.append((x, y))
    tr.batches = iter(batches)
    return [(r.loss, r.grad_norm) for r in (tr.train_step() for _ in range(STEPS))]


def job_layouts(ctx, layouts):
    from tensorpar.parallel import init_parallel
    out = {}
    for name, config, kw in layouts:
        sub = init_parallel(config, rank=ctx.rank, world_size=ctx.world_size, backend="gloo", set_threads=False)
        out[name] = {"fp32": losses(sub, kw), "bf16": losses(sub, dict(kw, dtype="bfloat16")),
                     "skip": skip_then_step(sub, kw), "masked": masked(sub, kw)}
    return out


@pytest.fixture(scope="module")
def reference():
    one = ParallelContext.single()
    return {"fp32": losses(one, {}), "bf16": losses(one, dict(dtype="bfloat16")), "masked": masked(one, {})}


def rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def pools():
    made = {}

    def get(ranks):
        if ranks not in made:
            made[ranks] = WorkerPool(ranks, collective_timeout_s=60.0)
        return made[ranks]
    yield get
    for p in made.values():
        p.close()


# the 2-rank layouts in CI (~20 s on an idle 2-core machine), the 4-rank ones marked slow
@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_bf16_and_empty_batch_skip_at_every_layout(pools, reference, ranks):
    results = pools(ranks).run(job_layouts, LAYOUTS[ranks])
    assert rel(reference["bf16"], reference["fp32"]) > 1e-4          # autocast changes this setup's losses at tp 1
    for name, _, _ in LAYOUTS[ranks]:
        for r, res in enumerate(results):
            got = res[name]
            assert rel(got["fp32"], reference["fp32"]) <= 1e-5, f"{name} rank {r}: fp32 {got['fp32']}"
            assert rel(got["bf16"], got["fp32"]) > 1e-4, \
                f"{name} rank {r}: bf16 losses {got['bf16']} are the fp32 ones {got['fp32']}: autocast did not run"
            assert rel(got["bf16"], reference["bf16"]) <= 5e-3, \
                f"{name} rank {r}: bf16 {got['bf16']} vs bf16 at tp 1 {reference['bf16']}"
            assert got["skip"] == (True, 1, True, True), f"{name} rank {r}: (skipped, step, unchanged, next finite) " \
                                                        f"= {got['skip']}"
            # a replica / micro-batch without targets: the mean of per-micro-batch means was NaN there (0 / 0) and
            # weighted micro-batches equally; the per-token mean equals one device (fp32 bound as above)
            want = reference["masked"]
            assert rel([v for pair in got["masked"] for v in pair], [v for pair in want for v in pair]) <= 1e-5, \
                f"{name} rank {r}: masked (loss, grad norm) {got['masked']} vs tp 1 {want}"


# ---------------------------------------------------------------- a pipeline rank builds only its stage

@pytest.fixture(scope="module")
def pretrained_folder(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(tiny_config(**MODEL))       # tied embedding, 4 layers
    path = tmp_path_factory.mktemp("pretrained") / "model"
    model.save_pretrained(path)
    return str(path)


def job_pretrained_stage(ctx, folder):
    """pp 2 on fresh groups (or the one-process context): the parameter names this rank materialised (none may be
    left on meta) and 3 steps' losses."""
    from tensorpar.parallel import init_parallel
    from tensorpar.train.loop import Trainer
    from tensorpar.train.model import build_model, resolve_source
    if ctx.world_size > 1:
        ctx = init_parallel(ParallelConfig(pp=2), rank=ctx.rank, world_size=2, backend="gloo", set_threads=False)
    c = ctx.config
    cfg = replace(BASE, model=folder, init="pretrained", pp=c.pp, micro_batches=2, schedule="1f1b", steps=3)
    data = synthetic_data()
    model, plan = build_model(cfg, resolve_source(cfg, progress=False), ctx.tp, data.vocab_size,
                              pp_rank=ctx.pp.rank)
    held = sorted(n for n, p in model.named_parameters() if not p.is_meta)
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    tr = Trainer(cfg, ctx, model, plan, data)
    return held, meta, [tr.train_step().loss for _ in range(3)]


def test_pipeline_rank_reads_only_its_stage(pools, pretrained_folder):
    # 4 layers at pp 2: rank 0 holds layers 0-1 and the embedding, rank 1 layers 2-3, the final norm and the LM head
    # (tied: the embedding's tensor). Losses equal the one-process fine-tune within test_3d's 1e-5 relative.
    _, _, ref = job_pretrained_stage(ParallelContext.single(), pretrained_folder)
    out = pools(2).run(job_pretrained_stage, pretrained_folder)
    layers = [{n.split(".")[2] for n in held if n.startswith("model.layers.")} for held, _, _ in out]
    assert layers == [{"0", "1"}, {"2", "3"}], layers
    assert "model.embed_tokens.weight" in out[0][0] and "model.norm.weight" not in out[0][0]
    assert "model.norm.weight" in out[1][0]
    for r, (_, meta, loss) in enumerate(out):
        assert meta == [], f"rank {r}: left on meta {meta}"
        assert loss == pytest.approx(ref, rel=1e-5), f"rank {r}: {loss} vs {ref}"


def job_scratch_stage(ctx, tie):
    """pp 2 from scratch on fresh groups (or the one-process context): this rank's materialised parameters right
    after build_model (name -> value, once per tensor), the names left on meta, and 3 steps' losses."""
    from tensorpar.parallel import init_parallel
    from tensorpar.train.loop import Trainer
    from tensorpar.train.model import ModelSource, build_model
    if ctx.world_size > 1:
        ctx = init_parallel(ParallelConfig(pp=2), rank=ctx.rank, world_size=2, backend="gloo", set_threads=False)
    c = ctx.config
    cfg = replace(BASE, pp=c.pp, micro_batches=2, schedule="1f1b", steps=3)
    data = synthetic_data()
    src = ModelSource(tiny_config(**dict(MODEL, tie_word_embeddings=tie)), None, None)
    model, plan = build_model(cfg, src, ctx.tp, data.vocab_size, pp_rank=ctx.pp.rank)
    held = {n: p.detach().clone() for n, p in model.named_parameters() if not p.is_meta}
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    tr = Trainer(cfg, ctx, model, plan, data)
    return held, meta, [tr.train_step().loss for _ in range(3)]


@pytest.mark.parametrize("tie", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_pipeline_rank_initialises_only_its_stage(pools, tie):
    # From scratch (no checkpoint), a pp rank cuts its stage on the meta device and materialises only that: right
    # after build_model its parameter bytes are its stage's share of the pp = 1 model's (4 layers at pp 2: rank 0
    # layers 0-1 and the embedding, rank 1 layers 2-3, the final norm and the LM head, which is the embedding's
    # tensor when tied), with the pp = 1 model's values bit for bit (every module drawn from the seed and its own
    # name), and the losses equal the one-process run's within test_3d's 1e-5 relative (only the order of the
    # micro-batch gradient sums differs). The old build materialised the whole model on every rank.
    one, _, ref = job_scratch_stage(ParallelContext.single(), tie)
    out = pools(2).run(job_scratch_stage, tie)
    def stage(r, n):   # the pp = 1 model's parameter n is on pipeline rank r
        if n.startswith("model.layers."):
            return int(n.split(".")[2]) // 2 == r
        return {0: n == "model.embed_tokens.weight",
                1: n in ("model.norm.weight", "lm_head.weight") or (tie and n == "model.embed_tokens.weight")}[r]

    for r, (held, meta, loss) in enumerate(out):
        assert meta == [], f"rank {r}: left on meta {meta}"
        assert sorted(held) == sorted(n for n in one if stage(r, n)), f"rank {r}: holds {sorted(held)}"
        share = sum(t.numel() * t.element_size() for n, t in one.items() if stage(r, n))
        assert sum(t.numel() * t.element_size() for t in held.values()) == share, f"rank {r}"
        for n, t in held.items():
            assert torch.equal(t, one[n]), f"rank {r}: {n} differs from the pp = 1 model's"
        assert loss == pytest.approx(ref, rel=1e-5), f"rank {r}: {loss} vs {ref}"


# ---------------------------------------------------------------- evaluation leaves training unchanged

def job_eval_between_steps(ctx):
    """pp 2 with dropout: 3 steps' losses, with a validation loss after steps 1 and 2, and without."""
    from tensorpar.parallel import init_parallel
    sub = init_parallel(ParallelConfig(pp=2), rank=ctx.rank, world_size=2, backend="gloo", set_threads=False)
    kw = dict(micro_batches=2, schedule="1f1b", attention_dropout=0.2, hidden_dropout=0.2)
    out = {}
    for evals in (False, True):
        tr = make(sub, kw)
        losses, vals = [], []
        for _ in range(3):
            losses.append(tr.train_step().loss)
            if evals:
                vals.append(tr.evaluate(1))
        out[evals] = losses, vals
    return out


def test_validation_between_steps_changes_no_training_loss(pools):
    # the validation loss runs the pipeline schedule's forward; the training steps after it draw the same dropout
    # masks as without it, so the losses are equal bit for bit (same operations in the same order)
    for r, res in enumerate(pools(2).run(job_eval_between_steps)):
        assert res[True][0] == res[False][0], f"rank {r}: with evaluation {res[True][0]}, without {res[False][0]}"
        assert all(v == v for v in res[True][1]), res[True][1]       # finite validation losses (not NaN)
