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

The vocabulary partition is always explicit (:mod:`tensorpar.layers.vocab`): with an uneven split
(37 over 2 ranks is [19, 18]) a rank cannot infer where its slice starts, and logits that were
gathered already would give the true loss plus exactly ``ln(tp)``; both are refused.

A ``"mean"`` over targets that are all ``ignore_index`` is ``0 / 0``: like torch, the value is NaN and
every gradient is zero (never NaN), so such a batch cannot poison the weights through backward.
"""
from __future__ import annotations

import torch

from tensorpar import comm
from tensorpar.comm import Group
from tensorpar.layers.vocab import check_local_width, resolve_vocab_partition


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype softmax statistics are computed in: fp32 for 16-bit inputs, the input's own if wider."""
    return torch.promote_types(dtype, torch.float32)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, start, vocab_size, ignore_index, eps):
        z = logits.to(compute_dtype(logits.dtype))
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


def check_targets(target: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """Refuse class ids outside ``[0, vocab_size)`` that are not ``ignore_index`` (torch raises too; without this
    check a rank would read the target's logit as 0 and return a plausible but wrong loss). One host
    synchronisation on the (small) target tensor.

    Raises:
        ValueError: naming the first bad id and the vocabulary size.
    """
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab_size))
    if bool(bad.any()):
        raise ValueError(f"target id {int(target[bad].flatten()[0])} is outside the vocabulary [0, {vocab_size}) and "
                         f"is not ignore_index={ignore_index}")


def masked_mean(values: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``values.sum() / count`` where ``count`` may be 0: then the value is NaN (as torch's mean over no
    element) but the gradient is zero, not NaN. No host synchronisation."""
    total = values.sum()
    nan_if_empty = torch.where(count == 0, float("nan"), 0.0).to(total.dtype)
    return total / count.clamp(min=1).to(total.dtype) + nan_if_empty


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp: Group,
    *,
    partition,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of vocab-sharded logits; equals ``F.cross_entropy`` on the gathered logits.

    Shapes: ``logits`` ``[*, V_r]`` (this rank's vocabulary slice, ``V_r = partition.sizes[tp_rank]``),
    ``target`` ``[*]`` of global class ids or ``ignore_index``. Returns ``[*]`` with
    ``reduction="none"``, else a scalar (``"mean"`` divides by the number of non-ignored
    targets, as torch does; NaN with zero gradients when there is none). Computed in fp32 for
    16-bit logits, in the logits' dtype otherwise (float64 stays float64).

    Args:
        partition: the vocabulary split the logits come from (required): a Partition, the global
            vocab size (near-even split), or the LM head / sharded model / plan that produced them.

    Collectives: forward one all-reduce(max) of ``[*]`` and one all-reduce(sum) of ``[*, 3]``;
    backward none.

    Raises:
        ValueError: ``reduction`` not in none/mean/sum, ``label_smoothing`` outside [0, 1], or
            logits whose last dim is not this rank's vocabulary slice (both widths named).
        TypeError: ``partition`` of an unknown form.
    """
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    part = resolve_vocab_partition(partition, tp)
    start, _ = check_local_width(logits.shape[-1], part, tp)
    check_targets(target, part.n, ignore_index)
    loss = _VocabParallelCE.apply(logits, target, tp, start, part.n, ignore_index, float(label_smoothing))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return masked_mean(loss, (target != ignore_index).sum())
