"""Gradient utilities that know which parameters are sharded over tp and which are replicated.

A parameter with a ``tp_dim`` attribute is a shard: its squared norm is summed over the tp
group (rows duplicated on several ranks, as GQA's shared KV heads, are counted on their owner only). Any other parameter is replicated: its gradient is identical on every tp rank and is
counted once. So the norm at tp = N equals the norm of the same model at tp = 1.
"""
from __future__ import annotations

from typing import Iterable

import torch

from tensorpar import comm
from tensorpar.comm import Group


def grad_norm(params: Iterable[torch.nn.Parameter], tp: Group) -> torch.Tensor:
    """Global L2 norm of the gradients, as one device would compute it (fp32 scalar).

    Collectives: one all-reduce of one float over ``tp`` (the sharded parameters' sum of squares).
    Parameters without a gradient are skipped; a parameter shared twice (tied weights) is
    counted once.
    """
    seen: set[int] = set()
    sharded = replicated = None
    for p in params:
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        g = p.grad.detach().float()
        part = getattr(p, "tp_partition", None)
        if part is not None and not part.is_disjoint:  # duplicated KV heads: count each on its owner only
            keep = torch.tensor(part.owner_mask(tp.rank), device=g.device)
            g = g[keep] if p.tp_dim == 0 else g[:, keep]
        sq = g.pow(2).sum()
        if getattr(p, "tp_dim", None) is not None:
            sharded = sq if sharded is None else sharded + sq
        else:
            replicated = sq if replicated is None else replicated + sq
    dev = next((x.device for x in (sharded, replicated) if x is not None), torch.device("cpu"))
    sharded = torch.zeros((), device=dev) if sharded is None else sharded
    replicated = torch.zeros((), device=dev) if replicated is None else replicated
    return (comm.all_reduce(sharded, tp) + replicated).sqrt()


def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float, tp: Group) -> torch.Tensor:
    """Scale gradients in place so that :func:`grad_norm` is at most ``max_norm``; return the norm before.

    The same scale is applied on every rank (the norm is identical on all tp ranks).
    Raises ValueError if ``max_norm`` is not positive.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be positive, got {max_norm}")
    params = [p for p in params if p.grad is not None]
    total = grad_norm(params, tp)
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    seen: set[int] = set()
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            p.grad.detach().mul_(scale.to(p.grad.dtype))
    return total


def sync_sequence_parallel_grads(params: Iterable[torch.nn.Parameter], tp: Group) -> int:
    """Sum over tp the gradients of replicated parameters used inside a sequence-parallel region.

    Norm weights and row-parallel biases see only this rank's sequence shard under sequence
    parallelism (Korthikanti et al. 2022, Sec. 4.2.2), so their gradient is a partial sum.
    Collectives: one all-reduce of all such gradients flattened together. Returns the number
    of parameters synchronised.
    """
    ps = [p for p in params if getattr(p, "sequence_parallel", False) and p.grad is not None]
    uniq = list({id(p): p for p in ps}.values())
    if not uniq or tp.size == 1:
        return len(uniq)
    flat = torch.cat([p.grad.detach().reshape(-1) for p in uniq])
    flat = comm.all_reduce(flat, tp)
    off = 0
    for p in uniq:
        n = p.grad.numel()
        p.grad.detach().copy_(flat[off:off + n].view_as(p.grad))
        off += n
    return len(uniq)


def sync_duplicated_grads(params: Iterable[torch.nn.Parameter], tp: Group) -> int:
    """Sum the gradients of rows held by several tp ranks (KV heads shared by query heads on two ranks).

    Each holder computed the gradient from its own query heads only; the true gradient is the
    sum over holders. Collectives: one all-reduce of the full-shape gradient of each such
    parameter (``[num_kv_heads * head_dim, hidden]``, small under GQA). Returns the count.
    """
    ps = [p for p in params if p.grad is not None and getattr(p, "tp_partition", None) is not None
          and not p.tp_partition.is_disjoint]
    ps = list({id(p): p for p in ps}.values())
    if tp.size == 1:
        return len(ps)
    for p in ps:
        part, dim = p.tp_partition, p.tp_dim
        idx = torch.tensor(part.indices(tp.rank), device=p.grad.device)
        shape = list(p.grad.shape)
        shape[dim] = part.n
        full = p.grad.new_zeros(shape).index_add_(dim, idx, p.grad.detach())
        full = comm.all_reduce(full, tp)
        p.grad.detach().copy_(full.index_select(dim, idx))
    return len(ps)
