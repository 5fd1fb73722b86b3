"""Cross-entropy on vocabulary-sharded logits, without ever gathering the full logits.

For logits ``z`` over a vocabulary of ``V`` classes and target ``y``, with label smoothing
``eps`` (Szegedy et al. 2016, Sec. 7, as implemented by ``torch.nn.functional.cross_entropy``):

    loss = (1 - eps) * (lse(z) - z_y) + eps * (lse(z) - mean_j z_j)
    dloss/dz_j = softmax(z)_j - (1 - eps) * [j == y] - eps / V

Each rank holds ``z[..., start_r:stop_r]``. The pieces of ``lse``, ``z_y`` and ``sum_j z_j``
are computed locally and combined with two all-reduces (Megatron-LM's ``cross_entropy.py``
uses three; the two sums are fused here into one all-reduce of 3 floats per token):

1. all-reduce(max) of the per-token max, for a stable ``lse``;
2. all-reduce(sum) of ``[sum_j exp(z_j - max), z_y - max, sum_j (z_j - max)]``.

Backward needs no communication.
"""
from __future__ import annotations

import torch

from tensorpar import comm
from tensorpar.comm import Group
from tensorpar.shard import Partition


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, start, vocab_size, ignore_index, eps):
        z = logits.float()
        m = z.max(dim=-1).values
        m = comm.all_reduce(m, group, op="max")
        shifted = z - m.unsqueeze(-1)
        exp = shifted.exp()
        n_local = z.shape[-1]
        valid = target != ignore_index
        local_t = target - start
        mine = valid & (local_t >= 0) & (local_t < n_local)
        idx = local_t.clamp(0, max(n_local - 1, 0)).unsqueeze(-1)
        z_t = torch.gather(shifted, -1, idx).squeeze(-1) * mine
        parts = torch.stack([exp.sum(-1), z_t, shifted.sum(-1)], dim=-1)
        parts = comm.all_reduce(parts, group)
        lse = parts[..., 0].log()
        nll = lse - parts[..., 1]
        loss = nll if eps == 0.0 else (1.0 - eps) * nll + eps * (lse - parts[..., 2] / vocab_size)
        loss = loss * valid
        softmax = exp / parts[..., 0:1]
        ctx.save_for_backward(softmax, idx, mine, valid)
        ctx.eps, ctx.vocab_size, ctx.in_dtype = eps, vocab_size, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, idx, mine, valid = ctx.saved_tensors
        grad = softmax
        if ctx.eps != 0.0:
            grad = grad - ctx.eps / ctx.vocab_size
        grad = grad.scatter_add(-1, idx, -(1.0 - ctx.eps) * mine.unsqueeze(-1).to(grad.dtype))
        grad = grad * (g * valid).unsqueeze(-1)
        return grad.to(ctx.in_dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp: Group,
    *,
    partition: Partition | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of vocab-sharded logits; equals ``F.cross_entropy`` on the gathered logits.

    Shapes: ``logits`` ``[*, V_r]`` (this rank's vocabulary slice, ``V_r = partition.sizes[tp_rank]``),
    ``target`` ``[*]`` of global class ids or ``ignore_index``. Returns ``[*]`` with
    ``reduction="none"``, else a scalar (``"mean"`` divides by the number of non-ignored
    targets, as torch does). Computed in fp32 whatever the logits' dtype.

    Collectives: forward one all-reduce(max) of ``[*]`` and one all-reduce(sum) of ``[*, 3]``;
    backward none.

    Raises:
        ValueError: ``reduction`` not in none/mean/sum, ``label_smoothing`` outside [0, 1], or
            logits whose last dim does not match this rank's vocabulary slice.
    """
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if partition is None:
        partition = Partition((logits.shape[-1],) * tp.size)
    if partition.sizes[tp.rank] != logits.shape[-1]:
        raise ValueError(f"logits have {logits.shape[-1]} vocabulary entries on tp rank {tp.rank} but the vocab "
                         f"partition {partition.sizes} gives it {partition.sizes[tp.rank]}")
    start, _ = partition.range(tp.rank)
    loss = _VocabParallelCE.apply(logits, target, tp, start, partition.n, ignore_index, float(label_smoothing))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()
