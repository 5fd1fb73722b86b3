"""Tensor-parallel replacements for the attention and MLP modules of Hugging Face decoders.

They keep the submodule names of the modules they replace (``q_proj``, ``gate_proj``, ...), so
parameter names, and therefore safetensors keys and ``state_dict`` keys, stay those of the
original model. Each enters the tensor-parallel region once (one all-reduce of the input
gradient in backward, or one sequence all-gather under sequence parallelism) and leaves it
through its row-parallel output projection (one all-reduce, or one reduce-scatter).
"""
from __future__ import annotations

import sys

import torch
import torch.nn as nn

from tensorpar import comm
from tensorpar.comm import Group
from tensorpar.layers.attention import HeadLayout
from tensorpar.layers.linear import ColumnParallelLinear, RowParallelLinear
from tensorpar.shard import Partition, UnitSelection


def _enter(x: torch.Tensor, tp: Group, sequence_parallel: bool) -> torch.Tensor:
    if sequence_parallel:
        return comm.gather_from_sequence_region(x, tp, dim=1)
    return comm.copy_to_tp_region(x, tp)


def _head_rows(layout: HeadLayout, rank_units, q_first: int, kv_first: int, v_first: int):
    """Rows of a fused ``[q heads | k heads | v heads]`` projection that each rank holds, as a UnitSelection of
    ``head_dim``-row units: its q heads, then its KV heads' k rows, then their v rows."""
    return UnitSelection(layout.num_heads + 2 * layout.num_kv_heads, layout.head_dim, tuple(
        tuple(q_first + h for h in range(*layout.q_heads.range(r)))
        + tuple(kv_first + u for u in rank_units[r]) + tuple(v_first + u for u in rank_units[r])
        for r in range(layout.tp_size)))


