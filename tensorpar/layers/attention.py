"""Attention heads over tensor-parallel ranks, for any head count on any tp (grouped KV heads included).

Query heads are split near-evenly (:func:`tensorpar.shard.split_sizes`): with 9 heads on 2
ranks, rank 0 has heads 0-4 and rank 1 heads 5-8. Under grouped-query attention (Ainslie et
al. 2023) query head ``i`` reads KV head ``i // (num_heads / num_kv_heads)``; each rank holds
exactly the KV heads its query heads read, so a KV head whose group straddles two ranks is
duplicated on both, and when tp exceeds the number of KV heads every KV head is replicated on
the ranks that need it. The KV cache of a rank holds only those heads.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tensorpar.shard import Partition, UnitSelection


def tp_heads_error(tp_size: int, num_heads: int, name: str = "tp_size") -> str | None:
    """The rule of the tp degree against the query heads (:meth:`HeadLayout.make`; the launching process applies it
    before any rank starts, :func:`tensorpar.capacity.plan_for_model`): every rank needs at least one query head.
    ``None`` when ``tp_size <= num_heads``, else the line saying so, naming the degree as ``name`` (a flag such as
    ``--tp`` in the launching process)."""
    if tp_size <= num_heads:
        return None
    if name.startswith("--"):
        return (f"{name} {tp_size}: exceeds the model's {num_heads} attention heads (every rank needs at least one "
                f"query head; use {name} <= {num_heads})")
    return (f"{name} ({tp_size}) exceeds the number of attention heads ({num_heads}); every rank needs at least one "
            f"query head, so use {name} <= {num_heads}")


@dataclass(frozen=True)
class HeadLayout:
    """Which query and KV heads each tp rank computes.

    Attributes:
        num_heads, num_kv_heads, head_dim: global sizes.
        q_heads: :class:`Partition` of the query heads over ranks.
        kv_heads: :class:`UnitSelection` of the KV heads each rank holds (may overlap).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_heads: Partition
    kv_heads: UnitSelection

    @classmethod
    def make(cls, num_heads: int, num_kv_heads: int, head_dim: int, tp_size: int, *, split_weights=None) -> "HeadLayout":
        """Lay out the heads over ``tp_size`` ranks.

        Even split (``split_weights`` None): query heads as evenly as possible (``split_sizes``); a GQA group
        that straddles two ranks has its KV head on both. Weighted split: query heads in proportion to the
        weights in whole GQA groups (``unit`` = heads per KV head) when there are at least ``tp_size`` groups
        and every rank still gets one; otherwise in whole heads, as the even split.

        Raises:
            ValueError: ``tp_size > num_heads`` (naming both), or ``num_heads`` not a multiple of
                ``num_kv_heads``.
        """
        why = tp_heads_error(tp_size, num_heads)
        if why is not None:
            raise ValueError(why)
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads "
                             f"({num_kv_heads})")
        group = num_heads // num_kv_heads
        q = None
        if split_weights is not None and group > 1 and num_kv_heads >= tp_size:
            try:  # weighted: whole GQA groups per rank, so no KV head is held (and computed) by two ranks
                q = Partition.make(num_heads, tp_size, weights=split_weights, unit=group, name="num_attention_heads")
            except ValueError:  # too few groups for these weights: split the heads, a group may straddle two ranks
                q = None
        if q is None:
            q = Partition.make(num_heads, tp_size, weights=split_weights, name="num_attention_heads")
        units = []
        for r in range(tp_size):
            start, stop = q.range(r)
            units.append(tuple(sorted({h // group for h in range(start, stop)})))
        kv = UnitSelection(n_units=num_kv_heads, unit=1, units=tuple(units))
        return cls(num_heads, num_kv_heads, head_dim, q, kv)

    @property
    def tp_size(self) -> int:
        return self.q_heads.tp_size

    @property
    def q_rows(self) -> Partition:
        """Split of the ``num_heads * head_dim`` rows of the query projection."""
        return self.q_heads.scaled(self.head_dim)

    @property
    def kv_rows(self) -> UnitSelection:
        """Selection of the ``num_kv_heads * head_dim`` rows of the key/value projections."""
        return UnitSelection(self.num_kv_heads, self.head_dim, self.kv_heads.units)

    def local_heads(self, rank: int) -> int:
        return self.q_heads.sizes[rank]

    def local_kv_heads(self, rank: int) -> int:
        return len(self.kv_heads.units[rank])

    def kv_index(self, rank: int) -> list[int]:
        """For each local query head, the index of its KV head among the rank's local KV heads."""
        group = self.num_heads // self.num_kv_heads
        start, stop = self.q_heads.range(rank)
        local = {h: i for i, h in enumerate(self.kv_heads.units[rank])}
        return [local[h // group] for h in range(start, stop)]

    def uniform_group(self, rank: int) -> int | None:
        """``g`` if local query heads read local KV heads in equal consecutive groups of ``g``
        (then attention kernels can broadcast KV heads instead of copying them), else ``None``."""
        idx = self.kv_index(rank)
        n_kv = self.local_kv_heads(rank)
        if len(idx) % n_kv:
            return None
        g = len(idx) // n_kv
        return g if idx == [i // g for i in range(len(idx))] else None

    def expand_kv(self, kv: torch.Tensor, rank: int) -> torch.Tensor:
        """``[b, kv_local, s, d] -> [b, q_local, s, d]``: give each local query head its KV head."""
        idx = self.kv_index(rank)
        if idx == list(range(kv.shape[1])):
            return kv
        return kv.index_select(1, torch.tensor(idx, device=kv.device))

    def describe(self) -> str:
        rows = []
        for r in range(self.tp_size):
            s, e = self.q_heads.range(r)
            rows.append(f"rank {r}: q heads {s}-{e - 1} ({e - s}), kv heads {list(self.kv_heads.units[r])}")
        return "; ".join(rows)
