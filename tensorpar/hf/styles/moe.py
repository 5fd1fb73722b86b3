"""The styles of mixture-of-experts layers: stacked experts split inside every expert, Qwen2-MoE's whole block.

:class:`MoEExperts` splits every expert over the expert intermediate size (gate/up rows column, down row; one
all-reduce per MoE layer after the combine); :class:`SharedExpertMoE` shards the routed and the shared experts
of a Qwen2-MoE block with one all-reduce.
"""
from __future__ import annotations

from dataclasses import dataclass

from tensorpar.hf.styles.base import Style, _linears
from tensorpar.shard import Partition


@dataclass
class MoEExperts(Style):
    """The stacked experts of a sparse MoE block, tensor-parallel inside every expert
    (:class:`~tensorpar.hf.modules.TPExperts`): each expert's gate/up rows column-parallel, its down
    projection row-parallel over ``partition`` (the expert intermediate size), one all-reduce per MoE layer
    after the routing-weighted combine. The router (``gate``) is a separate, replicated entry."""

    partition: Partition
    num_experts: int = 0
    name = "moe_experts"

    def apply(self, module, fqn, ctx):
        from tensorpar.hf.modules import TPExperts
        return TPExperts(module, ctx.tp, partition=self.partition)

    def keeps(self):
        return ("gate_up_proj", "down_proj", "*.**")  # child modules (the activation) are taken over whole

    def detail(self):
        return f"{self.num_experts} experts, intermediate {self.partition.n} -> {list(self.partition.sizes)} in each"

    def rows(self):
        return [("gate_up_proj", "column(gate|up)", "[E, 2f, h]: each rank's gate rows and up rows of every expert"),
                ("down_proj", "row", "[E, h, f]; all-reduce once after the combine")]


@dataclass
class SharedExpertMoE(Style):
    """Qwen2-MoE's whole sparse block (:class:`~tensorpar.hf.modules.TPSharedExpertMoE`): router and shared-expert
    gate replicated, routed experts split inside every expert over ``partition``, the shared expert column/row over
    ``shared``; routed and shared partial sums share one all-reduce."""

    partition: Partition
    shared: Partition
    num_experts: int = 0
    name = "moe_block"

    def apply(self, module, fqn, ctx):
        from tensorpar.hf.modules import TPSharedExpertMoE
        return TPSharedExpertMoE(module, ctx.tp, expert_partition=self.partition, shared_partition=self.shared)

    def keeps(self):
        return (("gate.**", "experts.gate_up_proj", "experts.down_proj", "experts.*.**", "shared_expert_gate.**")
                + _linears(*(f"shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj"))))

    def detail(self):
        return (f"{self.num_experts} experts, intermediate {self.partition.n} -> {list(self.partition.sizes)} in each; "
                f"shared expert {self.shared.n} -> {list(self.shared.sizes)}; one all-reduce")

    def rows(self):
        return [("gate", "replicated", "router: every rank routes every token"),
                ("experts.gate_up_proj", "column(gate|up)",
                 "[E, 2f, h]: each rank's gate rows and up rows of every expert"),
                ("experts.down_proj", "row", "[E, h, f], partial sum"),
                ("shared_expert.gate_proj", "column", ""), ("shared_expert.up_proj", "column", ""),
                ("shared_expert.down_proj", "row", "partial sum"),
                ("shared_expert_gate", "replicated", "sigmoid gate; routed + shared all-reduced once")]
