"""Tensor-parallel attention of families whose checkpoint fuses q, k and v in one tensor: GPT-2 (``Conv1D`` ``c_attn``,
:class:`TPConv1D`) and GPT-NeoX (per-head interleaved ``query_key_value``, partial rotary).
"""
from __future__ import annotations

import sys

import torch
import torch.nn as nn

from tensorpar import comm
from tensorpar.comm import Group
from tensorpar.hf.modules.common import _project
from tensorpar.layers.attention import HeadLayout
from tensorpar.layers.linear import ColumnParallelLinear, RowParallelLinear
from tensorpar.shard import UnitSelection

class TPGPT2Attention(nn.Module):
    """GPT-2 self-attention: the fused Conv1D ``c_attn`` ``[h, 3h]`` gives each rank the q, k and v columns of
    its heads; ``c_proj`` is row-parallel (bias added once, after the all-reduce).

    Shapes: input/output ``[b, s, h]``; local heads ``[b, heads_r, s, d]``. Collectives: forward one
    all-reduce (``c_proj``); backward one all-reduce (input gradient of ``c_attn``). Dropout: the
    probabilities through the head-keyed kernel in training (``attention_fn``), ``resid_dropout`` as set by
    :func:`tensorpar.hf.apply.parallelize` (a keyed dropout: the same mask on every rank).
    """

    def __init__(self, attn: nn.Module, tp: Group, layout: HeadLayout):
        super().__init__()
        if getattr(attn, "is_cross_attention", False):
            raise ValueError("GPT-2 cross-attention is not supported by tensorpar; use a decoder-only GPT-2")
        if getattr(attn, "reorder_and_upcast_attn", False):
            raise ValueError("reorder_and_upcast_attn=True is not supported by tensorpar; set it to False")
        self.tp, self.layout = tp, layout
        self.config, self.layer_idx, self.head_dim = attn.config, attn.layer_idx, layout.head_dim
        self.scaling, self.is_causal = attn.scaling, True
        self.attention_dropout = attn.attn_dropout.p
        nh, hd = layout.num_heads, layout.head_dim
        self._local = layout.local_heads(tp.rank) * hd
        qkv = UnitSelection(3 * nh, hd, tuple(tuple(k * nh + u for k in range(3) for u in range(*layout.q_heads.range(r)))
                                              for r in range(tp.size)))
        self.c_attn = TPConv1D(attn.c_attn, tp, "column", qkv)
        self.c_proj = TPConv1D(attn.c_proj, tp, "row", layout.q_rows)
        self.resid_dropout = attn.resid_dropout
        self.attention_fn = None
        self._attn_default = sys.modules[type(attn).__module__].eager_attention_forward

    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        kwargs.pop("past_key_values", None)
        for k in ("encoder_hidden_states", "encoder_attention_mask", "output_attentions", "use_cache"):
            kwargs.pop(k, None)
        b, s = hidden_states.shape[:2]
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2)
                   for t in self.c_attn(hidden_states).split(self._local, dim=2))             # [b, heads_r, s, d]
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        keyed = self.training and self.attention_fn is not None
        fn = self.attention_fn if keyed else ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, self._attn_default)
        out, weights = fn(self, q, k, v, attention_mask, dropout=self.attention_dropout if self.training else 0.0,
                          scaling=self.scaling, **kwargs)
        out = self.c_proj(out.reshape(b, s, -1).contiguous())
        return self.resid_dropout(out), weights


class TPConv1D(nn.Module):
    """GPT-2's ``Conv1D`` (``y = x @ W + b`` with ``W: [in, out]``), column- or row-parallel.

    The weight keeps Conv1D's ``[in, out]`` layout so checkpoint keys and shapes are unchanged.

    * ``style="column"``: ``W[:, cols_r]``, ``b[cols_r]`` (``cols`` may be a :class:`UnitSelection`,
      e.g. this rank's q, k and v heads of the fused ``c_attn``); input replicated ``[*, in]``,
      output ``[*, len(cols_r)]``. Collectives: forward none; backward all-reduce of the input grad.
    * ``style="row"``: ``W[rows_r, :]``, bias replicated and added after the reduction; input
      ``[*, len(rows_r)]``, output ``[*, out]``. Collectives: forward all-reduce; backward none.
    """

    def __init__(self, conv: nn.Module, tp: Group, style: str, partition):
        super().__init__()
        from tensorpar.layers.linear import _slice, mark_sharded

        if style not in ("column", "row"):
            raise ValueError(f"style must be 'column' or 'row', got {style!r}")
        self.tp, self.style, self.partition = tp, style, partition
        self.nf = conv.nf
        dim = 1 if style == "column" else 0
        w = _slice(conv.weight.detach(), dim, partition, tp.rank).clone()
        self.weight = mark_sharded(nn.Parameter(w), dim, partition)
        if style == "column":
            self.bias = mark_sharded(nn.Parameter(_slice(conv.bias.detach(), 0, partition, tp.rank).clone()), 0,
                                     partition)
        else:
            self.bias = nn.Parameter(conv.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == "column":
            x = comm.copy_to_tp_region(x, self.tp)
            return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)
        y = (x.reshape(-1, x.shape[-1]) @ self.weight).view(*x.shape[:-1], -1)
        return comm.reduce_from_tp_region(y, self.tp) + self.bias

    def extra_repr(self) -> str:
        return f"{self.style}, local weight {tuple(self.weight.shape)}, tp={self.tp.size}"


