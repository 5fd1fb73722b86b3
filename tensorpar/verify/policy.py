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


#: ``--quantize int8``: a compared value may differ from the int8 reference by this many times the int8 noise of the
#: value (its largest difference between the int8 and the unquantized reference), on top of the fp bound; the
#: derivation is :func:`q8_tolerance`'s
Q8_MARGIN = 4.0


def q8_tolerance(fp_tol: float, noise: float) -> float:
    """The tolerance of a value of a ``--quantize int8`` model against the int8 reference: ``fp_tol`` (the fp rule,
    :func:`~tensorpar.verify.policy.tolerance`) plus ``Q8_MARGIN * noise``, ``noise`` being ``max|Q - F|`` of that
    value: ``Q`` the int8 reference's, ``F`` the unquantized reference's (same weights before quantizing, same
    input).

    Derivation. The sharded model ``P`` and the reference ``Q`` compute the same quantized math: the same Q8_0
    weights (a block of 32 never spans two ranks, :func:`tensorpar.decode.int8.block_misfit`, so each rank holds
    exactly its slice of ``Q``'s rounded weights, and the row-parallel inputs are cut at block boundaries) and the
    same activation quantization (``d = max|x_block| / 127``, ``round(x / d)``) of each matmul's input; only the
    order of the fp32 sums differs. If that were all, the fp rule would hold. But every activation quantizer
    re-rounds: an element whose ``x / d`` lies within the fp32 difference of a half step rounds to the other
    neighbour on one side, a change of one whole step ``d``, against a rounding error of at most ``d / 2`` (Q8_0's
    half step; a weight's is ``max|w_block| / 254``). Its effect downstream cannot be bounded from the step alone:
    the worst case, all of a matmul's ``K`` inputs moving a step the same way, is ``sum_j d_j |w_ij|``, about
    ``sqrt(K)`` times the typical effect and a large fraction of the output (the bound this replaced, 2/127 of the
    value's scale per block passed, reached half the logits' scale at 30 blocks and passed results that wrong).
    Instead: each of ``P`` and ``Q`` rounds every activation of the same fp computation to one of the same two
    neighbouring steps (``P`` deep in a model: of values already moved by earlier re-roundings, which in the limit
    makes its rounding errors independent of ``Q``'s), so to first order ``P - F`` and ``Q - F`` are the network's
    response to per-element rounding errors of the same size and distribution, and
    ``|P - Q| <= |P - F| + |Q - F| ~ 2 max|Q - F|``; a factor 2 more for the largest of ``P``'s errors against the
    largest of ``Q``'s (sample maxima of one distribution) gives ``Q8_MARGIN = 4``. Where nothing re-rounds (the
    embedding, shallow values of a small model) ``P - Q`` is at the fp rule's size, far below this. A sharding or
    quantization fault of one block (a scale off by 2x) moves an output by that block's whole contribution,
    ``~sqrt(32) |w| |x|``, against an activation rounding error of ``~sqrt(K / 12) d |w|`` for the whole row.
    Measured (CPU, PyTorch int8 path): the test llama of tests/decode/test_quant.py at tp 1 and 2 passes with every
    row at <= 0.06 of this tolerance, and one scale doubled (its LM head's, its last down_proj's) fails at 2.2-3.0x
    it; SmolLM2 at tp 1 and 2 passes, worst row 0.36 of it (tp=2, layer 28's attention: 1.67 against 4.64, i.e.
    1.44 times its noise, near the sqrt(2) of independent roundings), logits 1.14 against 8.19 (noise 2.04 on
    logits up to 34.6; the bound this replaced allowed 17.4)."""
    return fp_tol + Q8_MARGIN * noise


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
