"""Shard math: how a tensor dimension of size ``n`` is divided over ``tp_size`` ranks.

Pure functions and one small frozen dataclass; nothing here needs a process group.

Order of a near-even split: when ``n`` is not divisible by ``tp_size``, the first
``n % tp_size`` ranks get one extra row, so sizes differ by at most one and are
non-increasing with rank (``split_sizes(7, 2) == [4, 3]``).

Weighted split (heterogeneous devices): rank ``r`` gets ``n * w_r / sum(w)`` rows,
rounded by the largest-remainder method (ties to the lower rank), so the sizes sum to ``n``
exactly. ``weights=[2, 1]`` gives rank 0 twice the rows of rank 1.

Units: with ``unit=u`` the split is computed over ``n / u`` whole units (an attention head of
``head_dim`` rows, say) and then scaled back, so no unit is ever cut.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence


def _check_weights(weights: Sequence[float], tp_size: int, what: str) -> list[Fraction]:
    if len(weights) != tp_size:
        raise ValueError(
            f"{what}: split weights {list(weights)} have {len(weights)} entries but tp_size is {tp_size}; "
            f"give one positive weight per tensor-parallel rank"
        )
    fr = []
    for w in weights:
        if not (w > 0):
            raise ValueError(f"{what}: split weights {list(weights)} must all be positive (got {w})")
        fr.append(Fraction(w).limit_denominator(1 << 20))
    return fr


def _largest_remainder(units: int, fr: Sequence[Fraction]) -> list[int]:
    """``units`` split in proportion to ``fr`` by the largest-remainder method, ties to the lower rank (may hold 0)."""
    total = sum(fr)
    exact = [units * w / total for w in fr]
    sizes = [int(e) for e in exact]  # floor
    short = units - sum(sizes)
    order = sorted(range(len(fr)), key=lambda r: (-(exact[r] - sizes[r]), r))
    for r in order[:short]:
        sizes[r] += 1
    return sizes


def split_sizes(
    n: int,
    tp_size: int,
    *,
    weights: Sequence[float] | None = None,
    unit: int = 1,
    name: str = "dimension",
) -> list[int]:
    """Sizes of the ``tp_size`` shards of a dimension of ``n`` elements.

    Args:
        n: global size of the dimension (rows of a weight, vocabulary entries, heads x head_dim).
        tp_size: number of tensor-parallel ranks.
        weights: optional relative speeds, one per rank; ``None`` splits evenly (near-evenly).
        unit: indivisible block size; every shard is a multiple of ``unit``.
        name: what the dimension is, used in error messages (e.g. ``"vocab_size"``).

    Returns:
        list of ``tp_size`` non-negative ints summing to ``n``; each shard is at least one unit.

    Raises:
        ValueError: ``n`` is not a multiple of ``unit``; there are fewer units than ranks
            (e.g. 5 rows over 8 ranks); weights of the wrong length or non-positive; a weighted
            split that would leave a rank with no unit.
    """
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if unit < 1 or n % unit:
        raise ValueError(f"{name} ({n}) must be a multiple of its unit ({unit}) to be split without cutting a unit")
    units = n // unit
    if units < tp_size:
        what = f"{units} units of {unit}" if unit > 1 else f"{n}"
        raise ValueError(
            f"cannot split {name} of size {what} over tp_size={tp_size} ranks: every rank needs at least one "
            f"{'unit' if unit > 1 else 'row'}; use tp_size <= {units}"
        )
    if weights is None:
        base, extra = divmod(units, tp_size)
        sizes = [base + (1 if r < extra else 0) for r in range(tp_size)]
    else:
        sizes = _largest_remainder(units, _check_weights(weights, tp_size, name))
        if min(sizes) == 0:
            raise ValueError(
                f"split weights {list(weights)} leave a rank with no part of {name} ({units} units over "
                f"tp_size={tp_size}); use weights no more skewed than "
                f"{','.join(f'{v:g}' for v in feasible_weights(weights, units))} or a smaller tp_size"
            )
    return [s * unit for s in sizes]


def feasible_weights(weights: Sequence[float], units: int) -> tuple[float, ...]:
    """The weights closest to ``weights`` that leave every rank at least one of ``units`` units: the smaller
    weights are raised until each share is at least ``1 / units`` (then rounded up to 2 significant digits).
    Used to say what would work when a split is refused, and to keep ``auto`` weights usable."""
    w = [float(x) for x in weights]
    if units < len(w):
        return tuple(w)
    m = sum(w) / units
    for _ in range(100):  # fixed point of m = sum(max(w, m)) / units (converges: units > number of clamped)
        m2 = sum(max(x, m) for x in w) / units
        if abs(m2 - m) <= 1e-12 * m2:
            break
        m = m2
    out = []
    for x in w:
        if x >= m:
            out.append(x)
        else:
            digits = 1 - int(math.floor(math.log10(m)))
            out.append(math.ceil(m * 10 ** digits) / 10 ** digits)
    for _ in range(8):  # rounding can still leave a rank at zero: nudge the smallest up until every rank has one
        if min(_largest_remainder(units, [Fraction(x).limit_denominator(1 << 20) for x in out])) > 0:
            break
        lo = min(range(len(out)), key=lambda r: out[r])
        out[lo] = out[lo] * 1.1
    return tuple(float(f"{x:.3g}") for x in out)


@dataclass(frozen=True)
class Partition:
    """The division of one dimension over the ranks of a tensor-parallel group.

    ``sizes[r]`` elements belong to rank ``r``, starting at ``offsets[r]``; ``n = sum(sizes)``.
    """

    sizes: tuple[int, ...]

    @classmethod
    def make(
        cls, n: int, tp_size: int, *, weights: Sequence[float] | None = None, unit: int = 1, name: str = "dimension"
    ) -> "Partition":
        """Build with :func:`split_sizes` (same arguments, same errors)."""
        return cls(tuple(split_sizes(n, tp_size, weights=weights, unit=unit, name=name)))

    @property
    def n(self) -> int:
        return sum(self.sizes)

    @property
    def tp_size(self) -> int:
        return len(self.sizes)

    @property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for s in self.sizes:
            out.append(acc)
            acc += s
        return tuple(out)

    @property
    def is_even(self) -> bool:
        return len(set(self.sizes)) == 1

    def range(self, rank: int) -> tuple[int, int]:
        """Half-open global index range ``[start, stop)`` owned by ``rank``."""
        start = self.offsets[rank]
        return start, start + self.sizes[rank]

    def scaled(self, factor: int) -> "Partition":
        """The same split of units, each unit ``factor`` times larger (heads -> rows)."""
        return Partition(tuple(s * factor for s in self.sizes))

    def indices(self, rank: int) -> list[int]:
        """Global indices along the split dim held by ``rank`` (a contiguous range)."""
        return list(range(*self.range(rank)))

    @property
    def is_disjoint(self) -> bool:
        return True

    def owner_mask(self, rank: int) -> list[bool]:
        """Every row of a disjoint split is owned by the rank that holds it."""
        return [True] * self.sizes[rank]


@dataclass(frozen=True)
class UnitSelection:
    """A dimension of ``n_units`` blocks of ``unit`` rows, of which each rank holds a chosen list.

    Unlike :class:`Partition`, the selections may overlap: grouped-query attention duplicates a
    KV head on every rank whose query heads use it. ``units[r]`` lists rank ``r``'s global unit
    indices in increasing order. The *owner* of a unit is the lowest rank that holds it; norms
    and checkpoints count a unit only on its owner.
    """

    n_units: int
    unit: int
    units: tuple[tuple[int, ...], ...]

    @property
    def n(self) -> int:
        return self.n_units * self.unit

    @property
    def tp_size(self) -> int:
        return len(self.units)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(len(u) * self.unit for u in self.units)

    @property
    def is_disjoint(self) -> bool:
        flat = [u for us in self.units for u in us]
        return len(flat) == len(set(flat))

    def indices(self, rank: int) -> list[int]:
        return [u * self.unit + i for u in self.units[rank] for i in range(self.unit)]

    def owner_mask(self, rank: int) -> list[bool]:
        """Per local row: does ``rank`` own it (is it the lowest rank holding that unit)?"""
        first = {}
        for r, us in enumerate(self.units):
            for u in us:
                first.setdefault(u, r)
        return [first[u] == rank for u in self.units[rank] for _ in range(self.unit)]


def pipeline_chunks(num_layers: int, pp: int, virtual: int = 1) -> list[tuple[int, int]]:
    """Half-open layer ranges of the ``pp * virtual`` pipeline chunks, in model order.

    The one stage-balancing rule of the runtime (:mod:`tensorpar.pipeline.stages`) and the planner
    (:func:`tensorpar.planner.partition.stage_layers`): chunk sizes differ by at most one, the larger chunks
    last (the first stage also holds the embedding); pipeline rank ``i`` holds chunks ``i, i + pp, ...``
    (the interleaved assignment of Narayanan et al. 2021, Sec. 2.2.2).

    Raises:
        ValueError: more chunks than layers, naming pp, virtual and num_layers and the largest pp that works.
    """
    chunks = pp * virtual
    if chunks > num_layers:
        fix = (f"use pp <= {num_layers // virtual}" if num_layers // virtual >= 2 or virtual == 1 else
               "use a schedule without interleaving (1f1b or gpipe) or a model with more layers")
        raise ValueError(f"pp x virtual stages ({pp} x {virtual} = {chunks}) exceeds the model's {num_layers} layers; "
                         f"every pipeline stage needs at least one layer: {fix}")
    sizes = split_sizes(num_layers, chunks)[::-1]
    out, start = [], 0
    for s in sizes:
        out.append((start, start + s))
        start += s
    return out


#: ``tp_weights`` value that asks every rank to time a matmul at start-up (:mod:`tensorpar.capacity`)
AUTO = "auto"


def check_tp_weights(weights, tp_size: int, *, what: str = "tp_weights"):
    """Normalise and check ``weights`` for ``tp_size`` ranks: ``None``, ``"auto"``, or one positive finite number
    per rank (a sequence or a comma-separated string such as ``"3,1"``).

    Returns ``None``, ``"auto"`` or a tuple of floats.

    Raises:
        ValueError: text that is not numbers, a count other than ``tp_size``, a weight that is zero, negative,
            infinite or NaN; the message names the weights and what would work.
    """
    if weights is None:
        return None
    if isinstance(weights, str):
        text = weights.strip()
        if text.lower() == AUTO:
            return AUTO
        try:
            weights = [float(x) for x in text.split(",")]
        except ValueError:
            raise ValueError(f"{what} {text!r}: give one positive number per tp rank separated by commas "
                             f"(e.g. {','.join(['1'] * max(tp_size, 1))}) or 'auto'") from None
    try:
        vals = tuple(float(w) for w in weights)
    except (TypeError, ValueError):
        raise ValueError(f"{what} {weights!r}: give one positive number per tp rank or 'auto'") from None
    shown = ",".join(f"{v:g}" for v in vals)
    if len(vals) != tp_size:
        raise ValueError(f"{what} {shown} has {len(vals)} entries but tp is {tp_size}; give one positive weight per "
                         f"tensor-parallel rank (e.g. {','.join(['1'] * tp_size)}) or 'auto'")
    bad = [v for v in vals if not (math.isfinite(v) and v > 0)]
    if bad:
        raise ValueError(f"{what} {shown}: every weight must be a positive finite number (got {bad[0]:g}); a rank "
                         f"that should do less work gets a smaller positive weight")
    return vals
