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


class TPEncoderAttention(nn.Module):
    """Bidirectional self-attention of a vision (or any encoder) block with whole heads per rank.

    Replaces transformers' ``ViTAttention`` / ``Dinov2Attention`` / ``SiglipAttention`` (separate ``q_proj``,
    ``k_proj``, ``v_proj`` and the output projection ``o_name``: ``o_proj``, SigLIP's ``out_proj``; no rotary
    embedding, no KV cache, ``is_causal = False``) and keeps their call signature
    ``(hidden_states, attention_mask=None, **kwargs) -> (output, weights)``.

    Shapes (``heads_r = layout.q_heads.sizes[tp_rank]``, ``d = layout.head_dim``, which may differ from
    ``hidden / heads``): input ``[b, s, h]`` replicated; q/k/v weights ``[heads_r * d, h]`` (the rows of this
    rank's heads, biases sliced with them); local heads ``[b, heads_r, s, d]``; ``o_proj`` weight
    ``[h, heads_r * d]``; output ``[b, s, h]`` replicated, the ``o_proj`` bias added once after the reduction.

    Collectives: forward one all-reduce (``o_proj``); backward one all-reduce (input gradient at entry).

    Dropout: in training, when :func:`tensorpar.hf.apply.parallelize` has set ``attention_fn`` (the head-keyed
    kernel, masks keyed by global head so they are the same at every tp), it runs with an explicit all-true
    mask so the kernel does not apply its causal default (masks keyed by ``key``, the module's name, and the
    global head index); otherwise the kernel the model was configured with
    (sdpa, eager) runs, non-causal, as in the original module.
    """

    def __init__(self, attn: nn.Module, tp: Group, layout: HeadLayout, *, o_name: str = "o_proj", key: str = ""):
        super().__init__()
        if layout.num_kv_heads != layout.num_heads:
            raise ValueError(f"encoder attention has one KV head per query head; got {layout.num_heads} heads and "
                             f"{layout.num_kv_heads} KV heads")
        self.tp, self.layout, self.config = tp, layout, attn.config
        self.head_dim = layout.head_dim
        self.scaling = getattr(attn, "scaling", getattr(attn, "scale", layout.head_dim ** -0.5))
        self.attention_dropout = getattr(attn, "attention_dropout", 0.0)
        self.is_causal = False
        self.layer_idx = getattr(attn, "layer_idx", None) if key == "" else key   # the dropout masks' key
        self.q_proj = ColumnParallelLinear.from_linear(attn.q_proj, tp, partition=layout.q_rows)
        self.k_proj = ColumnParallelLinear.from_linear(attn.k_proj, tp, partition=layout.q_rows)
        self.v_proj = ColumnParallelLinear.from_linear(attn.v_proj, tp, partition=layout.q_rows)
        self.o_name = o_name
        setattr(self, o_name, RowParallelLinear.from_linear(getattr(attn, o_name), tp, partition=layout.q_rows))
        self._attn_default = sys.modules[type(attn).__module__].eager_attention_forward
        self.attention_fn = None

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        x = comm.copy_to_tp_region(hidden_states, self.tp)
        b, s = x.shape[:2]
        q, k, v = (p.forward_local(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))                       # [b, heads_r, s, d]
        keyed = self.training and self.attention_fn is not None
        if keyed:
            fn = self.attention_fn
            if attention_mask is None:   # the keyed kernel is causal by default; an encoder sees every position
                attention_mask = torch.ones(s, s, dtype=torch.bool, device=x.device)
        else:
            fn = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self._attn_default)
        out, weights = fn(self, q, k, v, attention_mask, dropout=self.attention_dropout if self.training else 0.0,
                          scaling=self.scaling, **kwargs)
        return getattr(self, self.o_name)(out.reshape(b, s, -1).contiguous()), weights

    def extra_repr(self) -> str:
        return f"tp={self.tp.size}, {self.layout.describe()}"
