"""RMSNorms over a hidden dimension split across tp ranks (OLMo 2's and OLMoE's q/k norms): each rank's partial sum
of squares is all-reduced (:func:`all_reduce_sum`) before normalising its rows.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from tensorpar import comm
from tensorpar.comm import Group
from tensorpar.shard import Partition, UnitSelection

class _AllReduceSum(torch.autograd.Function):
    """forward: all-reduce (sum); backward: all-reduce (sum). For a partial sum that every rank then uses
    on its own, different, data (so each rank's gradient is only its own part of the total)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return comm.all_reduce(g.contiguous(), ctx.group), None


class TPRMSNorm(nn.Module):
    """RMSNorm over a dimension whose features are split (or selected, with duplicates) across tp ranks.

    ``y = w * x / sqrt(mean(x^2) + eps)`` where the mean runs over all ``n`` features of the unsharded
    dimension (OLMo 2's q/k norms act on the full ``heads * head_dim`` projection, not per head). Each rank
    holds ``rows.indices(tp_rank)`` of the features and the same rows of ``w`` (sharded with its heads: a
    :class:`Partition` for query heads, a :class:`UnitSelection` for KV heads, which may be held by several
    ranks). The sum of squares is taken on each rank over the rows it *owns* (the lowest rank holding a
    duplicated row owns it, :meth:`UnitSelection.owner_mask`), so an all-reduce gives the exact global sum
    however KV heads are duplicated or replicated. The arithmetic is fp32, then cast back to the input
    dtype, as transformers' ``Olmo2RMSNorm``/``LlamaRMSNorm`` do (Zhang & Sennrich 2019, "Root Mean Square
    Layer Normalization").

    Shapes: input and output ``[*, n_r]`` with ``n_r = rows.sizes[tp_rank]``; weight ``[n_r]``.

    Collectives: forward one all-reduce of ``[*, 1]`` fp32 (the sums of squares); backward one all-reduce of
    the same shape (each rank's gradient of the shared sum covers its own rows only). The weight's gradient is
    this rank's rows; duplicated rows are summed by :func:`tensorpar.grads.sync_duplicated_grads`.
    """

    def __init__(self, norm: nn.Module, tp: Group, rows: Partition | UnitSelection):
        super().__init__()
        from tensorpar.layers.linear import _slice, mark_sharded

        if norm.weight.shape[0] != rows.n:
            raise ValueError(f"norm weight has {norm.weight.shape[0]} features but the row split covers {rows.n}")
        self.tp, self.rows, self.n = tp, rows, rows.n
        self.variance_epsilon = norm.variance_epsilon
        self.weight = mark_sharded(nn.Parameter(_slice(norm.weight.detach(), 0, rows, tp.rank).clone()), 0, rows)
        own = rows.owner_mask(tp.rank)
        self._owned = None if all(own) else tuple(i for i, o in enumerate(own) if o)

    def local_sum_of_squares(self, x: torch.Tensor) -> torch.Tensor:
        """``[*, n_r] -> [*, 1]`` fp32: the sum of squares over the rows this rank owns (no communication)."""
        sq = x.float().pow(2)
        if self._owned is not None:
            sq = sq.index_select(-1, torch.tensor(self._owned, dtype=torch.long, device=x.device))
        return sq.sum(-1, keepdim=True)

    def normalize(self, x: torch.Tensor, sum_of_squares: torch.Tensor) -> torch.Tensor:
        """``w * x / sqrt(sum_of_squares / n + eps)`` given the global sum of squares ``[*, 1]`` (fp32)."""
        y = x.float() * torch.rsqrt(sum_of_squares / self.n + self.variance_epsilon)
        return (self.weight * y).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(x, all_reduce_sum(self.local_sum_of_squares(x), self.tp))

    def extra_repr(self) -> str:
        return f"local {tuple(self.weight.shape)} of {self.n}, eps={self.variance_epsilon}, tp={self.tp.size}"


def all_reduce_sum(x: torch.Tensor, tp: Group) -> torch.Tensor:
    """Sum of ``x`` over tp, differentiable: forward all-reduce, backward all-reduce (every rank uses the sum on
    its own data, so each rank's gradient is a part of the total). Identity at tp = 1; a plain all-reduce when
    no gradient is needed."""
    if tp.size == 1:
        return x
    if torch.is_grad_enabled() and x.requires_grad:
        return _AllReduceSum.apply(x, tp)
    return comm.all_reduce(x, tp)


class TPSpanningRMSNorm(TPRMSNorm):
    """:class:`TPRMSNorm` for a norm applied after the split into heads (OLMoE's ``q_norm [heads * d]`` /
    ``k_norm [kv_heads * d]``): input and output ``[b, s, heads_r, d]``, normalised over all heads' features.

    As ``OlmoeRMSNorm``, the normalised value is cast to the input dtype before the weight multiplies it.
    Collectives: those of :class:`TPRMSNorm` (one all-reduce of ``[b, s, 1]`` in forward and in backward).
    """

    def normalize(self, x: torch.Tensor, sum_of_squares: torch.Tensor) -> torch.Tensor:
        y = x.float() * torch.rsqrt(sum_of_squares / self.n + self.variance_epsilon)
        return self.weight * y.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        return super().forward(x.reshape(*shape[:-2], -1)).view(shape)
