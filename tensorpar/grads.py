"""Gradient utilities that know which parameters are sharded over tp and which are replicated.

A parameter with a ``tp_dim`` attribute is a shard: its squared norm is summed over the tp
group (rows duplicated on several ranks, as GQA's shared KV heads, are counted on their owner only). Any other parameter is replicated: its gradient is identical on every tp rank and is
counted once. So the norm at tp = N equals the norm of the same model at tp = 1.

Under FSDP2 (``fully_shard`` on the dp axis, ``--dp-mode fsdp``) parameters and gradients are DTensors sharded
``Shard(0)`` over dp: each dp rank holds rows ``[r c, r c + len)`` (``c = ceil(rows / dp)``, torch.chunk's rule) of
the tp-local tensor. The functions here work on those local rows; the tp attributes must have been copied onto
the DTensor parameters (:func:`tensorpar.pipeline.trainer.fully_shard_dp` does). The grad norm then also sums over
``dp``, and the duplicated-KV sync gathers those (small) gradients over dp first.
"""
from __future__ import annotations

from typing import Iterable

import torch

from tensorpar import comm
from tensorpar.comm import Group


def is_dtensor(t) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (FSDP2's parameters and gradients)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a DTensor's local shard (a view: in-place edits reach it), else ``t``."""
    return t.to_local() if is_dtensor(t) else t


def dp_rows(t: torch.Tensor) -> tuple[int, int]:
    """``(start, length)`` of this rank's rows of a DTensor sharded ``Shard(0)`` on a 1-D mesh (FSDP2's layout):
    chunks of ``ceil(rows / n)`` rows in mesh-rank order (torch.chunk's rule, which DTensor's Shard follows).

    Raises ValueError for another placement (e.g. a 2-D mesh or ``Shard(1)``), which these utilities do not handle.
    """
    from torch.distributed.tensor import Shard

    if t.device_mesh.ndim != 1 or len(t.placements) != 1 or t.placements[0] != Shard(0):
        raise ValueError(f"gradient placement {t.placements} on a {t.device_mesh.ndim}-D mesh: the tp gradient "
                         f"utilities support FSDP2's Shard(0) on the 1-D dp mesh only")
    n, r = t.device_mesh.size(), t.device_mesh.get_local_rank()
    chunk = -(-t.shape[0] // n)
    start = min(r * chunk, t.shape[0])
    return start, t.to_local().shape[0]


def grad_norm(params: Iterable[torch.nn.Parameter], tp: Group, dp: Group | None = None) -> torch.Tensor:
    """Global L2 norm of the gradients, as one device would compute it (fp32 scalar).

    Collectives: one all-reduce of one float over ``tp`` (the sharded parameters' sum of squares); with
    gradients that are DTensors sharded over ``dp`` (FSDP2), first one all-reduce of two floats over ``dp``.
    Parameters without a gradient are skipped; a parameter shared twice (tied weights) is
    counted once.

    Raises:
        ValueError: a DTensor gradient and no ``dp`` group, or a placement other than FSDP2's ``Shard(0)``.
    """
    seen: set[int] = set()
    # sums of squares: [tp-sharded, tp-replicated] x [whole on this rank, dp-sharded rows (FSDP)]
    sq_whole: list = [None, None]
    sq_dp: list = [None, None]
    for p in params:
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        grad = p.grad.detach()
        on_dp = is_dtensor(grad)
        if on_dp and dp is None:
            raise ValueError("grad_norm: the gradients are DTensors sharded over dp (FSDP); pass the dp group")
        g = local_tensor(grad).float()
        part = getattr(p, "tp_partition", None)
        if part is not None and not part.is_disjoint:  # duplicated KV heads: count each on its owner only
            keep = torch.tensor(part.owner_mask(tp.rank), device=g.device)
            if on_dp and p.tp_dim == 0:  # this dp rank holds only some of the tp-local rows
                start, n = dp_rows(grad)
                keep = keep[start:start + n]
            g = g[keep] if p.tp_dim == 0 else g[:, keep]
        sq = g.pow(2).sum()
        acc, i = (sq_dp if on_dp else sq_whole), (0 if getattr(p, "tp_dim", None) is not None else 1)
        acc[i] = sq if acc[i] is None else acc[i] + sq
    dev = next((x.device for x in (*sq_whole, *sq_dp) if x is not None), torch.device("cpu"))
    zero = torch.zeros((), device=dev)
    sharded, replicated = (zero if x is None else x for x in sq_whole)
    if any(x is not None for x in sq_dp):
        summed = comm.all_reduce(torch.stack([zero if x is None else x for x in sq_dp]), dp)
        sharded, replicated = sharded + summed[0], replicated + summed[1]
    return (comm.all_reduce(sharded, tp) + replicated).sqrt()


def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float, tp: Group,
                    dp: Group | None = None) -> torch.Tensor:
    """Scale gradients in place so that :func:`grad_norm` is at most ``max_norm``; return the norm before.

    The same scale is applied on every rank (the norm is identical on all tp and dp ranks). ``dp``: the
    data-parallel group when the gradients are FSDP2 DTensors (see :func:`grad_norm`).
    Raises ValueError if ``max_norm`` is not positive.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be positive, got {max_norm}")
    params = [p for p in params if p.grad is not None]
    total = grad_norm(params, tp, dp)
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    seen: set[int] = set()
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            local_tensor(p.grad.detach()).mul_(scale.to(p.grad.dtype))
    return total


def sync_sequence_parallel_grads(params: Iterable[torch.nn.Parameter], tp: Group) -> int:
    """Sum over tp the gradients of replicated parameters used inside a sequence-parallel region.

    Norm weights and row-parallel biases see only this rank's sequence shard under sequence
    parallelism (Korthikanti et al. 2022, Sec. 4.2.2), so their gradient is a partial sum.
    Collectives: one all-reduce of all such gradients flattened together. Returns the number
    of parameters synchronised. FSDP2 DTensor gradients: their local dp rows are summed (the tp ranks of one
    dp rank hold the same rows of these replicated parameters).
    """
    ps = [p for p in params if getattr(p, "sequence_parallel", False) and p.grad is not None]
    uniq = list({id(p): p for p in ps}.values())
    if not uniq or tp.size == 1:
        return len(uniq)
    grads = [local_tensor(p.grad.detach()) for p in uniq]
    flat = torch.cat([g.reshape(-1) for g in grads])
    flat = comm.all_reduce(flat, tp)
    off = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[off:off + n].view_as(g))
        off += n
    return len(uniq)


