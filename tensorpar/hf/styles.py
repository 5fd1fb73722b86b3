"""Sharding styles: each knows how to shard one module in place, what it claims, and how it prints.

A :class:`~tensorpar.hf.plan.ShardingPlan` maps module-name patterns to these objects, and
:func:`tensorpar.hf.apply.parallelize` does nothing but call :meth:`Style.apply` on every module whose name
matches (the printed plan is the plan that runs, as torchtitan's ``parallelize_module`` plans are). A style
claims every parameter and buffer below the module it is applied to; a plan whose entries leave some
parameter of the model unclaimed is refused when it is made. A style that builds a new module names the
tensors it carries over (:meth:`Style.keeps`); a module holding any other tensor (an extra per-head parameter,
a LoRA adapter wrapped around a projection) is refused at plan time, naming it, instead of losing it.

========================  =====================================================================================
style                     what it does (collectives: forward / backward)
========================  =====================================================================================
``VocabEmbedding``        :class:`~tensorpar.layers.VocabParallelEmbedding`, rows = vocabulary (all-reduce / -)
``Attention``             :class:`~tensorpar.hf.modules.TPAttention`: query heads split, KV heads per rank
                          (HeadLayout); separate or fused q/k/v projections (copy / all-reduce at entry,
                          all-reduce / - at the output projection)
``GatedMLP``, ``MLP``     column, (column,) row over the intermediate dim (all-reduce at the output / at entry)
``Conv1DAttention``       GPT-2's fused ``c_attn`` (each rank's q, k and v heads) and ``c_proj``
``LMHead``                column-parallel over the vocabulary, logits stay sharded; may be tied
``MoEExperts``            stacked MoE experts split inside every expert (gate/up rows column, down row); one
                          all-reduce per MoE layer after the combine (:class:`~tensorpar.hf.modules.TPExperts`)
``SharedExpertMoE``       Qwen2-MoE's whole block: routed + shared experts, one all-reduce
``Replicated``            left as is; under sequence parallelism its gradients are summed over tp
========================  =====================================================================================
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from tensorpar.comm import Group
from tensorpar.layers.attention import HeadLayout
from tensorpar.shard import Partition


@dataclass(frozen=True)
class ApplyContext:
    """What a style needs besides its module: the tp group, the whole model (for ties), the plan."""

    tp: Group
    root: nn.Module
    plan: object


def _linears(*names: str) -> tuple[str, ...]:
    """``weight`` and ``bias`` of each named linear (what ``*ParallelLinear.from_linear`` carries over)."""
    return tuple(f"{n}.{t}" for n in names for t in ("weight", "bias"))


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
class Attention(Style):
    """Self-attention with whole query heads per rank (:class:`~tensorpar.hf.modules.TPAttention`).

    ``projections``: ``"separate"`` (q_proj, k_proj, v_proj, o_proj) or the name of a fused projection whose
    rows are ``[q heads | k heads | v heads]`` (``"qkv_proj"``, Phi-3). ``o_name``: the output projection.
    """

    layout: HeadLayout
    sequence_parallel: bool = False
    fused: str | None = None
    o_name: str = "o_proj"
    name = "attention"

    def apply(self, module, fqn, ctx):
        from tensorpar.hf.modules import TPAttention
        return TPAttention(module, ctx.tp, self.layout, sequence_parallel=self.sequence_parallel, fused=self.fused,
                           o_name=self.o_name)

    def keeps(self):
        proj = (self.fused,) if self.fused else ("q_proj", "k_proj", "v_proj")
        return _linears(*proj, self.o_name) + ("q_norm.**", "k_norm.**", "sinks")  # sinks: with the q heads

    def detail(self):
        lay = self.layout
        kv = " ".join(f"r{r}:{list(u)}" for r, u in enumerate(lay.kv_heads.units))
        return f"{lay.num_heads} q heads -> {list(lay.q_heads.sizes)}, {lay.num_kv_heads} kv heads -> {kv}"

    def rows(self):
        lay = self.layout
        out = "reduce-scatter over sequence" if self.sequence_parallel else "all-reduce"
        if self.fused:
            proj = [(self.fused, "column(q|k|v heads)",
                     f"fused rows [{lay.num_heads}x{lay.head_dim} | {lay.num_kv_heads}x{lay.head_dim} x2]")]
        else:
            proj = [("q_proj", "column(heads)", f"rows {lay.num_heads}x{lay.head_dim} by head"),
                    ("k_proj", "column(kv heads)", f"rows {lay.num_kv_heads}x{lay.head_dim}, kv heads per rank"),
                    ("v_proj", "column(kv heads)", f"rows {lay.num_kv_heads}x{lay.head_dim}, kv heads per rank")]
        return proj + [(self.o_name, "row(heads)", out)]


@dataclass
class GatedMLP(Style):
    """``down(act(gate(x)) * up(x))``: gate/up column-parallel, down row-parallel.

    ``fused``: the name of a fused ``[gate | up]`` projection (Phi-3's ``gate_up_proj``): each rank takes its
    slice of gate and its slice of up, never one contiguous block.
    """

    partition: Partition
    sequence_parallel: bool = False
    fused: str | None = None
    name = "gated_mlp"

    def apply(self, module, fqn, ctx):
        from tensorpar.hf.modules import TPGatedMLP
        return TPGatedMLP(module, ctx.tp, partition=self.partition, sequence_parallel=self.sequence_parallel,
                          fused=self.fused)

    def keeps(self):
        return _linears(*((self.fused,) if self.fused else ("gate_proj", "up_proj")), "down_proj")

    def detail(self):
        return f"intermediate {self.partition.n} -> {list(self.partition.sizes)}"

    def rows(self):
        out = "reduce-scatter over sequence" if self.sequence_parallel else "all-reduce"
        ins = [(self.fused, "column(gate|up)", "each rank's gate rows and up rows")] if self.fused else \
            [("gate_proj", "column", ""), ("up_proj", "column", "")]
        return ins + [("down_proj", "row", out)]


@dataclass
class MLP(Style):
    """``down(act(up(x)))`` (non-gated): ``up`` column-parallel, ``down`` row-parallel.

    ``up``/``down`` name the two projections (``c_fc``/``c_proj`` in StarCoder2, ``dense_h_to_4h``/...).
    """

    partition: Partition
    up: str = "c_fc"
    down: str = "c_proj"
    sequence_parallel: bool = False
    name = "mlp"

    def apply(self, module, fqn, ctx):
        from tensorpar.hf.modules import TPMLP
        return TPMLP(module, ctx.tp, partition=self.partition, up=self.up, down=self.down,
                     sequence_parallel=self.sequence_parallel)

    def keeps(self):
        return _linears(self.up, self.down)

    def detail(self):
        return f"intermediate {self.partition.n} -> {list(self.partition.sizes)}"

    def rows(self):
        return [(self.up, "column", ""), (self.down, "row", "all-reduce")]


@dataclass
class Conv1DAttention(Style):
    """GPT-2 attention: the fused Conv1D ``c_attn`` ``[h, 3h]`` gives each rank its q, k and v heads;
    ``c_proj`` is row-parallel. The module is replaced by :class:`~tensorpar.hf.modules.TPGPT2Attention`."""

    layout: HeadLayout
    name = "attention"

    def apply(self, module, fqn, ctx):
        from tensorpar.hf.modules import TPGPT2Attention
        return TPGPT2Attention(module, ctx.tp, self.layout)

    def keeps(self):
        return _linears("c_attn", "c_proj")

    def detail(self):
        return f"{self.layout.num_heads} heads -> {list(self.layout.q_heads.sizes)}"

    def rows(self):
        return [("c_attn", "column(q|k|v heads)", "fused Conv1D [h, 3h]: each rank's q, k, v heads"),
                ("c_proj", "row(heads)", "Conv1D, all-reduce")]


@dataclass
class Conv1DMLP(Style):
    """GPT-2 MLP: Conv1D ``c_fc`` column-parallel, ``c_proj`` row-parallel (in place; HF's forward is kept)."""

    partition: Partition
    name = "mlp"

    def apply(self, module, fqn, ctx):
        from tensorpar.hf.modules import TPConv1D
        module.c_fc = TPConv1D(module.c_fc, ctx.tp, "column", self.partition)
        module.c_proj = TPConv1D(module.c_proj, ctx.tp, "row", self.partition)
        return module

    def keeps(self):
        return _linears("c_fc", "c_proj")

    def detail(self):
        return f"intermediate {self.partition.n} -> {list(self.partition.sizes)}"

    def rows(self):
        return [("c_fc", "column", "Conv1D"), ("c_proj", "row", "Conv1D, all-reduce")]


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


# ---------------------------------------------------------------- StarCoder2, GPT-NeoX, OLMo 2


@dataclass
class Starcoder2Attention(Attention):
    """:class:`Attention` for StarCoder2 (:class:`~tensorpar.hf.modules.TPStarcoder2Attention`): the sliding
    window comes from the config, the residual dropout after ``o_proj`` becomes a keyed dropout."""

    def apply(self, module, fqn, ctx):
        from tensorpar.hf.modules import TPStarcoder2Attention
        return TPStarcoder2Attention(module, ctx.tp, self.layout, sequence_parallel=self.sequence_parallel)


@dataclass
class ResidualDropoutMLP(MLP):
    """:class:`MLP` whose module applies a functional residual dropout to its output (StarCoder2's
    ``residual_dropout``): the parallel module gets an ``nn.Dropout`` in ``output_dropout``, made a keyed
    dropout (same mask on every rank) by :func:`tensorpar.hf.apply.parallelize`."""

    def apply(self, module, fqn, ctx):
        new = super().apply(module, fqn, ctx)
        p = float(getattr(module, "residual_dropout", 0.0) or 0.0)
        if p > 0:
            new.output_dropout = nn.Dropout(p)
        return new


@dataclass
class KeyedEmbeddingDropout(VocabEmbedding):
    """:class:`VocabEmbedding` for a model that applies a *functional* dropout to the embedding output
    (StarCoder2's ``embedding_dropout``, an attribute of the parent model).

    The parent's probability is set to 0 and an ``nn.Dropout`` child ``output_dropout`` of the embedding is
    applied by a forward hook instead; :func:`tensorpar.hf.apply.parallelize` makes it a keyed dropout, so the
    mask is the same on every rank (the embedding output is replicated). ``attr`` names the parent's float.
    A forward that passes ``inputs_embeds`` skips the embedding and therefore this dropout.
    """

    attr: str = "embedding_dropout"

    def apply(self, module, fqn, ctx):
        emb = super().apply(module, fqn, ctx)
        parent_name = fqn.rpartition(".")[0]
        parent = ctx.root.get_submodule(parent_name) if parent_name else ctx.root
        p = float(getattr(parent, self.attr, 0.0) or 0.0)
        if p > 0:
            setattr(parent, self.attr, 0.0)
            emb.output_dropout = nn.Dropout(p)
            emb.register_forward_hook(lambda m, args, out: m.output_dropout(out))
        return emb


@dataclass
class NeoXAttention(Style):
    """GPT-NeoX attention (:class:`~tensorpar.hf.modules.TPGPTNeoXAttention`): the fused, per-head interleaved
    ``query_key_value`` (rows ``[h0: q, k, v | h1: q, k, v | ...]``) gives each rank the q, k, v triples of its
    heads, one contiguous block; ``dense`` is row-parallel. Partial rotary is transformers' own."""

    layout: HeadLayout
    sequence_parallel: bool = False
    name = "attention"

    def apply(self, module, fqn, ctx):
        from tensorpar.hf.modules import TPGPTNeoXAttention
        return TPGPTNeoXAttention(module, ctx.tp, self.layout, sequence_parallel=self.sequence_parallel)

    def keeps(self):
        return _linears("query_key_value", "dense")

    def detail(self):
        return f"{self.layout.num_heads} heads -> {list(self.layout.q_heads.sizes)}"

    def rows(self):
        lay = self.layout
        out = "reduce-scatter over sequence" if self.sequence_parallel else "all-reduce"
        return [("query_key_value", "column(heads: q,k,v each)",
                 f"rows {lay.num_heads}x[q|k|v]x{lay.head_dim}, each rank's heads contiguous"),
                ("dense", "row(heads)", out)]


@dataclass
class FullWidthQKNormAttention(Attention):
    """:class:`Attention` whose q/k norms are RMSNorms over the whole projection (OLMo 2), not per head:
    :class:`~tensorpar.hf.modules.TPOlmo2Attention`, norm weights sharded with the heads, the sum of squares
    all-reduced over tp (duplicated KV heads counted once)."""

    def apply(self, module, fqn, ctx):
        from tensorpar.hf.modules import TPOlmo2Attention
        return TPOlmo2Attention(module, ctx.tp, self.layout, sequence_parallel=self.sequence_parallel)

    def rows(self):
        lay = self.layout
        return super().rows() + [
            ("q_norm", "sharded(heads)", f"RMSNorm over {lay.num_heads}x{lay.head_dim}: sum of squares all-reduced"),
            ("k_norm", "sharded(kv heads)",
             f"RMSNorm over {lay.num_kv_heads}x{lay.head_dim}: owned rows' sum of squares all-reduced")]


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


@dataclass
class OlmoeAttention(Attention):
    """OLMoE attention (:class:`~tensorpar.hf.modules.TPOlmoeAttention`): as :class:`Attention`, with q/k norms
    that span all heads, each rank normalising its own rows with a cross-rank mean of squares."""

    def apply(self, module, fqn, ctx):
        from tensorpar.hf.modules import TPOlmoeAttention
        return TPOlmoeAttention(module, ctx.tp, self.layout)

    def rows(self):
        lay = self.layout
        return super().rows() + [
            ("q_norm", "sharded(q rows)", f"RMSNorm over {lay.num_heads}x{lay.head_dim}: sum of squares all-reduced"),
            ("k_norm", "sharded(kv rows)", f"RMSNorm over {lay.num_kv_heads}x{lay.head_dim}: owned rows' squares "
                                           f"all-reduced")]


@dataclass
class EncoderAttention(Style):
    """Bidirectional self-attention (ViT, DINOv2): whole heads per rank, q/k/v column-parallel by head
    (``heads x head_dim`` rows, ``head_dim`` may differ from ``hidden / heads``), ``o_proj`` row-parallel.
    The module is replaced by :class:`~tensorpar.hf.modules.TPEncoderAttention`; ``o_name`` names the output
    projection (SigLIP's ``out_proj``)."""

    layout: HeadLayout
    o_name: str = "o_proj"
    name = "encoder_attention"

    def apply(self, module, fqn, ctx):
        from tensorpar.hf.modules import TPEncoderAttention
        return TPEncoderAttention(module, ctx.tp, self.layout, o_name=self.o_name, key=fqn)

    def keeps(self):
        return _linears("q_proj", "k_proj", "v_proj", self.o_name)

    def detail(self):
        lay = self.layout
        return f"{lay.num_heads} heads x {lay.head_dim} -> {list(lay.q_heads.sizes)} (non-causal)"

    def rows(self):
        lay = self.layout
        return [(p, "column(heads)", f"rows {lay.num_heads}x{lay.head_dim} by head") for p in
                ("q_proj", "k_proj", "v_proj")] + [(self.o_name, "row(heads)", "all-reduce")]
