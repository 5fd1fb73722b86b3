"""Which part of the vocabulary a rank's logits cover: one resolver for every function that takes sharded logits.

Functions on vocabulary-sharded logits (:func:`~tensorpar.layers.vocab_parallel_cross_entropy`,
:func:`~tensorpar.layers.vocab_parallel_log_softmax`, ...) must know where this rank's slice starts and how
large the whole vocabulary is; guessing it from the slice width is wrong whenever tp does not divide the
vocabulary (37 over 2 ranks is [19, 18]). So the partition is always given, in one of these forms:

* a :class:`~tensorpar.shard.Partition` (e.g. ``plan.vocab``);
* an ``int``: the global vocabulary size, split near-evenly as plans and layers split it by default;
* the layer or model that produced the logits: anything with a ``partition`` attribute (a
  :class:`~tensorpar.layers.ColumnParallelLinear` LM head), a ``vocab`` attribute (a sharding plan) or a
  ``tensorpar_plan`` attribute (a model sharded by :func:`tensorpar.hf.apply.parallelize`).

:func:`check_local_width` then refuses logits whose last dim is not this rank's slice, naming both widths and
saying what went wrong when the width is the full vocabulary (logits gathered already).
"""
from __future__ import annotations

from tensorpar.comm import Group
from tensorpar.shard import Partition


def resolve_vocab_partition(spec, tp: Group) -> Partition:
    """The vocabulary :class:`Partition` described by ``spec`` (see the module docstring) over ``tp``.

    Raises:
        TypeError: ``spec`` is none of the accepted forms.
        ValueError: the partition is for another tp size than ``tp``'s.
    """
    part = spec
    if isinstance(spec, bool):
        raise TypeError(f"vocab partition must be a Partition, an int or a sharded layer/model, got {spec!r}")
    if isinstance(spec, int):
        part = Partition.make(spec, tp.size, name="vocab_size")
    elif not isinstance(spec, Partition):
        for attr in ("tensorpar_plan", "vocab", "partition"):
            if hasattr(spec, attr):
                part = getattr(spec, attr)
                part = getattr(part, "vocab", part)  # tensorpar_plan -> plan.vocab
                break
    if not isinstance(part, Partition):
        raise TypeError(f"vocab partition must be a Partition, an int (the global vocab size) or the sharded "
                        f"layer/model that produced the logits, got {type(spec).__name__}")
    if part.tp_size != tp.size:
        raise ValueError(f"the vocab partition {list(part.sizes)} is for tp_size={part.tp_size}, but the tp group "
                         f"has {tp.size} ranks")
    return part


def check_local_width(width: int, part: Partition, tp: Group, what: str = "logits") -> tuple[int, int]:
    """Check that ``width`` (the logits' last dim) is tp rank's slice of ``part``; return ``(start, stop)``.

    Raises:
        ValueError: naming both widths; when ``width`` is the full vocabulary at tp > 1, saying that the
            logits were gathered already (their loss would be off by exactly ``ln(tp)``).
    """
    start, stop = part.range(tp.rank)
    if width == stop - start:
        return start, stop
    if width == part.n and tp.size > 1:
        raise ValueError(f"{what} have the full vocabulary ({width} entries) on tp rank {tp.rank}, but this rank's "
                         f"slice is {stop - start} entries [{start}, {stop}); pass the rank's own (not gathered) "
                         f"logits, or use torch.nn.functional on gathered logits")
    raise ValueError(f"{what} have {width} vocabulary entries on tp rank {tp.rank}, but the vocab partition "
                     f"{list(part.sizes)} gives this rank {stop - start} entries [{start}, {stop})")