# ---------------------------------------------------------------- StarCoder2, GPT-NeoX, OLMo 2


class TPGPTNeoXAttention(nn.Module):
    """GPT-NeoX (Pythia) self-attention with whole heads per rank.

    The fused ``query_key_value`` projection ``[3 h, h]`` is laid out per head, interleaved:
    rows ``[h0: q, k, v | h1: q, k, v | ...]`` (``3 * head_dim`` rows per head), so each rank's heads' q, k and v
    triples are one contiguous block of ``3 * head_dim * heads_r`` rows (``layout.q_heads`` scaled by
    ``3 * head_dim``), bias included. Rotary embeddings act on the first ``rotary_ndims`` of each head
    (partial rotary) through transformers' own ``apply_rotary_pos_emb``. ``dense`` is row-parallel (bias added
    once, after the reduction). The parallel residual lives in the block, which is left unchanged.

    Shapes: input ``[b, s, h]`` (``[b, s_r, h]`` with sequence parallelism); local heads
    ``[b, heads_r, s, d]`` (what the KV cache stores); output ``[b, s, h]`` replicated (``[b, s_r, h]``).

    Collectives: forward one all-reduce in ``dense`` (reduce-scatter, plus an all-gather at entry, with
    sequence parallelism); backward one all-reduce at entry (reduce-scatter, plus an all-gather).

    Dropout: ``attention_fn`` (the head-keyed kernel, set by :func:`tensorpar.hf.apply.parallelize` when the
    config has attention dropout) in training; the block's own ``nn.Dropout`` modules stay where they are.

    Raises:
        ValueError: the layout has fewer KV heads than query heads (GPT-NeoX has none of its own).
    """

    def __init__(self, attn: nn.Module, tp: Group, layout: HeadLayout, *, sequence_parallel: bool = False):
        super().__init__()
        if layout.num_kv_heads != layout.num_heads:
            raise ValueError(f"GPT-NeoX attention has one KV head per query head, got a layout with "
                             f"{layout.num_kv_heads} KV heads for {layout.num_heads} heads")
        self.tp, self.layout, self.sequence_parallel = tp, layout, sequence_parallel
        self.config, self.layer_idx = attn.config, attn.layer_idx
        self.head_dim = self.head_size = layout.head_dim
        self.rotary_ndims = attn.rotary_ndims
        self.scaling = attn.scaling
        self.attention_dropout = getattr(attn, "attention_dropout", 0.0)
        self.is_causal = True
        self.num_key_value_groups = 1
        self._group = 1
        rows = layout.q_heads.scaled(3 * layout.head_dim)
        self.query_key_value = ColumnParallelLinear.from_linear(attn.query_key_value, tp, partition=rows)
        self.dense = RowParallelLinear.from_linear(attn.dense, tp, partition=layout.q_rows,
                                                   sequence_parallel=sequence_parallel)
        family = sys.modules[type(attn).__module__]
        self._rope = family.apply_rotary_pos_emb
        self._attn_default = family.eager_attention_forward
        self.attention_fn = None
        self.output_dropout = None
        self.overlap_grad_comm = True

    def forward(self, hidden_states, attention_mask=None, layer_past=None, position_embeddings=None, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        cache = layer_past
        for key in ("cache", "past_key_values"):
            c = kwargs.pop(key, None)
            cache = cache if cache is not None else c
        (qkv,) = _project(self, hidden_states, self.query_key_value)
        b, s = qkv.shape[:2]
        qkv = qkv.view(b, s, -1, 3 * self.head_dim).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)                                                    # [b, heads_r, s, d]
        cos, sin = position_embeddings
        q, k = self._rope(q, k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        keyed = self.training and self.attention_fn is not None
        fn = self.attention_fn if keyed else ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, self._attn_default)
        out, weights = fn(self, q, k, v, attention_mask, scaling=self.scaling,
                          dropout=0.0 if not self.training else self.attention_dropout, **kwargs)
        out = self.dense(out.reshape(b, s, -1).contiguous())
        if self.output_dropout is not None:
            out = self.output_dropout(out)
        return out, weights

    def extra_repr(self) -> str:
        return f"tp={self.tp.size}, {self.layout.describe()}"
