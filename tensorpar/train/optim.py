"""The one trainer's optimiser and learning-rate schedule (:class:`tensorpar.train.loop.Trainer`)."""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from tensorpar.train.config import TrainConfig


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
