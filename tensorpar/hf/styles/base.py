"""The base of the sharding styles, the plan's row, and the styles that keep or split a whole tensor.

:class:`Style` (what a style applies, keeps and prints), :class:`ApplyContext` (the tp group, the model, the
plan), :class:`Entry` (one plan row: a module pattern and its style); :class:`Replicated`,
:class:`VocabEmbedding`, :class:`LMHead` and :class:`SequenceParallelEntry` (the first block's sequence split).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from tensorpar.comm import Group
from tensorpar.shard import Partition


@dataclass(frozen=True)
class ApplyContext:
    """What a style needs besides its module: the tp group, the whole model (for ties), the plan."""

    tp: Group
    root: nn.Module
    plan: object


def _linears(*names: str) -> tuple[str, ...]:
    """``weight`` and ``bias`` of each named linear (what ``*ParallelLinear.from_linear`` carries over), also as the
    base layer of a PEFT LoRA layer with its adapter matrices (:mod:`tensorpar.layers.lora`)."""
    return tuple(f"{n}.{t}" for n in names for t in ("weight", "bias", "base_layer.weight", "base_layer.bias",
                                                     "lora_A.*.weight", "lora_B.*.weight"))


class Style:
    """Base class. Subclasses set ``name`` and implement :meth:`apply`; ``rows`` adds printed sub-rows."""

    name = "style"
    #: whether the style owns everything below its module; a wrapper (the sequence-parallel entry) does not,
    #: and the entries of its submodules still apply.
    claims = True

    def apply(self, module: nn.Module, fqn: str, ctx: ApplyContext) -> nn.Module:
        """Return the module that replaces ``module`` (may be ``module`` itself, modified in place)."""
        raise NotImplementedError

    def keeps(self) -> tuple[str, ...] | None:
        """The parameters and buffers below the module that :meth:`apply` carries over, as names relative to the
        module (``*``: one name segment, ``**``: any rest), or None when the module is kept whole. Any other
        tensor below the module would be lost, so :meth:`~tensorpar.hf.plan.ShardingPlan.check` refuses it."""
        return None

    def detail(self) -> str:
        return ""

    def rows(self) -> list[tuple[str, str, str]]:
        """Printed sub-rows ``(suffix, label, detail)`` for the submodules this style shards."""
        return []

    def __str__(self) -> str:
        d = self.detail()
        return f"{self.name}  {d}".rstrip()


@dataclass
class Replicated(Style):
    """Keep the module; its parameters are the same on every rank.

    ``sequence_parallel``: the module runs on a sequence shard (norms between blocks), so each rank's
    gradient is a partial sum: its parameters are marked and summed over tp after backward
    (:func:`tensorpar.grads.sync_sequence_parallel_grads`).
    """

    sequence_parallel: bool = False
    why: str = ""
    name = "replicated"

    def apply(self, module, fqn, ctx):
        if self.sequence_parallel:
            from tensorpar.layers.linear import mark_sequence_parallel
            for p in module.parameters():
                mark_sequence_parallel(p)
        return module

    def detail(self):
        return "sequence-parallel: grads summed over tp" if self.sequence_parallel else self.why


@dataclass
class VocabEmbedding(Style):
    """Embedding rows split by vocabulary; keeps an ``embed_scale`` (Gemma's scaled embedding)."""

    partition: Partition
    name = "vocab_embedding"

    def apply(self, module, fqn, ctx):
        from tensorpar.layers.embedding import VocabParallelEmbedding
        return VocabParallelEmbedding.from_embedding(module, ctx.tp, partition=self.partition)

    def keeps(self):
        return ("weight", "embed_scale")  # Gemma's scaled embedding keeps its scale

    def detail(self):
        return f"vocab {self.partition.n} -> {list(self.partition.sizes)}"


@dataclass
class LMHead(Style):
    """Column-parallel over the vocabulary; the logits stay sharded ``[b, s, V_r]`` for the vocab-parallel loss.

    ``tied_to``: the embedding's module name when the weights are tied (the head then shares its parameter).
    """

    partition: Partition
    tied_to: str | None = None
    sequence_parallel: bool = False
    name = "lm_head"

    def apply(self, module, fqn, ctx):
        from tensorpar.layers.linear import ColumnParallelLinear
        head = ColumnParallelLinear.from_linear(module, ctx.tp, partition=self.partition,
                                                sequence_parallel=self.sequence_parallel)
        if self.tied_to is not None:
            head.weight = ctx.root.get_submodule(self.tied_to).weight
        return head

    def keeps(self):
        return ("weight", "bias")

    def detail(self):
        return f"vocab {self.partition.n} -> {list(self.partition.sizes)}" + (
            f", tied to {self.tied_to}" if self.tied_to else "")


@dataclass
class Entry:
    """One row of a plan: a module-name pattern (``*`` = one name segment, e.g. a layer index) and its style."""

    pattern: str
    style: Style
    notes: list[str] = field(default_factory=list)


@dataclass
class SequenceParallelEntry(Style):
    """The first decoder block splits its input along the sequence (sequence parallelism only).

    Forward split ``[b, s, h] -> [b, s_r, h]`` (no communication), backward all-gather; the block's
    ``forward`` is wrapped on the instance (:func:`tensorpar.hf.modules.sequence_parallel_entry`).
    """

    name = "sp_entry"
    claims = False

    def apply(self, module, fqn, ctx):
        from tensorpar.hf.modules import sequence_parallel_entry
        sequence_parallel_entry(module, ctx.tp)
        return module

    def detail(self):
        return "split sequence before the first block"