def sync_duplicated_grads(params: Iterable[torch.nn.Parameter], tp: Group) -> int:
    """Sum the gradients of rows held by several tp ranks (KV heads shared by query heads on two ranks).

    Each holder computed the gradient from its own query heads only; the true gradient is the
    sum over holders. Collectives: one all-reduce of the full-shape gradient of each such
    parameter (``[num_kv_heads * head_dim, hidden]``, small under GQA). Returns the count.
    FSDP2 DTensor gradients are first gathered over dp (one all-gather each: a duplicated row may sit on
    different dp ranks of two tp ranks), and each dp rank keeps its rows of the sum.
    """
    ps = [p for p in params if p.grad is not None and getattr(p, "tp_partition", None) is not None
          and not p.tp_partition.is_disjoint]
    ps = list({id(p): p for p in ps}.values())
    if tp.size == 1:
        return len(ps)
    for p in ps:
        part, dim = p.tp_partition, p.tp_dim
        grad = p.grad.detach()
        g = grad.full_tensor() if is_dtensor(grad) else grad   # the tp-local gradient, whole over dp
        idx = torch.tensor(part.indices(tp.rank), device=g.device)
        shape = list(g.shape)
        shape[dim] = part.n
        full = g.new_zeros(shape).index_add_(dim, idx, g)
        summed = comm.all_reduce(full, tp).index_select(dim, idx)
        if is_dtensor(grad):
            start, n = dp_rows(grad)
            summed = summed.narrow(0, start, n)
        local_tensor(grad).copy_(summed)
    return len(ps)