class TPAttention(nn.Module):
    """Self-attention with query heads split and KV heads selected per rank (:class:`HeadLayout`).

    Replaces the ``*Attention`` module of a rotary decoder (Llama, Mistral, Qwen2/3, Gemma 1-3, Phi-3, ...)
    and keeps its call signature. Shapes: input ``[b, s, h]`` (``[b, s_r, h]`` under sequence parallelism);
    local query heads ``[b, q_local, s, d]``; local KV heads ``[b, kv_local, s_kv, d]`` (what the cache
    stores); output ``[b, s, h]`` replicated (``[b, s_r, h]`` under sequence parallelism).

    Projections: separate ``q_proj``/``k_proj``/``v_proj`` (column-parallel by q heads and by the rank's KV
    heads), or one fused projection ``fused`` with rows ``[q | k | v]`` (Phi-3's ``qkv_proj``), of which each
    rank holds its q, k and v heads (never one contiguous block); the output projection ``o_name`` is
    row-parallel. Per-head q/k norms (Qwen3, Gemma 3: weights ``[d]``, replicated) are kept; their gradients
    are partial sums over the rank's heads and are marked to be summed over tp. Gemma 2's logit soft-capping
    and sliding windows are passed to the attention kernel as the original module does.

    Collectives: forward one all-reduce in the output projection (reduce-scatter with sequence parallelism,
    plus an all-gather at entry); backward one all-reduce at entry (reduce-scatter with sequence parallelism,
    plus an all-gather at the output projection).

    Dropout: ``attention_fn`` (set by :func:`tensorpar.hf.apply.parallelize` when the config has attention
    dropout) is the head-keyed kernel of :mod:`tensorpar.train.dropout`, used in training only, so the
    masks are the same at every tp; ``output_dropout`` (``None`` by default) follows the output projection.
    In eval the kernel the model was configured with (sdpa, eager) runs.
    """

    def __init__(self, attn: nn.Module, tp: Group, layout: HeadLayout, *, sequence_parallel: bool = False,
                 fused: str | None = None, o_name: str = "o_proj"):
        super().__init__()
        from tensorpar.layers.linear import mark_sequence_parallel

        self.tp, self.layout, self.sequence_parallel = tp, layout, sequence_parallel
        self.config = attn.config
        self.layer_idx = attn.layer_idx
        self.head_dim = layout.head_dim
        self.scaling = attn.scaling
        self.attention_dropout = getattr(attn, "attention_dropout", 0.0)
        self.sliding_window = getattr(attn, "sliding_window", None)
        self.softcap = getattr(attn, "attn_logit_softcapping", None)
        self.is_causal = True
        self.fused, self.o_name = fused, o_name
        # Uniform local groups: the attention kernel broadcasts each KV head to its g query heads
        # (HF's sdpa/eager paths); otherwise (a group straddling ranks) KV heads are gathered per query head.
        self._group = layout.uniform_group(tp.rank)
        self.num_key_value_groups = self._group or 1
        family = sys.modules[type(attn).__module__]
        self._rope = getattr(family, "apply_rotary_pos_emb", None)
        self._attn_default = family.eager_attention_forward
        self._n_q = layout.local_heads(tp.rank) * layout.head_dim
        self._n_kv = layout.local_kv_heads(tp.rank) * layout.head_dim
        if fused:
            nh, nkv = layout.num_heads, layout.num_kv_heads
            rows = _head_rows(layout, layout.kv_heads.units, 0, nh, nh + nkv)
            setattr(self, fused, ColumnParallelLinear.from_linear(getattr(attn, fused), tp, partition=rows))
        else:
            self.q_proj = ColumnParallelLinear.from_linear(attn.q_proj, tp, partition=layout.q_rows)
            self.k_proj = ColumnParallelLinear.from_linear(attn.k_proj, tp, partition=layout.kv_rows)
            self.v_proj = ColumnParallelLinear.from_linear(attn.v_proj, tp, partition=layout.kv_rows)
        setattr(self, o_name, RowParallelLinear.from_linear(getattr(attn, o_name), tp, partition=layout.q_rows,
                                                            sequence_parallel=sequence_parallel))
        for norm in ("q_norm", "k_norm"):
            m = getattr(attn, norm, None)
            if m is not None:
                for p in m.parameters():
                    mark_sequence_parallel(p)  # replicated, but each rank's gradient covers its heads only
            setattr(self, norm, m)
        self.attention_fn = None
        self.output_dropout = None

    def _qkv(self, x: torch.Tensor):
        b, s = x.shape[:2]
        if self.fused:
            q, k, v = getattr(self, self.fused).forward_local(x).split([self._n_q, self._n_kv, self._n_kv], -1)
        else:
            q, k, v = self.q_proj.forward_local(x), self.k_proj.forward_local(x), self.v_proj.forward_local(x)
        q, k, v = (t.view(b, s, -1, self.head_dim) for t in (q, k, v))                      # [b, s, heads, d]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)                     # [b, heads, s, d]

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        kwargs.pop("past_key_values", None)
        x = _enter(hidden_states, self.tp, self.sequence_parallel)
        b, s = x.shape[:2]
        q, k, v = self._qkv(x)
        if position_embeddings is not None and self._rope is not None:
            cos, sin = position_embeddings
            q, k = self._rope(q, k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        if self._group is None:
            k = self.layout.expand_kv(k, self.tp.rank)  # [b, q_local, s_kv, d]
            v = self.layout.expand_kv(v, self.tp.rank)
        keyed = self.training and self.attention_fn is not None
        fn = self.attention_fn if keyed else ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, self._attn_default)
        extra = {"sliding_window": self.sliding_window} if self.sliding_window is not None else {}
        if self.softcap is not None:
            extra["softcap"] = self.softcap
        out, weights = fn(self, q, k, v, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
                          scaling=self.scaling, **extra, **kwargs)
        out = out.reshape(b, s, -1).contiguous()  # [b, s, q_local * d]
        out = getattr(self, self.o_name)(out)
        if self.output_dropout is not None:
            out = self.output_dropout(out)
        return out, weights

    def extra_repr(self) -> str:
        return f"tp={self.tp.size}, {self.layout.describe()}"


def _act(mlp: nn.Module):
    for name in ("act_fn", "activation_fn", "act"):
        if hasattr(mlp, name):
            return getattr(mlp, name)
    raise ValueError(f"{type(mlp).__name__} has no act_fn / activation_fn / act attribute")


class TPGatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with the intermediate dim split (column, column, row).

    Shapes: input/output ``[b, s, h]`` (``[b, s_r, h]`` with sequence parallelism); the
    intermediate ``[b, s, f_r]`` with ``f_r = partition.sizes[tp_rank]``. With ``fused`` (Phi-3's
    ``gate_up_proj``, rows ``[gate | up]``) each rank holds its gate rows and its up rows in one
    ``[2 f_r, h]`` weight.
    Collectives: forward one all-reduce (reduce-scatter, plus an all-gather at entry, with
    sequence parallelism); backward one all-reduce (or reduce-scatter + all-gather).
    ``output_dropout`` (``None`` by default) is applied to the output, as in :class:`TPAttention`.
    """

    def __init__(self, mlp: nn.Module, tp: Group, *, partition: Partition | None = None,
                 sequence_parallel: bool = False, fused: str | None = None):
        super().__init__()
        self.tp, self.sequence_parallel, self.fused = tp, sequence_parallel, fused
        if fused:
            f = getattr(mlp, fused).out_features // 2
            part = partition or tp.partition(f, what="intermediate_size")
            rows = UnitSelection(2 * f, 1, tuple(tuple(part.indices(r)) + tuple(f + i for i in part.indices(r))
                                                 for r in range(tp.size)))
            setattr(self, fused, ColumnParallelLinear.from_linear(getattr(mlp, fused), tp, partition=rows))
        else:
            part = partition or tp.partition(mlp.gate_proj.out_features, what="intermediate_size")
            self.gate_proj = ColumnParallelLinear.from_linear(mlp.gate_proj, tp, partition=part)
            self.up_proj = ColumnParallelLinear.from_linear(mlp.up_proj, tp, partition=part)
        self.down_proj = RowParallelLinear.from_linear(mlp.down_proj, tp, partition=part,
                                                       sequence_parallel=sequence_parallel)
        self.act_fn = _act(mlp)
        self.output_dropout = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _enter(x, self.tp, self.sequence_parallel)
        if self.fused:
            gate, up = getattr(self, self.fused).forward_local(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj.forward_local(x), self.up_proj.forward_local(x)
        y = self.down_proj(self.act_fn(gate) * up)
        return y if self.output_dropout is None else self.output_dropout(y)

    def extra_repr(self) -> str:
        return f"tp={self.tp.size}, intermediate local {self.down_proj.in_features_local}"


class TPMLP(nn.Module):
    """``down(act(up(x)))`` with the intermediate dim split (column, row); ``up``/``down`` name the projections.

    Shapes and collectives as :class:`TPGatedMLP`. ``output_dropout`` follows the output (StarCoder2's
    residual dropout, made tp-invariant by :func:`tensorpar.hf.apply.parallelize`).
    """

    def __init__(self, mlp: nn.Module, tp: Group, *, partition: Partition, up: str, down: str,
                 sequence_parallel: bool = False):
        super().__init__()
        self.tp, self.sequence_parallel, self.up, self.down = tp, sequence_parallel, up, down
        setattr(self, up, ColumnParallelLinear.from_linear(getattr(mlp, up), tp, partition=partition))
        setattr(self, down, RowParallelLinear.from_linear(getattr(mlp, down), tp, partition=partition,
                                                          sequence_parallel=sequence_parallel))
        self.act_fn = _act(mlp)
        self.output_dropout = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _enter(x, self.tp, self.sequence_parallel)
        y = getattr(self, self.down)(self.act_fn(getattr(self, self.up).forward_local(x)))
        return y if self.output_dropout is None else self.output_dropout(y)


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


def sequence_parallel_entry(layer: nn.Module, tp: Group) -> None:
    """Make ``layer`` (the first decoder block) split its input along the sequence.

    ``[b, s, h] -> [b, s_r, h]``; forward split (no communication), backward all-gather. The block's
    ``forward`` is wrapped on the instance, so parameter names are unchanged. The split happens while
    ``layer.sequence_parallel`` is true (generation turns it off: :func:`tensorpar.hf.apply.sequence_parallel_off`).
    """
    inner = layer.forward

    def forward(hidden_states, *args, **kwargs):
        if layer.sequence_parallel:
            hidden_states = comm.scatter_to_sequence_region(hidden_states, tp, dim=1)
        return inner(hidden_states, *args, **kwargs)

    layer.forward = forward
    layer.sequence_parallel = True
    layer._tensorpar_sp_entry = True


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


class TPStarcoder2Attention(TPAttention):
    """StarCoder2 self-attention: :class:`TPAttention` (separate q/k/v/o projections, biased) plus what
    StarCoder2's module adds to Llama's.

    * The sliding window is read from the config (``config.sliding_window``; StarCoder2's attention has no
      ``sliding_window`` attribute) and passed to the kernel as the original module does.
    * The residual dropout (a functional ``nn.functional.dropout`` after ``o_proj`` in transformers) becomes an
      ``nn.Dropout`` in ``output_dropout`` when ``residual_dropout > 0``, which
      :func:`tensorpar.hf.apply.parallelize` turns into a keyed dropout: the same mask on every rank, and the same
      at every tp (not the mask torch's global generator would have drawn).

    Shapes and collectives: as :class:`TPAttention`.
    """

    def __init__(self, attn: nn.Module, tp: Group, layout: HeadLayout, *, sequence_parallel: bool = False):
        super().__init__(attn, tp, layout, sequence_parallel=sequence_parallel)
        self.sliding_window = getattr(attn.config, "sliding_window", None)
        p = float(getattr(attn, "residual_dropout", 0.0) or 0.0)
        self.output_dropout = nn.Dropout(p) if p > 0 else None


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

    def forward(self, hidden_states, attention_mask=None, layer_past=None, position_embeddings=None, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        cache = layer_past
        for key in ("cache", "past_key_values"):
            c = kwargs.pop(key, None)
            cache = cache if cache is not None else c
        x = _enter(hidden_states, self.tp, self.sequence_parallel)
        b, s = x.shape[:2]
        qkv = self.query_key_value.forward_local(x).view(b, s, -1, 3 * self.head_dim).transpose(1, 2)
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


class _AllReduceSum(torch.autograd.Function):
    """forward: all-reduce (sum); backward: all-reduce (sum). For a partial sum that every rank then uses
    on its own, different, data (so each rank's gradient is only its own part of the total)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return comm.all_reduce(g.contiguous(), ctx.group), None


class TPRMSNorm(nn.Module):
    """RMSNorm over a dimension whose features are split (or selected, with duplicates) across tp ranks.

    ``y = w * x / sqrt(mean(x^2) + eps)`` where the mean runs over all ``n`` features of the unsharded
    dimension (OLMo 2's q/k norms act on the full ``heads * head_dim`` projection, not per head). Each rank
    holds ``rows.indices(tp_rank)`` of the features and the same rows of ``w`` (sharded with its heads: a
    :class:`Partition` for query heads, a :class:`UnitSelection` for KV heads, which may be held by several
    ranks). The sum of squares is taken on each rank over the rows it *owns* (the lowest rank holding a
    duplicated row owns it, :meth:`UnitSelection.owner_mask`), so an all-reduce gives the exact global sum
    however KV heads are duplicated or replicated. The arithmetic is fp32, then cast back to the input
    dtype, as transformers' ``Olmo2RMSNorm``/``LlamaRMSNorm`` do (Zhang & Sennrich 2019, "Root Mean Square
    Layer Normalization").

    Shapes: input and output ``[*, n_r]`` with ``n_r = rows.sizes[tp_rank]``; weight ``[n_r]``.

    Collectives: forward one all-reduce of ``[*, 1]`` fp32 (the sums of squares); backward one all-reduce of
    the same shape (each rank's gradient of the shared sum covers its own rows only). The weight's gradient is
    this rank's rows; duplicated rows are summed by :func:`tensorpar.grads.sync_duplicated_grads`.
    """

    def __init__(self, norm: nn.Module, tp: Group, rows: Partition | UnitSelection):
        super().__init__()
        from tensorpar.layers.linear import _slice, mark_sharded

        if norm.weight.shape[0] != rows.n:
            raise ValueError(f"norm weight has {norm.weight.shape[0]} features but the row split covers {rows.n}")
        self.tp, self.rows, self.n = tp, rows, rows.n
        self.variance_epsilon = norm.variance_epsilon
        self.weight = mark_sharded(nn.Parameter(_slice(norm.weight.detach(), 0, rows, tp.rank).clone()), 0, rows)
        own = rows.owner_mask(tp.rank)
        self._owned = None if all(own) else tuple(i for i, o in enumerate(own) if o)

    def local_sum_of_squares(self, x: torch.Tensor) -> torch.Tensor:
        """``[*, n_r] -> [*, 1]`` fp32: the sum of squares over the rows this rank owns (no communication)."""
        sq = x.float().pow(2)
        if self._owned is not None:
            sq = sq.index_select(-1, torch.tensor(self._owned, dtype=torch.long, device=x.device))
        return sq.sum(-1, keepdim=True)

    def normalize(self, x: torch.Tensor, sum_of_squares: torch.Tensor) -> torch.Tensor:
        """``w * x / sqrt(sum_of_squares / n + eps)`` given the global sum of squares ``[*, 1]`` (fp32)."""
        y = x.float() * torch.rsqrt(sum_of_squares / self.n + self.variance_epsilon)
        return (self.weight * y).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(x, all_reduce_sum(self.local_sum_of_squares(x), self.tp))

    def extra_repr(self) -> str:
        return f"local {tuple(self.weight.shape)} of {self.n}, eps={self.variance_epsilon}, tp={self.tp.size}"


def all_reduce_sum(x: torch.Tensor, tp: Group) -> torch.Tensor:
    """Sum of ``x`` over tp, differentiable: forward all-reduce, backward all-reduce (every rank uses the sum on
    its own data, so each rank's gradient is a part of the total). Identity at tp = 1; a plain all-reduce when
    no gradient is needed."""
    if tp.size == 1:
        return x
    if torch.is_grad_enabled() and x.requires_grad:
        return _AllReduceSum.apply(x, tp)
    return comm.all_reduce(x, tp)


class TPOlmo2Attention(TPAttention):
    """OLMo 2 self-attention: :class:`TPAttention` whose q/k RMSNorms normalise the whole projection
    (``[heads * head_dim]`` and ``[kv_heads * head_dim]``) before the split into heads.

    ``q_norm`` and ``k_norm`` become :class:`TPRMSNorm` with their weights sharded like ``q_proj``'s and
    ``k_proj``'s rows (``layout.q_rows``, ``layout.kv_rows``); KV heads duplicated on several ranks (a group
    straddling two ranks, or tp > kv heads) count once in the sum of squares.

    Shapes as :class:`TPAttention`. Collectives: those of :class:`TPAttention`, plus one all-reduce of
    ``[b, s, 2]`` fp32 (both norms' sums of squares together) in forward and one in backward.
    """

    def __init__(self, attn: nn.Module, tp: Group, layout: HeadLayout, *, sequence_parallel: bool = False):
        super().__init__(attn, tp, layout, sequence_parallel=sequence_parallel)
        self.q_norm = TPRMSNorm(attn.q_norm, tp, layout.q_rows)
        self.k_norm = TPRMSNorm(attn.k_norm, tp, layout.kv_rows)

    def _qkv(self, x: torch.Tensor):
        b, s = x.shape[:2]
        q, k, v = self.q_proj.forward_local(x), self.k_proj.forward_local(x), self.v_proj.forward_local(x)
        ss = all_reduce_sum(torch.cat([self.q_norm.local_sum_of_squares(q), self.k_norm.local_sum_of_squares(k)], -1),
                            self.tp)                                                   # [b, s, 2] global sums
        q, k = self.q_norm.normalize(q, ss[..., :1]), self.k_norm.normalize(k, ss[..., 1:])
        return tuple(t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
