"""The validation loss of the one trainer (:meth:`tensorpar.train.loop.Trainer.evaluate`): forwards only, through
the same modules and, with pipeline stages, the same schedule as training (its ``eval``), so a setting of the
trainer (autocast, the per-token mean, the tp/dp/pp layout) holds for evaluation too."""
from __future__ import annotations

import torch

from tensorpar import comm

IGNORE_INDEX = -100  # labels that count for nothing (torch's default ignore_index)


@torch.no_grad()
def forward_loss(tr, ids: torch.Tensor, labels: torch.Tensor, targets: int) -> torch.Tensor:
    """Forward only, under the run's autocast: ``dp * (this replica's summed loss) / targets`` as in
    :meth:`~tensorpar.train.loop.Trainer.forward_backward`, the same on every rank of the pipeline (0-d tensor).
    pp = 1: one forward of the replica's rows ``[B/dp, s]``; pp > 1: the pipeline schedule's ``eval`` (its forwards,
    over the micro-batches). Collectives: the model's forward, the cross-entropy's two all-reduces, the pipeline's
    point-to-point sends, one broadcast over pp and one scalar all-reduce over cp."""
    dp = tr.ctx.dp.size
    if tr.schedule is None:
        return tr._sum_over_cp(tr._ce(*tr._logits(ids, labels)) * (dp / targets))
    pp = tr.ctx.pp
    first, last = pp.rank == 0, pp.rank == pp.size - 1
    if tr.ctx.cp.size > 1:
        ids, labels, _ = tr._cp_shard(ids, labels)
    losses: list[torch.Tensor] = []
    tr._token_weight = dp * tr.cfg.micro_batches / targets
    with tr.autocast():
        tr.eval_schedule.eval(*((ids,) if first else ()), **({"target": labels, "losses": losses} if last else {}))
    return tr._sum_over_cp(tr._pipeline_mean(losses))


@torch.no_grad()
def validation_loss(tr, max_batches: int | None = None) -> float:
    """Mean validation loss of trainer ``tr`` over the first ``max_batches`` (default ``cfg.eval_batches``) batches
    of its data's validation split, no dropout: per batch the mean over its target tokens (each dp replica sums its
    rows, the sums are averaged with weights ``dp / N``); a batch without a target token is left out.

    Raises:
        ValueError: the validation split has no full batch (the settings that would help named)."""
    n = max_batches or tr.cfg.eval_batches
    for mod in tr.modules:
        mod.eval()
    try:
        total, count = 0.0, 0
        dp = tr.ctx.dp
        for i, (x, y) in enumerate(tr.data.val_batches(batch_size=tr.cfg.batch_size, seq_len=tr.cfg.seq_len)):
            if i == n:
                break
            targets = int((y != IGNORE_INDEX).sum())
            if not targets:
                continue
            loss = forward_loss(tr, *tr._replica_rows(x, y), targets)
            if dp.size > 1:
                loss = comm.all_reduce(loss.reshape(1), dp)[0] / dp.size
            total += float(loss)
            count += 1
    finally:
        for mod in tr.modules:
            mod.train()
    if count == 0:
        raise ValueError("the validation split has no batch of batch_size x seq_len tokens; lower batch_size or "
                         "seq_len, or raise val_fraction")
    return total / count
