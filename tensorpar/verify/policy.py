"""The tolerance rule of ``tensorpar verify`` and the records held to it.

:func:`tolerance` is the largest difference sharding may cause in a compared value (the rule and its derivation
are in the docstring of :mod:`tensorpar.verify`: reordered fp32 sums, the compute dtype's rounding before the
all-reduce, growing with the depth); :class:`ModuleDiff` is one compared value against its tolerance and
:class:`LayoutReport` every comparison of one sharded layout.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch


SAFETY = 8.0


U_ACC = 2.0 ** -24  # fp32 accumulation (CPU and CUDA matmuls accumulate low-precision inputs in fp32)


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the machine epsilon of ``dtype`` (``2^-24`` for float32, ``2^-8`` for bfloat16)."""
    return torch.finfo(dtype).eps / 2


def tolerance(dtype: torch.dtype, reduction_len: int, depth: int, tp_size: int, scale: float, *,
              relative: bool = False) -> float:
    """The largest difference sharding may cause (the rule of the module docstring).

    Args:
        dtype: compute dtype. reduction_len: ``K``, the longest sum of the model. depth: blocks passed before
        the compared value (0 for the embedding). tp_size: ranks. scale: ``max|reference|`` of the value.
        relative: hold the value to ``scale`` itself rather than ``max(1, scale)`` (a module's own computation,
            where no upstream error of absolute size feeds in).
    """
    per = U_ACC * math.sqrt(max(reduction_len, 1)) + unit_roundoff(dtype) * math.sqrt(tp_size)
    return SAFETY * per * (depth + 1) * (scale if relative else max(1.0, scale))


@dataclass
class ModuleDiff:
    """One compared value: module (or ``loss``, ``grad <param>``, ...), its block (None outside blocks), kind,
    the largest absolute difference over ranks, and the tolerance."""

    name: str
    layer: int | None
    kind: str
    max_abs: float
    tol: float

    @property
    def ok(self) -> bool:
        return self.max_abs <= self.tol  # NaN is never ok


@dataclass
class LayoutReport:
    """Every comparison of one sharded layout, in execution order (forward, then gradients).

    ``replicated_mismatch``: tp-replicated parameters whose gradient is not bit-identical on every rank."""

    tp_size: int
    sequence_parallel: bool
    dtype: str
    diffs: list[ModuleDiff] = field(default_factory=list)
    replicated_mismatch: list[str] = field(default_factory=list)

    @property
    def first_failure(self) -> ModuleDiff | None:
        return next((d for d in self.diffs if not d.ok), None)

    @property
    def ok(self) -> bool:
        return self.first_failure is None and not self.replicated_mismatch

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        for x, y in zip(d["diffs"], self.diffs):
            x["ok"] = y.ok
        return d
