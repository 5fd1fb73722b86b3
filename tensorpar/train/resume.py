"""``tensorpar train --resume`` in the launching process, before any rank starts: the checkpoint is consistent and
of this model (:func:`check_resume`, :func:`check_resume_model`), its data position is its step
(:func:`check_resume_data`), and after a torchrun restart the run continues from its last checkpoint
(:func:`resume_after_restart`). Each problem is one line naming the checkpoint and what would work.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tensorpar.train.config import TrainConfig


def resume_after_restart(args: argparse.Namespace) -> bool:
    """torchrun restarted the group after a rank died (``--max-restarts``, no ``--resume`` given): continue from the
    run's last checkpoint (``args.resume`` becomes ``"auto"`` when there is one, or when it is damaged, so that
    :func:`check_resume` reports it in one line). Returns True when the run is already complete: a rank died after
    the final checkpoint (e.g. while exiting) and there is no ``--export`` to write, so nothing is left to redo.
    Prints what it does (rank 0)."""
    from tensorpar.launch import rank0_print
    from tensorpar.train.checkpoint import CheckpointError, latest_checkpoint, read_state

    note = f"tensorpar: torchrun restart {os.environ['TORCHELASTIC_RESTART_COUNT']}: "
    try:
        last = latest_checkpoint(Path(args.out) / "checkpoints", missing_ok=True)
    except CheckpointError:  # damaged: --resume below reports it in one line
        last, args.resume = None, "auto"
    try:
        done = last is not None and args.export is None and read_state(last)["step"] >= args.steps
    except (OSError, ValueError, KeyError, CheckpointError):  # damaged: --resume below reports it in one line
        done = False
    if done:
        # a rank died after the final checkpoint (e.g. while exiting): the run is complete, nothing to redo
        rank0_print(note + f"the run is complete ({last} is at --steps {args.steps}); nothing to do",
                    file=sys.stderr)
        return True
    if last is not None:
        args.resume = "auto"
    if args.resume is None or last is not None:
        rank0_print(note + (f"resuming from {last}" if last is not None else "no checkpoint yet, starting afresh"),
                    file=sys.stderr)
    return False


def check_resume_model(model_config, ckpt: Path, cfg: TrainConfig | None = None) -> None:
    """The checkpoint holds the tensors of the model being trained (names and full shapes, from its
    ``trainer_state.json``; the unsharded model is built on the meta device; under ``cfg.lora_r`` its adapters
    only). Raises ValueError naming the first differences, before any rank starts."""
    from tensorpar.train.checkpoint import read_state
    from tensorpar.train.lora import trainable_meta_shapes

    stored = {n: tuple(s) for n, s in (read_state(ckpt).get("tensors") or {}).items()}
    if not stored:
        return
    model = trainable_meta_shapes(cfg, model_config)
    missing = sorted(set(model) - set(stored))
    extra = sorted(set(stored) - set(model))
    shape = sorted(n for n in set(model) & set(stored) if model[n] != stored[n])
    if missing or extra or shape:
        parts = [f"{len(v)} {what} ({', '.join(v[:3])})" for v, what in
                 ((missing, "tensors missing from it"), (extra, "tensors the model lacks"),
                  (shape, "tensors of another shape")) if v]
        if cfg.lora_r and all(".lora_" in n for n in missing + extra + shape):
            ranks = sorted({s[0] for n, s in stored.items() if ".lora_A." in n})
            saved = f" (it holds rank {','.join(map(str, ranks))})" if ranks else ""
            raise ValueError(f"checkpoint {ckpt} holds LoRA adapters of another rank or other target modules than "
                             f"--lora {cfg.lora_r}{saved}: {'; '.join(parts)}; resume with the --lora and "
                             f"--lora-target-modules of the run that saved it")
        raise ValueError(f"checkpoint {ckpt} is of another model than --model: {'; '.join(parts)}; resume with the "
                         f"model it was trained with")


def check_resume(cfg: TrainConfig, resume: str) -> Path:
    """Checks before resuming: a consistent checkpoint, ``--steps`` above its step, metrics that reach it.

    Returns the checkpoint folder. Raises FileNotFoundError (no checkpoint), CheckpointError (a damaged
    state, naming the field; a truncated or corrupt tensor file, naming an older checkpoint) or ValueError
    (``--steps``, metrics).
    """
    from tensorpar.train.checkpoint import check_files, latest_checkpoint, read_state
    from tensorpar.train.metrics import check_metrics

    ckpt = latest_checkpoint(Path(cfg.out_dir) / "checkpoints" if resume == "auto" else resume)
    state = read_state(ckpt)
    check_files(ckpt, state)  # a truncated shard: one line now, not a failed rank later
    step = state["step"]
    if cfg.steps <= step:
        raise ValueError(f"--steps {cfg.steps} is not above the checkpoint's step {step} ({ckpt}); pass --steps "
                         f"greater than {step} to continue training")
    check_metrics(Path(cfg.out_dir) / "metrics.jsonl", step, log_every=cfg.log_every)
    return ckpt


def check_resume_data(cfg: TrainConfig, data, ckpt: Path) -> None:
    """The checkpoint's data position fits this data and these settings, and matches its step.

    Every optimiser step takes one batch, so the position (``epoch * batches_per_epoch + batch_in_epoch``)
    equals the step. Raises ValueError (settings or corpus differ; a position that is not the step's)
    or CheckpointError.
    """
    from tensorpar.train.checkpoint import CheckpointError, read_state

    state = read_state(ckpt)
    batches = data.train_batches(batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed)
    batches.load_state_dict(state.get("data", {}))
    pos = batches.epoch * batches.batches_per_epoch + batches.batch_in_epoch
    if pos != state["step"]:
        raise CheckpointError(f"{ckpt}: the data position (epoch {batches.epoch}, batch {batches.batch_in_epoch}, "
                              f"i.e. {pos} batches) does not match step {state['step']}; the checkpoint is "
                              f"damaged, resume from another one")
