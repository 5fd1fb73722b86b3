"""The checkpoint format's names and geometry: the folder and file names, the format versions, the
:class:`CheckpointError`, and how a rank's tp-local tensor maps to boxes (:class:`Piece`) of the full (tp = 1)
tensor that is stored (:func:`pieces`, :func:`full_shape`), plus :func:`full_tensor`, which gathers a full tensor
over tp (tests, export; never used by saving).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from tensorpar import comm
from tensorpar.comm import Group
from tensorpar.shard import Partition, UnitSelection

FORMAT = "tensorpar-train-v2"
FORMAT_V1 = "tensorpar-train-v1"   # full-shape files written by rank 0 (still loaded)
FORMATS = (FORMAT, FORMAT_V1)
MODEL_DIR = "model"
OPTIM_DIR = "optimizer"
MODEL_FILE = "model.safetensors"              # v1 only
OPTIM_FILE = "optimizer/state.safetensors"    # v1 only
STATE_FILE = "trainer_state.json"
LATEST = "latest"
OPTIM_KEYS = ("exp_avg", "exp_avg_sq")
TMP_PREFIX = ".tmp-step_"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (the previous one is intact) or is not a tensorpar checkpoint."""


def full_tensor(t: torch.Tensor, param: nn.Parameter, tp: Group) -> torch.Tensor:
    """The full-shape tensor of which ``t`` is this rank's slice laid out like ``param`` (tests, export).

    Shapes: ``t`` has ``param``'s local shape; the result has ``tp_partition.n`` along ``tp_dim``
    (a replicated tensor is returned as is). Collectives: one all-gather over tp for a sharded tensor.
    Checkpoint saving never calls it.
    """
    dim = getattr(param, "tp_dim", None)
    if dim is None or tp.size == 1:
        return t.detach()
    part = param.tp_partition
    gathered = comm.all_gather(t.detach().contiguous(), tp, dim=dim, sizes=part.sizes)
    if isinstance(part, Partition):  # contiguous ranges in rank order: the gather is the full tensor
        return gathered
    shape = list(t.shape)
    shape[dim] = part.n
    full = t.new_empty(shape)
    offset = 0
    for r in range(tp.size):
        idx, own = part.indices(r), part.owner_mask(r)
        rows = gathered.narrow(dim, offset, len(idx))
        offset += len(idx)
        keep = [i for i, o in enumerate(own) if o]
        if keep:
            sel = torch.tensor(keep, device=t.device)
            full.index_copy_(dim, torch.tensor(idx, device=t.device)[sel], rows.index_select(dim, sel))
    return full


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The tp = 1 shape of a (possibly tp-sharded) parameter: its local shape with ``tp_partition.n`` along
    ``tp_dim``, and with ``ep_partition.n`` along ``ep_dim`` for experts split over ep
    (:class:`tensorpar.hf.modules.EPExperts`)."""
    shape = list(param.shape)
    dim = getattr(param, "tp_dim", None)
    part = getattr(param, "tp_partition", None)
    if dim is not None and part is not None:
        shape[dim] = part.n
    if getattr(param, "ep_dim", None) is not None:
        shape[param.ep_dim] = param.ep_partition.n
    return tuple(shape)


@dataclass(frozen=True)
class Piece:
    """A box of a full tensor that lives in ``tensor`` (a view of this rank's local tensor).

    ``key``: the stored name; ``offsets``: where ``tensor`` starts in the full tensor of shape ``size``.
    """

    key: str
    tensor: torch.Tensor
    offsets: tuple[int, ...]
    size: tuple[int, ...]


def pieces(key: str, t: torch.Tensor, param: torch.Tensor, tp_rank: int, *, owned: bool,
           ep_rank: int = 0) -> list[Piece]:
    """The boxes of the full tensor ``key`` that ``t`` (laid out like ``param`` on tp rank ``tp_rank``) holds.

    Experts split over ep (``ep_dim``/``ep_partition``, :class:`tensorpar.hf.modules.EPExperts`) are this
    rank's experts: at ep alone their ``tp_partition`` is the ep split (read at ``ep_rank``); under tp x ep the
    tp runs are shifted along ``ep_dim`` to ``ep_rank``'s first expert. Every ep rank owns its experts.

    ``owned``: only the rows this rank owns (saving: every element once over tp: a replicated tensor on tp
    rank 0, a duplicated KV unit on its lowest holding rank); else every row it holds (loading). Rows that are
    consecutive both in ``t`` and in the full tensor form one piece, so a :class:`Partition` gives one piece and
    a fused ``[q|k|v]`` selection one per block.
    """
    size = full_shape(param)
    dim = getattr(param, "tp_dim", None)
    part = getattr(param, "tp_partition", None)
    ep_dim = getattr(param, "ep_dim", None)
    if ep_dim is not None and part is param.ep_partition:   # ep alone: the tp attributes are the ep split
        tp_rank = ep_rank
    elif ep_dim is not None:                                  # tp x ep: tp runs within this rank's experts
        shift = param.ep_partition.offsets[ep_rank]
        return [Piece(key, pc.tensor, tuple(o + shift if d == ep_dim else o for d, o in enumerate(pc.offsets)),
                      size)
                for pc in pieces(key, t, _NoEp(param), tp_rank, owned=owned)]
    if dim is None or part is None:
        if owned and tp_rank != 0:
            return []
        return [Piece(key, t, (0,) * t.dim(), size)]
    if isinstance(part, Partition):  # one contiguous range, owned by its only holder
        runs = [(0, part.offsets[tp_rank], part.sizes[tp_rank])]
    elif isinstance(part, UnitSelection):  # walk its units (heads, not rows); owner: the lowest holding rank
        first: dict[int, int] = {}
        for r, us in enumerate(part.units):
            for u in us:
                first.setdefault(u, r)
        runs = []  # (local row, global row, rows)
        for i, u in enumerate(part.units[tp_rank]):
            if owned and first[u] != tp_rank:
                continue
            lo, go = i * part.unit, u * part.unit
            if runs and runs[-1][0] + runs[-1][2] == lo and runs[-1][1] + runs[-1][2] == go:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + part.unit)
            else:
                runs.append((lo, go, part.unit))
    else:
        raise TypeError(f"{key}: tp_partition of type {type(part).__name__} cannot be checkpointed; expected a "
                        f"Partition or a UnitSelection")
    out = []
    for lo, go, n in runs:
        off = [0] * t.dim()
        off[dim] = go
        out.append(Piece(key, t.narrow(dim, lo, n), tuple(off), size))
    return out


class _NoEp:
    """``param``'s tp layout without its ep split (its local shape along ``ep_dim``): for :func:`pieces`."""

    def __init__(self, param):
        self.shape, self.tp_dim, self.tp_partition = param.shape, param.tp_dim, param.tp_partition


def _shape(s) -> str:
    return "(" + ", ".join(str(int(x)) for x in s) + ("," if len(s) == 1 else "") + ")"
