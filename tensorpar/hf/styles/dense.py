"""The styles of a dense decoder block: attention and the MLPs, with separate or GPT-2's fused projections.

:class:`Attention` (query heads split, KV heads by :class:`~tensorpar.layers.attention.HeadLayout`),
:class:`GatedMLP` and :class:`MLP` (column, row over the intermediate dimension), and GPT-2's
:class:`Conv1DAttention` and :class:`Conv1DMLP`.
"""
from __future__ import annotations

from dataclasses import dataclass

from tensorpar.hf.styles.base import Style, _linears
from tensorpar.layers.attention import HeadLayout
from tensorpar.layers.linear import ColumnParallelLinear, RowParallelLinear
from tensorpar.shard import Partition


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
class _OneLinear(Style):
    """One ``nn.Linear`` replaced by the parallel linear ``layer`` (its ``from_linear``), split by ``partition``
    over its ``features`` ("out" or "in"); its weight and bias carried over. The two below set the three."""

    partition: Partition
    layer = None
    features = ""
    collective = ""

    def apply(self, module, fqn, ctx):
        return self.layer.from_linear(module, ctx.tp, partition=self.partition)

    def keeps(self):
        return ("weight", "bias")

    def detail(self):
        return f"{self.features} features {self.partition.n} -> {list(self.partition.sizes)}{self.collective}"


@dataclass
class ColumnLinear(_OneLinear):
    """One ``nn.Linear`` whose output features are split: the input projection of an MLP written into its block
    (OPT's, BioGPT's ``fc1``; the block's own forward runs): :class:`~tensorpar.layers.ColumnParallelLinear`, input
    ``[*, h]`` replicated, output ``[*, f_r]`` kept split for the elementwise activation the block applies next
    and the :class:`RowLinear` after it. Collectives: forward none; backward all-reduce of the input gradient."""

    name = "column"
    layer, features = ColumnParallelLinear, "out"


@dataclass
class RowLinear(_OneLinear):
    """One ``nn.Linear`` whose input features are split (OPT's ``fc2`` after a :class:`ColumnLinear`):
    :class:`~tensorpar.layers.RowParallelLinear`, input ``[*, f_r]``, output ``[*, h]`` replicated, bias added once.
    Collectives: forward all-reduce; backward none."""

    name = "row"
    layer, features, collective = RowParallelLinear, "in", ", all-reduce"
