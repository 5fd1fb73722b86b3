"""Job functions for the training tests (top level, so that worker ranks can unpickle them)."""
from __future__ import annotations

import torch

from tensorpar import comm
from tensorpar.train.checkpoint import full_tensor
from tensorpar.train.config import TrainConfig
from tensorpar.train.data import TrainData
from tensorpar.train.loop import Trainer
from tensorpar.train.model import ModelSource, build_model

VOCAB = 67  # divisible by neither 2 nor 4: vocabulary shards of [34, 33] and [17, 17, 17, 16]


def tiny_config(**kw):
    """6 query / 2 KV heads: at tp=4 the heads split 2/2/1/1 and both KV heads straddle ranks."""
    from transformers import LlamaConfig
    base = dict(vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=6,
                num_key_value_heads=2, head_dim=4, max_position_embeddings=64, tie_word_embeddings=True,
                rms_norm_eps=1e-5)
    base.update(kw)
    return LlamaConfig(**base)


def synthetic_data(n: int = 6000, vocab: int = VOCAB) -> TrainData:
    """A learnable stream: a repeated pseudo-random 'sentence' with 10% random substitutions (fixed seed)."""
    g = torch.Generator().manual_seed(1234)
    base = torch.randint(0, vocab, (97,), generator=g)
    stream = base.repeat(n // 97 + 1)[:n].clone()
    noise = torch.rand(n, generator=g) < 0.1
    stream[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=g)
    return TrainData.from_tokens(stream, vocab, val_fraction=0.1, source="synthetic")


# Equality setup of the issue: fp32, dropout off, 20 steps. A small clip so that clipping is active
# (grad norms start near 1): a clip that counted replicated parameters tp times would change the losses.
BASE = TrainConfig(model="tiny-test", seq_len=16, batch_size=4, steps=20, warmup_steps=2, lr=1e-2, grad_clip=0.5,
                   eval_batches=2, keep_checkpoints=3)


def make_trainer(ctx, cfg: TrainConfig, model_kw: dict | None = None, device=None) -> Trainer:
    """The tiny model's trainer, the model built on ``device`` (default ``ctx.device``)."""
    src = ModelSource(tiny_config(attention_dropout=cfg.attention_dropout, **(model_kw or {})), None, None)
    data = synthetic_data()
    model, plan = build_model(cfg, src, ctx.tp, data.vocab_size, cp=ctx.cp, device=device or ctx.device)
    return Trainer(cfg, ctx, model, plan, data)


def gathered_grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every gradient at full shape (owner rows for duplicated KV heads)."""
    return {n: full_tensor(p.grad, p, trainer.tp).clone() for n, p in trainer.named_params}


def probe_logits(trainer: Trainer) -> torch.Tensor:
    """Full logits ``[2, 16, V]`` of the model on a fixed input, in eval mode."""
    ids = torch.arange(32).view(2, 16) % VOCAB
    trainer.model.eval()
    with torch.no_grad():
        local = trainer.model(input_ids=ids, use_cache=False).logits
    trainer.model.train()
    return comm.all_gather(local, trainer.tp, -1, trainer.plan.vocab)


def train_run(ctx, cfg: TrainConfig, *, grad_steps=(), save_at=None, save_root=None, resume=None,
              rank0_rng_draws: bool = False, logits: bool = False) -> dict:
    """Train to ``cfg.steps`` (from ``resume`` if given); record losses, norms, chosen gradients.

    ``rank0_rng_draws``: rank 0 draws from the global RNG before every step, as a data loader working on
    one rank might; dropout must not notice.
    """
    tr = make_trainer(ctx, cfg)
    if resume is not None:
        tr.resume(resume)
    out = {"loss": [], "norm": [], "grads": {}, "sp_norm_grads": {}, "first_step": tr.step + 1}

    def capture(t):
        g = gathered_grads(t)  # collective: every rank gathers, rank 0 keeps the copy
        if ctx.tp.rank == 0:
            out["grads"][t.step + 1] = g
        out["sp_norm_grads"][t.step + 1] = {n: p.grad.clone() for n, p in t.named_params
                                            if getattr(p, "sequence_parallel", False)}

    while tr.step < cfg.steps:
        if rank0_rng_draws and ctx.tp.rank == 0:
            torch.rand(1000)
        r = tr.train_step(inspect=capture if tr.step + 1 in grad_steps else None)
        out["loss"].append(r.loss)
        out["norm"].append(r.grad_norm)
        if save_at is not None and r.step == save_at:
            out["checkpoint"] = str(tr.save(save_root))
    if logits:
        out["logits"] = probe_logits(tr)
        out["final_checkpoint"] = str(tr.save(save_root))
    out["tied_one_parameter"] = tr.model.lm_head.weight is tr.model.model.embed_tokens.weight
    out["optimizer_params"] = sum(len(g["params"]) for g in tr.optimizer.param_groups)
    out["devices"] = sorted({str(p.device) for p in tr.model.parameters()})
    out["unique_params"] = len({id(p) for p in tr.model.parameters()})
    return out


def job_runs(ctx, specs: list[tuple[str, TrainConfig, dict]]) -> dict:
    """Several :func:`train_run` s in one launch (starting ranks costs seconds): ``{name: result}``."""
    return {name: train_run(ctx, cfg.replace(tp=ctx.tp.size), **kw) for name, cfg, kw in specs}
