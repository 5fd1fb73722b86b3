"""The styles one model family needs beside the common ones: StarCoder2, GPT-NeoX, OLMo 2, OLMoE, encoders.

Each is a small variant of a common style (:mod:`.dense`, :mod:`.base`): StarCoder2's residual dropout and
keyed embedding dropout, GPT-NeoX's fused q/k/v, OLMo 2's full-width q/k norms, OLMoE's attention and the
bidirectional encoders' attention (:class:`EncoderAttention`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from tensorpar.hf.styles.base import Style, VocabEmbedding, _linears
from tensorpar.hf.styles.dense import MLP, Attention
from tensorpar.layers.attention import HeadLayout


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
