"""Log-softmax, log-sum-exp and per-token log-probabilities of vocabulary-sharded logits.

For logits ``z`` over ``V`` classes, rank ``r`` holding ``z[..., start_r:stop_r]``:

    lse(z)          = m + log sum_j exp(z_j - m),  m = max_j z_j        (all-reduce max, then sum)
    log_softmax_j   = z_j - lse(z)
    d lse / d z_j   = softmax_j                                          (local: no collective)
    d/dz_j of sum_i g_i log_softmax_i = g_j - softmax_j * sum_i g_i      (one all-reduce of sum_i g_i)

The last line is the Jacobian-vector product of log-softmax (e.g. Goodfellow et al., Deep Learning, 6.2.2.3);
``sum_i g_i`` runs over the whole vocabulary, hence the backward all-reduce. With these, KL terms, z-loss
(``lse**2``, PaLM, Chowdhery et al. 2022, Sec. 5) and policy-gradient losses on sharded logits need no gather.

Statistics are computed in fp32 for 16-bit logits and in the logits' dtype when it is wider (float64 stays
float64); results come back in that compute dtype, like ``F.log_softmax(x, dtype=torch.float32)`` for
16-bit ``x``. The vocabulary partition is explicit, as everywhere (:mod:`tensorpar.layers.vocab`).
"""
from __future__ import annotations

import torch

from tensorpar import comm
from tensorpar.comm import Group
from tensorpar.layers.cross_entropy import _VocabParallelCE, check_targets, compute_dtype
from tensorpar.layers.vocab import check_local_width, resolve_vocab_partition


def _lse(z: torch.Tensor, group: Group) -> torch.Tensor:
    m = comm.all_reduce(z.max(dim=-1).values, group, op="max")
    s = comm.all_reduce((z - m.unsqueeze(-1)).exp().sum(-1), group)
    return m + s.log()


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, group):
        z = logits.to(compute_dtype(logits.dtype))
        out = z - _lse(z, group).unsqueeze(-1)
        ctx.save_for_backward(out)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        total = comm.all_reduce(g.sum(-1), ctx.group)                 # sum over the whole vocabulary
        return g - out.exp() * total.unsqueeze(-1), None


class _LogSumExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, group):
        z = logits.to(compute_dtype(logits.dtype))
        lse = _lse(z, group)
        ctx.save_for_backward(z, lse)
        return lse

    @staticmethod
    def backward(ctx, g):
        z, lse = ctx.saved_tensors
        return g.unsqueeze(-1) * (z - lse.unsqueeze(-1)).exp(), None


def vocab_parallel_log_softmax(logits: torch.Tensor, tp: Group, *, partition) -> torch.Tensor:
    """This rank's slice of ``log_softmax(z)`` over the whole vocabulary.

    Shapes: ``logits`` ``[*, V_r]`` -> ``[*, V_r]`` (gathered over ranks it equals ``F.log_softmax`` of the
    gathered logits, values and gradients). ``partition``: see :mod:`tensorpar.layers.vocab`.

    Collectives: forward all-reduce(max) and all-reduce(sum) of ``[*]``; backward one all-reduce(sum) of ``[*]``.

    Raises:
        ValueError: logits that are not this rank's slice (both widths named).
    """
    part = resolve_vocab_partition(partition, tp)
    check_local_width(logits.shape[-1], part, tp)
    return _LogSoftmax.apply(logits, tp)


def vocab_parallel_logsumexp(logits: torch.Tensor, tp: Group, *, partition) -> torch.Tensor:
    """``log sum_j exp(z_j)`` over the whole vocabulary, ``[*, V_r] -> [*]`` (same on every rank).

    Collectives: forward all-reduce(max) and all-reduce(sum) of ``[*]``; backward none.
    """
    part = resolve_vocab_partition(partition, tp)
    check_local_width(logits.shape[-1], part, tp)
    return _LogSumExp.apply(logits, tp)


def vocab_parallel_logprobs(logits: torch.Tensor, target: torch.Tensor, tp: Group, *, partition,
                            ignore_index: int = -100) -> torch.Tensor:
    """Per-token log-probability ``log p(target)``, ``[*, V_r]`` and ``[*]`` -> ``[*]`` (same on every rank).

    Positions whose target is ``ignore_index`` get 0 and no gradient. Differentiable (the gradient of the
    rank's logits is ``g * ([j == y] - softmax_j)``), so it serves policy-gradient losses.

    Collectives: forward all-reduce(max) of ``[*]`` and all-reduce(sum) of ``[*, 3]``; backward none.
    """
    part = resolve_vocab_partition(partition, tp)
    start, _ = check_local_width(logits.shape[-1], part, tp)
    check_targets(target, part.n, ignore_index)
    return -_VocabParallelCE.apply(logits, target, tp, start, part.n, ignore_index, 0.0)


@torch.no_grad()
def vocab_parallel_topk_logprobs(logits: torch.Tensor, k: int, tp: Group, *, partition):
    """The ``k`` most likely tokens and their log-probabilities, ``[*, V_r] -> ([*, k], [*, k] int64)``.

    Each rank proposes its local top ``min(k, V_r)``; the candidates (``k`` values and global ids per
    rank) are all-gathered and the best ``k`` kept, ties to the lower id like ``torch.topk`` on the gathered
    logits. Returns the same on every rank. No gradient.

    Collectives: all-reduce(max), all-reduce(sum) of ``[*]``; one all-gather of ``[*, tp * k]`` values and ids.

    Raises:
        ValueError: ``k`` < 1 or larger than the vocabulary.
    """
    part = resolve_vocab_partition(partition, tp)
    start, stop = check_local_width(logits.shape[-1], part, tp)
    if not 1 <= k <= part.n:
        raise ValueError(f"k must be in [1, {part.n}] (the vocabulary size), got {k}")
    lp = _LogSoftmax.apply(logits, tp)
    kl = min(k, stop - start)
    v, i = lp.topk(kl, dim=-1)
    if tp.size == 1:
        return v, i
    # pad every rank to k candidates so the all-gather has equal shapes
    pad = k - kl
    if pad:
        v = torch.cat([v, v.new_full((*v.shape[:-1], pad), float("-inf"))], -1)
        i = torch.cat([i, i.new_zeros((*i.shape[:-1], pad))], -1)
    gid = (i + start).to(v.dtype)
    both = comm.all_gather(torch.stack([v, gid], -1), tp, dim=-2)            # [*, tp*k, 2]
    vals, ids = both[..., 0], both[..., 1]
    # order by (value desc, id asc): sort by id first, then a stable sort by value
    o = ids.argsort(dim=-1, stable=True)
    vals, ids = vals.gather(-1, o), ids.gather(-1, o)
    o = vals.argsort(dim=-1, descending=True, stable=True)[..., :k]
    return vals.gather(-1, o), ids.gather(-1, o).long()
