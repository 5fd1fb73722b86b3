"""Gradient utilities that know which parameters are sharded (over tp, ep, dp) and which are replicated.

A parameter with a ``tp_dim`` attribute is a tp shard (rows duplicated on several ranks, as GQA's shared KV heads,
are counted on their owner only); one with ``ep_dim`` holds this ep rank's experts
(:class:`tensorpar.hf.modules.EPExperts`). Any other parameter is replicated over that axis: its gradient is
identical on every rank of it and is counted on its rank 0 only. So the norm at any layout equals the norm of the
same model on one device, with the same bits on every rank.

Under FSDP2 (``fully_shard`` on the dp axis, ``--dp-mode fsdp``) parameters and gradients are DTensors sharded
``Shard(0)`` over dp: each dp rank holds rows ``[r c, r c + len)`` (``c = ceil(rows / dp)``, torch.chunk's rule) of
the tp-local tensor. The functions here work on those local rows; the tp attributes must have been copied onto
the DTensor parameters (:func:`tensorpar.train.dp.fully_shard_dp` does). The grad norm then also sums over
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


def _data_axis(dp: Group | None, ep: Group | None) -> Group | None:
    """The one group the data-parallel axis stands for: ``ep`` (experts split over it), else ``dp`` (FSDP)."""
    if dp is not None and ep is not None and dp.size > 1 and ep.size > 1 and dp.pg is not ep.pg:
        raise ValueError(f"grad_norm: ep ({ep}) must be the dp group ({dp}) when both are given: the experts are "
                         f"split over the dp axis")
    return ep if ep is not None and ep.size > 1 else dp


def grad_norm(params: Iterable[torch.nn.Parameter], tp: Group, dp: Group | None = None, *,
              ep: Group | None = None, pp: Group | None = None) -> torch.Tensor:
    """Global L2 norm of the gradients, as one device would compute it (fp32 scalar, the same bits on every rank).

    Each parameter is counted once in the whole job, decided from the metadata the styles set on it:

    * ``tp_dim`` (a tp shard): every tp rank adds its rows (rows duplicated on several ranks, as shared KV heads,
      on their owner only); without it the parameter is replicated over tp and only tp rank 0 adds it;
    * ``ep_dim`` (whole experts split over ``ep``): every ep rank adds its experts; a DTensor gradient (FSDP2,
      ``Shard(0)`` over ``dp``): every dp rank adds its rows; otherwise, when ``ep`` or ``dp`` is given, the
      parameter is replicated over that axis and only its rank 0 adds it;
    * ``pp``: the stages hold different parameters, each stage adds its own (a weight tied across two stages
      must be passed by one stage only).

    ``dp``: the data-parallel group when the gradients are FSDP2 DTensors (with DDP's replicated gradients it may
    be left out). ``ep``: the expert-parallel group (the dp axis under tp x ep; the only group under ep alone, with
    ``tp`` a one-rank group).

    Collectives: one all-reduce of one float over ``tp``, then over ``ep``/``dp`` when given, then over ``pp``
    when given; the result is that of the last all-reduce, hence identical on every rank. Parameters without a
    gradient are skipped; a parameter listed twice (tied weights) is counted once.

    Raises:
        ValueError: a DTensor gradient and no ``dp`` group, a parameter split over ep (``ep_dim``) and no ``ep``
            group, ``ep`` and ``dp`` both given but different, or a placement other than FSDP2's ``Shard(0)``.
    """
    data = _data_axis(dp, ep)
    seen: set[int] = set()
    sq, dev = None, torch.device("cpu")
    for p in params:
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        grad = p.grad.detach()
        dev = local_tensor(grad).device
        on_dp = is_dtensor(grad)
        if on_dp and dp is None:
            raise ValueError("grad_norm: the gradients are DTensors sharded over dp (FSDP); pass the dp group")
        on_ep = getattr(p, "ep_dim", None) is not None and p.ep_partition.tp_size > 1
        if on_ep and (ep is None or ep.size != p.ep_partition.tp_size):
            raise ValueError(f"grad_norm: a parameter {tuple(p.shape)} holds experts split over "
                             f"{p.ep_partition.tp_size} ep ranks; pass that group as ep= (got {ep})")
        if getattr(p, "tp_dim", None) is None and tp.rank != 0:
            continue                                     # replicated over tp: counted on tp rank 0
        if data is not None and not (on_dp or on_ep) and data.rank != 0:
            continue                                     # replicated over the data axis: counted on its rank 0
        g = local_tensor(grad).float()
        part = getattr(p, "tp_partition", None)
        if part is not None and not part.is_disjoint:  # duplicated KV heads: count each on its owner only
            keep = torch.tensor(part.owner_mask(tp.rank), device=g.device)
            if on_dp and p.tp_dim == 0:  # this dp rank holds only some of the tp-local rows
                start, n = dp_rows(grad)
                keep = keep[start:start + n]
            g = g[keep] if p.tp_dim == 0 else g[:, keep]
        s = g.pow(2).sum()
        sq = s if sq is None else sq + s
    total = torch.zeros((), device=dev) if sq is None else sq
    for group in (tp, data, pp):
        if group is not None:
            total = comm.all_reduce(total, group)
    return total.sqrt()


def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float, tp: Group,
                    dp: Group | None = None, *, ep: Group | None = None, pp: Group | None = None) -> torch.Tensor:
    """Scale gradients in place so that :func:`grad_norm` is at most ``max_norm``; return the norm before.

    The same scale is applied on every rank (the norm has the same bits on every rank). ``dp``, ``ep``, ``pp``:
    as in :func:`grad_norm`.
    Raises ValueError if ``max_norm`` is not positive.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be positive, got {max_norm}")
    params = [p for p in params if p.grad is not None]
    total = grad_norm(params, tp, dp, ep=ep, pp=pp)
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


def all_reduce_grads(ps: list[torch.nn.Parameter], group: Group, divide: int = 1) -> None:
    """Sum the gradients of ``ps`` over ``group`` in one bucket (then ``/ divide``), in place; FSDP2 gradients by
    their local shards (the same rows on every rank of a group that is not the dp axis).

    Collectives: one all-reduce of every gradient's elements, concatenated."""
    grads = [local_tensor(p.grad) for p in ps]
    flat = comm.all_reduce(torch.cat([g.reshape(-1) for g in grads]), group)
    if divide != 1:
        flat = flat / divide
    off = 0
    for g in grads:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()
