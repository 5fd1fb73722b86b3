"""``tensorpar train``: train or fine-tune a Llama-style decoder with tensor (and sequence) parallelism.

    tensorpar train --tp 2 --sequence-parallel --model small --data shakespeare --steps 500
    tensorpar train --tp 2 --model smollm2 --data shakespeare --lr 3e-4 --steps 200   # fine-tune
    tensorpar train --tp 4 --model small --resume runs/train                          # continue at another tp

Writes into ``--out``: ``metrics.jsonl`` (one line per step and per evaluation), ``loss.png`` (at the
end), ``checkpoints/step_NNNNNN/`` (every ``--save-every`` steps and at the end; tp-independent) and,
with ``--export DIR``, a Hugging Face model folder. Everything is checked before any rank starts.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tensorpar.train.config import PRESETS, TrainConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (local ranks started here; under "
                                                     "torchrun the world size is used)")
    p.add_argument("--sequence-parallel", action="store_true", help="split activations along the sequence "
                                                                     "between blocks (seq_len must divide by tp)")
    p.add_argument("--model", default=d.model, help=f"a preset ({', '.join(PRESETS)}), a config.json (from "
                                                     f"scratch), a model folder or smollm2 (fine-tuned)")
    p.add_argument("--init", choices=["auto", "scratch", "pretrained"], default=d.init,
                   help="auto: pretrained weights when --model has them")
    p.add_argument("--data", default=d.data, help="'shakespeare' or a UTF-8 .txt file")
    p.add_argument("--tokenizer", default=d.tokenizer, help="auto (the model's, else bytes), bytes, smollm2, "
                                                            "or a model folder")
    p.add_argument("--val-fraction", type=float, default=d.val_fraction)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step (all tp ranks "
                                                                        "share one batch)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip, help="global gradient-norm clip (0 = off)")
    p.add_argument("--label-smoothing", type=float, default=d.label_smoothing)
    p.add_argument("--attention-dropout", type=float, default=d.attention_dropout)
    p.add_argument("--hidden-dropout", type=float, default=d.hidden_dropout)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 weights and optimizer)")
    p.add_argument("--recompute", action="store_true", help="recompute each block's activations in backward")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default=d.out_dir, help="output folder (metrics, plot, checkpoints)")
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--eval-batches", type=int, default=d.eval_batches)
    p.add_argument("--save-every", type=int, default=d.save_every, help="checkpoint period (0 = only at the end)")
    p.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints)
    p.add_argument("--resume", nargs="?", const="auto", default=None,
                   help="continue from a checkpoint (folder, or a checkpoint root); bare --resume: <out>/checkpoints")
    p.add_argument("--export", default=None, help="also write the final model as a Hugging Face folder here")
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout in seconds")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` the flags describe (raises its ValueErrors)."""
    return TrainConfig(model=args.model, init=args.init, data=args.data, tokenizer=args.tokenizer,
                       val_fraction=args.val_fraction, tp=args.tp, sequence_parallel=args.sequence_parallel,
                       seq_len=args.seq_len, batch_size=args.batch_size, steps=args.steps, lr=args.lr,
                       min_lr_ratio=args.min_lr_ratio, warmup_steps=args.warmup_steps,
                       weight_decay=args.weight_decay, grad_clip=args.grad_clip,
                       label_smoothing=args.label_smoothing, attention_dropout=args.attention_dropout,
                       hidden_dropout=args.hidden_dropout, dtype="bfloat16" if args.bf16 else "float32",
                       recompute=args.recompute, seed=args.seed, out_dir=args.out, eval_every=args.eval_every,
                       eval_batches=args.eval_batches, save_every=args.save_every,
                       keep_checkpoints=args.keep_checkpoints)


def prepare(cfg: TrainConfig, *, progress: bool = True):
    """Resolve model and data, and run every check that needs them. Returns ``(source, data)``.

    Raises ValueError / FileNotFoundError naming the setting (plan, context length, vocabulary, data).
    """
    from tensorpar.hf.plan import make_plan
    from tensorpar.train.config import check_against_model
    from tensorpar.train.data import load_data, tokenizer_spec
    from tensorpar.train.model import resolve_source

    folder_source = None if cfg.model in PRESETS or cfg.model.endswith(".json") else resolve_source(cfg)
    tok = tokenizer_spec(cfg.tokenizer, folder_source.folder if folder_source else None)
    data = load_data(cfg.data, tok, val_fraction=cfg.val_fraction, progress=progress)
    source = folder_source or resolve_source(cfg, data.vocab_size)
    check_against_model(cfg, source.config, data.vocab_size)
    make_plan(source.config, cfg.tp, sequence_parallel=cfg.sequence_parallel)
    data.val_batches(batch_size=cfg.batch_size, seq_len=cfg.seq_len)  # at least one validation batch
    return source, data


