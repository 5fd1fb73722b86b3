"""One training step and the validation loss, on a model sharded over a tensor-parallel group.

A step, on every tp rank with the same batch:

1. forward under the chosen autocast; logits stay vocabulary-sharded ``[b, s, V_r]``;
2. vocab-parallel cross-entropy (two all-reduces of per-token scalars, never the full logits);
3. backward;
4. complete the gradients: sum over tp the gradients of replicated parameters used on a sequence shard
   (norm weights, under sequence parallelism) and of KV rows duplicated on several ranks; after this each
   rank's gradient slice equals the matching slice of the tp = 1 gradient;
5. clip by the global norm, counting replicated parameters once and summing the shards
   (:func:`tensorpar.grads.clip_grad_norm_`), so the clip scale is the tp = 1 one;
6. AdamW on each rank's slices: element-wise, so it equals tp = 1 once the gradients are complete.

A batch whose labels are all ``ignore_index`` has no target token: its mean loss is NaN (0 / 0, as in torch)
and its gradients are zero. Such a step is reported (``StepResult.skipped``, one line on rank 0) and the
optimizer is not stepped, so neither momentum nor weight decay moves the weights on a batch without data.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from tensorpar.comm import Group
from tensorpar.grads import clip_grad_norm_, grad_norm, sync_duplicated_grads, sync_sequence_parallel_grads
from tensorpar.layers import vocab_parallel_cross_entropy
from tensorpar.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from tensorpar.train.config import TrainConfig
from tensorpar.train.data import TrainData
from tensorpar.layers.dropout import DropoutRNG, install_dropout
from tensorpar.train.model import named_unique_parameters

IGNORE_INDEX = -100  # labels that count for nothing (torch's default ignore_index)


@dataclass(frozen=True)
class StepResult:
    """What one optimiser step did. ``grad_norm`` is before clipping; ``step`` counts from 1.

    ``skipped``: the batch had no target token (every label ``ignore_index``), so no update was made.
    """

    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    time_s: float
    skipped: bool = False

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time_s if self.time_s > 0 else float("nan")


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Learning rate of optimiser step ``step`` (0-based): linear warm-up, then cosine to ``lr * min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    t = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def make_optimizer(cfg: TrainConfig, named: list[tuple[str, nn.Parameter]]) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (ndim >= 2) only; each parameter appears once (tied ones too)."""
    decay = [p for _, p in named if p.ndim >= 2]
    other = [p for _, p in named if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": other, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


class Trainer:
    """Holds the sharded model, its optimizer, the batch iterator and the step count.

    Args:
        cfg: the run's settings.
        tp: the tensor-parallel group (``Group.single()`` for one device).
        model, plan: from :func:`tensorpar.train.model.build_model`.
        data: the token streams.
    """

    def __init__(self, cfg: TrainConfig, tp: Group, model: nn.Module, plan, data: TrainData):
        self.cfg, self.tp, self.model, self.plan, self.data = cfg, tp, model, plan, data
        self.named_params = named_unique_parameters(model)
        self.params = [p for _, p in self.named_params]
        self.optimizer = make_optimizer(cfg, self.named_params)
        self.rng = DropoutRNG(cfg.seed)  # the run's keyed masks (the model's own generator is replaced)
        install_dropout(model, self.rng, attention_dropout=cfg.attention_dropout, hidden_dropout=cfg.hidden_dropout)
        self.batches = data.train_batches(batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed)
        self.step = 0  # optimiser steps done
        self.device = next(model.parameters()).device

    def autocast(self):
        if self.cfg.dtype == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of a batch ``[b, s]`` (same scalar on every tp rank).

        Collectives: the model's, plus the two all-reduces of the vocab-parallel cross-entropy.
        """
        with self.autocast():
            logits = self.model(input_ids=input_ids.to(self.device), use_cache=False).logits    # [b, s, V_r]
        return vocab_parallel_cross_entropy(logits, labels.to(self.device), self.tp, partition=self.plan.vocab,
                                            label_smoothing=self.cfg.label_smoothing)

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Loss and complete gradients of one batch (steps 1-4 of the module docstring); returns the loss."""
        self.rng.set_step(self.step)
        loss = self.loss(input_ids, labels)
        loss.backward()
        sync_sequence_parallel_grads(self.params, self.tp)
        sync_duplicated_grads(self.params, self.tp)
        return loss.detach()

    def train_step(self, inspect: Callable[["Trainer"], None] | None = None) -> StepResult:
        """Take the next batch and do one optimiser step.

        ``inspect(trainer)``, if given, is called once the gradients are complete and clipped, just before
        the optimizer uses them (tests compare them there).
        """
        t0 = time.perf_counter()
        input_ids, labels = next(self.batches)
        if not bool((labels != IGNORE_INDEX).any()):
            return self._skip(input_ids, t0)
        loss = self.forward_backward(input_ids, labels)
        if self.cfg.grad_clip > 0:
            norm = clip_grad_norm_(self.params, self.cfg.grad_clip, self.tp)
        else:
            norm = grad_norm(self.params, self.tp)
        if inspect is not None:
            inspect(self)
        lr = lr_at(self.cfg, self.step)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return StepResult(self.step, float(loss), float(norm), lr, int(input_ids.numel()), time.perf_counter() - t0)

    def _skip(self, input_ids: torch.Tensor, t0: float) -> StepResult:
        """Account for a batch without any target token: no forward, no update; reported once on rank 0."""
        from tensorpar.launch import rank0_print

        lr = lr_at(self.cfg, self.step)
        self.step += 1
        rank0_print(f"tensorpar: warning: step {self.step}: every label is ignore_index (no target token); "
                    f"optimizer step skipped")
        return StepResult(self.step, float("nan"), 0.0, lr, int(input_ids.numel()), time.perf_counter() - t0,
                          skipped=True)

    @torch.no_grad()
    def evaluate(self, max_batches: int | None = None) -> float:
        """Mean loss over the first ``max_batches`` (default ``cfg.eval_batches``) validation batches, no dropout."""
        n = max_batches or self.cfg.eval_batches
        self.model.eval()
        try:
            total, count = 0.0, 0
            for i, (x, y) in enumerate(self.data.val_batches(batch_size=self.cfg.batch_size,
                                                             seq_len=self.cfg.seq_len)):
                if i == n:
                    break
                total += float(self.loss(x, y))
                count += 1
        finally:
            self.model.train()
        if count == 0:
            raise ValueError("the validation split has no batch of batch_size x seq_len tokens; lower batch_size or "
                             "seq_len, or raise val_fraction")
        return total / count

    # ------------------------------------------------------------ checkpoints

    def save(self, root) -> Path:
        """Checkpoint the model, AdamW state, step and data position (every tp rank calls and writes the rows it
        owns with DCP, in parallel; rank 0 publishes the folder once all have written).

        See :func:`tensorpar.train.checkpoint.save_checkpoint` for the format and its errors.
        """
        state = {"config": self.cfg.to_dict(), "data": self.batches.state_dict(), "tokenizer": self.data.tokenizer,
                 "data_source": self.data.source}
        return save_checkpoint(root, named_params=self.named_params, optimizer=self.optimizer, tp=self.tp,
                               step=self.step, state=state, config_json=self.model.config.to_json_string(),
                               keep=self.cfg.keep_checkpoints)

    def resume(self, path) -> dict:
        """Continue from the checkpoint at ``path`` (a checkpoint folder, or a root: its ``latest``), saved at any
        (tp, pp, dp).

        Restores parameters, AdamW moments and step count, the data position and the step counter; the
        learning rate and dropout masks are functions of the step, so nothing else is needed. Raises the
        ValueErrors of :func:`tensorpar.train.checkpoint.load_checkpoint` and of
        ``LMBatches.load_state_dict`` (different batch size, sequence length, seed or corpus).
        """
        ckpt = latest_checkpoint(path)
        state = load_checkpoint(ckpt, named_params=self.named_params, optimizer=self.optimizer, tp=self.tp)
        self.batches.load_state_dict(state["data"])
        self.step = int(state["step"])
        return state