def run(cfg: TrainConfig, ctx, *, resume: str | None = None, export: str | None = None, progress: bool = True,
        prepared=None) -> dict:
    """Train on the ranks of ``ctx.tp`` until ``cfg.steps``; every rank calls it. Returns a summary dict."""
    from tqdm.auto import tqdm

    from tensorpar.train.loop import Trainer
    from tensorpar.train.metrics import MetricsLog, plot_losses
    from tensorpar.train.model import build_model

    source, data = prepared or prepare(cfg, progress=progress and ctx.rank == 0)
    model, plan = build_model(cfg, source, ctx.tp, data.vocab_size, device=ctx.device)
    trainer = Trainer(cfg, ctx.tp, model, plan, data)
    out = Path(cfg.out_dir)
    ckroot = out / "checkpoints"
    main = ctx.rank == 0
    if resume is not None:
        trainer.resume(ckroot if resume == "auto" else resume)
    metrics = MetricsLog(out / "metrics.jsonl", active=main)
    metrics.start(trainer.step if resume is not None else None)
    bar = tqdm(total=cfg.steps, initial=trainer.step, disable=not (main and progress), unit="step",
               desc=f"train tp={ctx.tp.size}{' sp' if cfg.sequence_parallel else ''}")
    last = val = None
    while trainer.step < cfg.steps:
        r = trainer.train_step()
        last = r
        if r.step % cfg.log_every == 0 or r.step == cfg.steps:
            metrics.write({"kind": "train", "step": r.step, "loss": r.loss, "grad_norm": r.grad_norm, "lr": r.lr,
                           "tokens": r.tokens, "tokens_per_s": r.tokens_per_s, "step_time_s": r.time_s})
        bar.set_postfix(loss=f"{r.loss:.4f}", tok_s=f"{r.tokens_per_s:,.0f}")
        bar.update()
        if (cfg.eval_every and r.step % cfg.eval_every == 0) or r.step == cfg.steps:
            val = trainer.evaluate()
            metrics.write({"kind": "val", "step": r.step, "val_loss": val})
            if main and progress:
                bar.write(f"step {r.step}: val loss {val:.4f}")
        if cfg.save_every and r.step % cfg.save_every == 0 and r.step != cfg.steps:
            trainer.save(ckroot)
    bar.close()
    ckpt = trainer.save(ckroot)
    summary = {"step": trainer.step, "checkpoint": str(ckpt), "loss": last.loss if last else None,
               "val_loss": val, "metrics": str(out / "metrics.jsonl")}
    if main:
        summary["plot"] = str(plot_losses(out / "metrics.jsonl", out / "loss.png",
                                          title=f"{cfg.model} on {cfg.data}, tp={ctx.tp.size}"))
        if export:
            from tensorpar.train.export import export_hf
            summary["export"] = str(export_hf(ckpt, export, overwrite=True))
    return summary


def _rank_main(cfg: TrainConfig, resume, export, progress, timeout) -> int:
    from tensorpar.launch import rank0_print
    from tensorpar.parallel import ParallelConfig, ParallelContext, init_parallel, set_rank_threads

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:  # one process: no process group (and no port) needed
        set_rank_threads(1)
        ctx = ParallelContext.single()
    else:
        ctx = init_parallel(ParallelConfig(tp=world), timeout_s=timeout)
    try:
        s = run(cfg, ctx, resume=resume, export=export, progress=progress)
        rank0_print(f"done: step {s['step']}, train loss {s['loss']}, val loss {s['val_loss']:.4f}; "
                    f"checkpoint {s['checkpoint']}" + (f"; exported {s['export']}" if "export" in s else ""))
    finally:
        ctx.destroy()
    return 0


def main(args: argparse.Namespace) -> int:
    from tensorpar.launch import run_ranks, under_torchrun

    if under_torchrun():
        args.tp = int(os.environ["WORLD_SIZE"])
    try:
        cfg = config_from_args(args)
        prepare(cfg, progress=not args.no_progress)  # fills the caches once; the ranks then read them
        if args.resume is not None:
            from tensorpar.train.checkpoint import latest_checkpoint
            latest_checkpoint(Path(cfg.out_dir) / "checkpoints" if args.resume == "auto" else args.resume)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"tensorpar train: error: {e}", file=sys.stderr)
        return 2
    return run_ranks(_rank_main, cfg.tp, cfg, args.resume, args.export, not args.no_progress, args.timeout)
