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
from tensorpar.layers.linear import ColumnParallelLinear, RowParallelLinear, column_parallel_linears
from tensorpar.shard import Partition, UnitSelection


def _project(mod: nn.Module, x: torch.Tensor, *linears: nn.Module) -> list[torch.Tensor]:
    """Enter ``mod``'s tp region with ``x`` and apply the column-parallel ``linears`` that share it
    (:func:`tensorpar.layers.linear.column_parallel_linears`): under sequence parallelism only the sequence
    shard is kept for backward, and the input-gradient collective overlaps the weight gradients while
    ``mod.overlap_grad_comm``."""
    return column_parallel_linears(x, linears, mod.tp, sequence_parallel=getattr(mod, "sequence_parallel", False),
                                   seq_dim=1, overlap=getattr(mod, "overlap_grad_comm", True))


def _head_rows(layout: HeadLayout, rank_units, q_first: int, kv_first: int, v_first: int):
    """Rows of a fused ``[q heads | k heads | v heads]`` projection that each rank holds, as a UnitSelection of
    ``head_dim``-row units: its q heads, then its KV heads' k rows, then their v rows."""
    return UnitSelection(layout.num_heads + 2 * layout.num_kv_heads, layout.head_dim, tuple(
        tuple(q_first + h for h in range(*layout.q_heads.range(r)))
        + tuple(kv_first + u for u in rank_units[r]) + tuple(v_first + u for u in rank_units[r])
        for r in range(layout.tp_size)))


def _lean_fused(owner: nn.Module, names: tuple[str, ...]):
    if "_lean_fused" not in owner.__dict__:
        return None
    from tensorpar.lean import fused_weight
    f = fused_weight(owner, names)
    # int8 (tensorpar.quant): the projections' own (dequantizing) weights run; the lean path reads the int8 one
    return f if f is None or isinstance(f[0], torch.Tensor) else None


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
    are partial sums over the rank's heads and are marked to be summed over tp. Attention sinks (gpt_oss: one
    logit per query head, ``[heads]``) are sharded with the query heads ``[heads_r]``. Gemma 2's logit soft-capping
    and sliding windows are passed to the attention kernel as the original module does.

    Collectives: forward one all-reduce in the output projection (reduce-scatter with sequence parallelism,
    plus an all-gather at entry); backward one all-reduce at entry (reduce-scatter with sequence parallelism,
    plus an all-gather at the output projection).

    Dropout: ``attention_fn`` (set by :func:`tensorpar.hf.apply.parallelize` when the config has attention
    dropout) is the head-keyed kernel of :mod:`tensorpar.layers.dropout`, used in training only, so the
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
        self.sinks = self._shard_sinks(getattr(attn, "sinks", None))
        self.attention_fn = None
        self.output_dropout = None
        self.overlap_grad_comm = True

    def _shard_sinks(self, sinks):
        """gpt_oss's attention sinks (one logit per query head, ``[heads]``; the kernel reads ``module.sinks``):
        this rank's query heads' ``[heads_r]``, sharded with them. None when the module has none."""
        if sinks is None:
            return None
        from tensorpar.layers.linear import _slice, mark_sharded
        lay = self.layout
        if tuple(sinks.shape) != (lay.num_heads,):
            raise ValueError(f"attention sinks of shape {tuple(sinks.shape)}: expected one per query head "
                             f"({lay.num_heads},)")
        if self.attention_dropout > 0:
            raise ValueError(f"attention sinks with attention_dropout={self.attention_dropout}: the head-keyed "
                             f"dropout kernel has no sinks; set attention_dropout=0")
        local = _slice(sinks.detach(), 0, lay.q_heads, self.tp.rank).clone()
        return mark_sharded(nn.Parameter(local, requires_grad=sinks.requires_grad), 0, lay.q_heads)

    def _qkv(self, hidden_states: torch.Tensor):
        """Enter the tp region (``[b, s_r, h]`` under sequence parallelism) and project: q, k, v ``[b, heads, s, d]``.
        Without autograd and sequence parallelism (decode) the region's entry is the identity and the lean path's
        fused q/k/v rows (:func:`tensorpar.lean.fuse_projections`) run as one matmul."""
        lean = None if (self.fused or torch.is_grad_enabled() or getattr(self, "sequence_parallel", False)) \
            else _lean_fused(self, ("q_proj", "k_proj", "v_proj"))
        if self.fused:
            (qkv,) = _project(self, hidden_states, getattr(self, self.fused))
            q, k, v = qkv.split([self._n_q, self._n_kv, self._n_kv], -1)
        elif lean is not None:
            q, k, v = torch.nn.functional.linear(hidden_states, *lean).split([self._n_q, self._n_kv, self._n_kv], -1)
        else:
            q, k, v = _project(self, hidden_states, self.q_proj, self.k_proj, self.v_proj)
        b, s = q.shape[:2]
        q, k, v = (t.view(b, s, -1, self.head_dim) for t in (q, k, v))                      # [b, s, heads, d]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)                     # [b, heads, s, d]

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        kwargs.pop("past_key_values", None)
        q, k, v = self._qkv(hidden_states)                                                # [b, heads, s, d]
        b, s = q.shape[0], q.shape[2]
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
        if self.sinks is not None:
            extra["s_aux"] = self.sinks  # as gpt_oss passes them (flash / flex kernels); eager reads self.sinks
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
        self.overlap_grad_comm = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lean = None if (self.fused or torch.is_grad_enabled() or self.sequence_parallel) \
            else _lean_fused(self, ("gate_proj", "up_proj"))
        if self.fused:
            gate, up = _project(self, x, getattr(self, self.fused))[0].chunk(2, dim=-1)
        elif lean is not None:  # one matmul over the fused gate/up rows (tensorpar.lean.fuse_projections)
            gate, up = torch.nn.functional.linear(x, *lean).chunk(2, dim=-1)
        else:
            gate, up = _project(self, x, self.gate_proj, self.up_proj)
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
        self.overlap_grad_comm = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (h,) = _project(self, x, getattr(self, self.up))
        y = getattr(self, self.down)(self.act_fn(h))
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

    def _qkv(self, hidden_states: torch.Tensor):
        q, k, v = _project(self, hidden_states, self.q_proj, self.k_proj, self.v_proj)
        b, s = q.shape[:2]
        ss = all_reduce_sum(torch.cat([self.q_norm.local_sum_of_squares(q), self.k_norm.local_sum_of_squares(k)], -1),
                            self.tp)                                                   # [b, s, 2] global sums
        q, k = self.q_norm.normalize(q, ss[..., :1]), self.k_norm.normalize(k, ss[..., 1:])
        return tuple(t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]


def _check_expert_layout(experts: nn.Module) -> None:
    for attr, bad in (("has_bias", True), ("is_transposed", True), ("is_concatenated", False),
                      ("has_post_expert_norm", True), ("has_gate", False)):
        if getattr(experts, attr, not bad) == bad:
            raise ValueError(f"{type(experts).__name__}.{attr}={bad} is not supported by tensorpar's sharded experts "
                             f"(they shard stacked, concatenated [gate | up] weights without biases or post-expert "
                             f"norms)")


def _take_expert_attrs(new: nn.Module, experts: nn.Module) -> None:
    """Give ``new`` what transformers' experts kernels read from ``self``: the plain attributes of ``experts``
    (config, sizes, layout flags), its ``act_fn``, its ``_apply_gate``, and its class's forward
    (``_hf_forward``: the dispatching one; ``_hf_eager``: the class's own loop). ``experts`` may itself be one of
    ours (a :class:`TPExperts` wrapped again by :class:`EPExperts`): the transformers class (``_hf_class``) is
    then the one it was built from."""
    cls = getattr(experts, "_hf_class", type(experts))
    new._hf_class = cls
    new._hf_forward = cls.forward
    new._hf_eager = getattr(new._hf_forward, "__wrapped__", new._hf_forward)
    for k, v in vars(experts).items():
        if not k.startswith("_") and k != "training":
            setattr(new, k, v)
    if hasattr(experts, "_is_expert_parallel"):
        new._is_expert_parallel = experts._is_expert_parallel
    for k, m in experts.named_children():
        setattr(new, k, m)
    if hasattr(cls, "_apply_gate"):            # grouped_mm / batched_mm call self._apply_gate
        new._apply_gate = cls._apply_gate.__get__(new)


def _experts_fn(mod: nn.Module, rows: int):
    """The kernel to run: the config's, unless it is ``grouped_mm`` and ``rows`` (elements) are not 16 bytes."""
    if getattr(mod.config, "_experts_implementation", None) == "grouped_mm" and \
            (rows * mod.down_proj.element_size()) % 16:
        return mod._hf_eager
    return mod._hf_forward


class TPExperts(nn.Module):
    """Mixture-of-experts experts with tensor parallelism inside every expert (transformers 5 stacked layout).

    Replaces the ``*Experts`` module of a sparse MoE block (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), whose weights
    are stacked over experts: ``gate_up_proj [E, 2f, h]`` (rows ``[gate | up]`` of every expert) and
    ``down_proj [E, h, f]``. Rank ``r`` holds ``gate_up_proj [E, 2 f_r, h]`` (its gate rows, then its up rows:
    column-parallel, never one contiguous block of ``2f``) and ``down_proj [E, h, f_r]`` (row-parallel), with
    ``f_r = partition.sizes[tp_rank]``; the router stays replicated outside this module.

    The expert math is transformers' own: the forward of the original class is called on this module (so the
    experts implementation the config selects, ``eager``, ``grouped_mm`` or ``batched_mm``, runs unchanged on
    the local weights); it yields each token's routing-weighted sum of its experts' partial outputs, and the
    partial sums of all experts are added over tp once, after the combine. ``grouped_mm`` needs rows of a
    multiple of 16 bytes: a rank whose ``f_r`` rows are not (e.g. ``f_r = 5`` in fp32) runs the class's eager
    loop instead (same math; the other ranks are unaffected).

    Shapes: ``hidden_states [T, h]`` (tokens flattened, replicated), ``top_k_index [T, k]`` (int),
    ``top_k_weights [T, k]`` (replicated) -> ``[T, h]`` replicated.

    Collectives: forward one all-reduce of ``[T, h]`` per MoE layer (not one per expert); backward one
    all-reduce of the input gradient ``[T, h]`` and one of the routing-weight gradient ``[T, k]`` (each rank's
    weight gradient is a partial sum over its ``f_r`` intermediate rows, so the router receives the full one).
    A step in which some expert receives no token is the same on every rank (routing is replicated), so no
    rank waits on another.

    Raises:
        ValueError: an experts layout this class does not shard (biases, transposed or interleaved gate/up
            weights, a post-expert norm, ungated experts), naming the attribute.
    """

    def __init__(self, experts: nn.Module, tp: Group, *, partition: Partition, region: bool = True):
        super().__init__()
        from tensorpar.layers.linear import _slice, mark_sharded

        _check_expert_layout(experts)
        #: False inside :class:`TPSharedExpertMoE`, which enters and leaves the tp region once for the whole block
        self.region = region
        e, two_f, h = experts.gate_up_proj.shape
        f = two_f // 2
        if partition.n != f or partition.tp_size != tp.size or tuple(experts.down_proj.shape) != (e, h, f):
            raise ValueError(f"expert partition {list(partition.sizes)} does not split the experts' intermediate "
                             f"size {f} (gate_up_proj {tuple(experts.gate_up_proj.shape)}, down_proj "
                             f"{tuple(experts.down_proj.shape)}) over tp_size={tp.size}")
        self.tp, self.partition = tp, partition
        _take_expert_attrs(self, experts)
        self.intermediate_dim = partition.sizes[tp.rank]
        rows = UnitSelection(2 * f, 1, tuple(tuple(partition.indices(r)) + tuple(f + i for i in partition.indices(r))
                                             for r in range(tp.size)))
        gu = _slice(experts.gate_up_proj.detach(), 1, rows, tp.rank).clone()
        dn = _slice(experts.down_proj.detach(), 2, partition, tp.rank).clone()
        self.gate_up_proj = mark_sharded(nn.Parameter(gu, requires_grad=experts.gate_up_proj.requires_grad), 1, rows)
        self.down_proj = mark_sharded(nn.Parameter(dn, requires_grad=experts.down_proj.requires_grad), 2, partition)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        x = comm.copy_to_tp_region(hidden_states, self.tp) if self.region else hidden_states
        w = comm.copy_to_tp_region(top_k_weights, self.tp) if self.region else top_k_weights
        # torch._grouped_mm needs 16-byte strides; where this rank's f_r rows do not have them, the eager loop
        partial = _experts_fn(self, self.intermediate_dim)(self, x, top_k_index, w)  # [T, h]: this rank's f_r rows
        return comm.reduce_from_tp_region(partial, self.tp) if self.region else partial

    def extra_repr(self) -> str:
        return (f"tp={self.tp.size}, experts={self.num_experts}, intermediate local {self.intermediate_dim} "
                f"of {self.partition.n}")


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with row splits; backward is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x, group, send: list[int], recv: list[int]):
        import torch.distributed as dist
        ctx.group, ctx.send, ctx.recv = group, send, recv
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group.pg)
        group.counter.record("all_to_all", x.numel(), x.element_size(), group.size)
        return out

    @staticmethod
    def backward(ctx, g):
        return _AllToAll.apply(g.contiguous(), ctx.group, ctx.recv, ctx.send), None, None, None


class EPExperts(nn.Module):
    """Mixture-of-experts experts distributed whole over an expert-parallel group, tokens moved by all-to-all.

    Rank ``r`` of ``ep`` holds experts ``[lo_r, hi_r)`` of ``partition`` (the ``E`` experts split over
    ``ep_size``, unevenly if need be): ``gate_up_proj [E_r, 2f, h]``, ``down_proj [E_r, h, f]``, marked
    ``ep_dim = 0`` over ``partition`` (:func:`tensorpar.grads.grad_norm` with ``ep=`` sums them over ep), and
    also ``tp_dim = 0`` so checkpoint loading given the ``ep`` group as its tp group reads this rank's experts. Each rank brings its own tokens (the batch is split over ``ep``,
    as in data parallelism; the router and everything outside the experts are replicated and their gradients
    must be summed over ``ep`` after backward, as data parallelism does).

    Forward, per MoE layer: each (token, choice) pair is sent to the rank that owns its expert (one all-to-all of
    the send counts, one of the ``[N, h]`` token rows, one of their expert ids), transformers' own experts kernel
    runs on the received rows with weight 1 (each row goes to one local expert), the outputs return by a second
    all-to-all ``[N, h]``, and each rank combines its tokens' ``k`` outputs with its routing weights.
    Backward: the two row all-to-alls in reverse. A rank whose experts receive no token sends and receives
    empty splits and still runs both all-to-alls in backward (its empty output is tied to the received rows and to
    its weights, whatever the kernel); its expert parameters then get zero gradients, not None (so AdamW still
    decays them, as in the unsharded model where the stacked weight always has a gradient).

    Shapes: ``hidden_states [T_r, h]`` (this rank's tokens), ``top_k_index [T_r, k]``, ``top_k_weights
    [T_r, k]`` -> ``[T_r, h]``.

    Combined with tensor parallelism (``ep x tp``): built from a :class:`TPExperts` (the model parallelized over
    ``tp`` first), each expert keeps its tp split (``tp_dim``/``tp_partition`` as before; the ep split is
    recorded as ``ep_dim = 0``/``ep_partition``); ``ep`` is then the group of ranks with the same tp rank, the
    rows travel within it, and the partial outputs are all-reduced over tp once after the combine (backward:
    input and routing-weight gradients all-reduced over tp, as in :class:`TPExperts`). The grad norm is then
    ``grad_norm(params, tp, ep=ep)``.

    Not done: capacity limits / token dropping (none: every token reaches its experts, as in transformers).

    Raises:
        ValueError: fewer experts than ``ep`` ranks, or an unsupported experts layout (as :class:`TPExperts`).
    """

    def __init__(self, experts: nn.Module, ep: Group, *, partition: Partition | None = None):
        super().__init__()
        from tensorpar.layers.linear import mark_sharded

        _check_expert_layout(experts)
        e = experts.gate_up_proj.shape[0]
        _take_expert_attrs(self, experts)
        inner = experts if isinstance(experts, TPExperts) else None
        self.tp = inner.tp if inner is not None else None
        self.region = inner.region if inner is not None else True
        self.ep = ep
        self.partition = partition or Partition.make(e, ep.size, name="num_experts")
        if self.partition.n != e or self.partition.tp_size != ep.size:
            raise ValueError(f"expert partition {list(self.partition.sizes)} does not split num_experts={e} over "
                             f"ep_size={ep.size}")
        self.num_experts_total = e
        lo, hi = self.partition.range(ep.rank)
        self.first_expert = lo
        self.num_experts = hi - lo                       # the kernel sees only this rank's experts
        owner = torch.repeat_interleave(torch.arange(ep.size), torch.tensor(self.partition.sizes))
        self.register_buffer("owner", owner, persistent=False)     # [E] expert -> ep rank
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(experts, name)
            w = p.detach()[lo:hi].clone() if p.device.type != "meta" else p.new_empty((hi - lo,) + tuple(p.shape[1:]))
            q = nn.Parameter(w, requires_grad=p.requires_grad)
            if inner is None:             # ep alone: loading reads the ep split as the tp one (ep passed as tp)
                mark_sharded(q, 0, self.partition)
            else:                         # tp layout as before
                mark_sharded(q, p.tp_dim, p.tp_partition)
            q.ep_dim, q.ep_partition = 0, self.partition    # the ep split: grad_norm sums these over ep
            setattr(self, name, q)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        tp_region = self.tp is not None and self.tp.size > 1 and self.region
        if tp_region:
            hidden_states = comm.copy_to_tp_region(hidden_states, self.tp)
            top_k_weights = comm.copy_to_tp_region(top_k_weights, self.tp)
        t, k = top_k_index.shape
        h = hidden_states.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)                       # grouped by expert, hence by owner rank
        experts_sorted = flat[order]
        rows = hidden_states[order // k]                                # [T_r k, h]
        if self.ep.size == 1:
            got, got_experts = rows, experts_sorted
        else:
            send_counts = torch.bincount(self.owner[experts_sorted], minlength=self.ep.size)
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts, group=self.ep.pg)
            send, recv = send_counts.tolist(), recv_counts.tolist()
            got = _AllToAll.apply(rows, self.ep, send, recv)          # [N_r, h] rows for this rank's experts
            got_experts = experts_sorted.new_empty(sum(recv))
            dist.all_to_all_single(got_experts, experts_sorted, recv, send, group=self.ep.pg)
        local = (got_experts - self.first_expert).unsqueeze(1)         # [N_r, 1]
        ones = torch.ones(local.shape, dtype=top_k_weights.dtype, device=local.device)
        out = _experts_fn(self, self.intermediate_dim)(self, got, local, ones)   # [N_r, h]
        if got.shape[0] == 0 and torch.is_grad_enabled():
            # no row reached this rank's experts, and a kernel that loops over the experts hit returns zeros
            # outside the graph: tie the empty output to the received rows and the weights, so backward still runs
            # both all-to-alls here (the other ep ranks wait on them) and the weights get zero gradients, not None
            out = out + (got.sum() + self.gate_up_proj.sum() + self.down_proj.sum()).to(out.dtype)
        if self.ep.size > 1:
            out = _AllToAll.apply(out, self.ep, recv, send)            # back to the tokens' rank, [T_r k, h]
        back = torch.empty_like(out)
        back[order] = out
        y = (back.view(t, k, h) * top_k_weights.unsqueeze(-1).to(out.dtype)).sum(1).to(hidden_states.dtype)
        return comm.reduce_from_tp_region(y, self.tp) if tp_region else y

    def extra_repr(self) -> str:
        lo = self.first_expert
        return f"ep={self.ep.size}, experts [{lo}, {lo + self.num_experts}) of {self.num_experts_total}"


def expert_parallelize(model: nn.Module, ep: Group) -> list[str]:
    """Replace every stacked-experts module of an unsharded MoE ``*ForCausalLM`` by :class:`EPExperts` over ``ep``.

    The modules are the experts of the MoE blocks of the model's built-in plan (:mod:`tensorpar.hf.families.moe`);
    everything else (routers, Qwen2-MoE's shared expert) is left replicated. Returns their names.
    The ``ep`` ranks split the batch between them, and the gradients of every parameter that is not an expert
    (no ``ep_dim``) must be summed over ``ep`` after backward. On a model
    already parallelized over tp (:func:`tensorpar.hf.apply.parallelize`), ``ep`` must be the group of ranks with
    the same tp rank (the ``dp`` axis of a :class:`~tensorpar.parallel.ParallelContext`), and each expert keeps
    its tp split.

    Raises:
        ValueError: the model has no MoE plan, or an experts module cannot be split (see :class:`EPExperts`).
    """
    from tensorpar.hf.plan import make_plan
    from tensorpar.hf.styles import MoEExperts, SharedExpertMoE

    plan = make_plan(model.config, 1, check=False)
    names = [n for n, _ in plan.modules(model, MoEExperts)]
    names += [f"{n}.experts" for n, _ in plan.modules(model, SharedExpertMoE)]   # the shared expert stays replicated
    if not names:
        from tensorpar.hf.families import why_not
        raise ValueError(why_not("expert_parallel", model.config)
                         or f"model_type={model.config.model_type!r} has no mixture-of-experts layers in its plan")
    for n in names:
        parent, _, child = n.rpartition(".")
        setattr(model.get_submodule(parent), child, EPExperts(model.get_submodule(n), ep))
    return names


def ep_load_balancing_loss(model: nn.Module, router_logits, ep: Group) -> torch.Tensor:
    """The load-balancing auxiliary loss of the whole batch when the batch is split over ``ep`` ranks.

    ``router_logits``: this rank's per-layer router logits (``output.router_logits``, each ``[T_r, E]``).
    Each layer's logits are all-gathered over ``ep`` (rows of every rank, ``[T, E]``) and passed to the model's
    own ``load_balancing_loss_func`` (transformers; Switch Transformer, Fedus et al. 2021, eq. 4), so the value is
    the one the unsharded model computes on the whole batch (it averages over all rows, so their order does not
    matter; no padding mask). Every rank returns the same value; backward splits the gradient of the gathered
    logits, so each rank's router receives the gradient of its own rows, and summing the router's gradient over
    ``ep`` (as for every replicated parameter) gives the unsharded one.

    Collectives: forward one all-gather of the row counts and one all-gather per layer of ``[T_r, E]``; backward
    none (a split).
    """
    import sys

    cfg = model.config
    fn = sys.modules[type(model).__module__].load_balancing_loss_func
    num_experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    logits = list(router_logits)
    if ep.size > 1:
        rows = torch.tensor([logits[0].shape[0]], device=logits[0].device)
        sizes = comm.all_gather(rows, ep, dim=0).tolist()
        logits = [comm._Gather.apply(x, ep, 0, sizes) for x in logits]
    return fn(tuple(logits), num_experts, cfg.num_experts_per_tok, None)


class TPSharedExpertMoE(nn.Module):
    """Qwen2-MoE's sparse block with one all-reduce: routed experts and the shared expert add their partial sums
    before a single reduction.

    ``y = experts(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)`` (transformers'
    ``Qwen2MoeSparseMoeBlock``). The router ``gate`` ``[E, h]`` and ``shared_expert_gate`` ``[1, h]`` are
    replicated (kept as the original modules, so transformers still records the router logits); the routed
    experts are :class:`TPExperts` over ``expert_partition``; the shared expert's ``gate_proj``/``up_proj`` are
    column-parallel and its ``down_proj`` row-parallel over ``shared_partition``. Both produce partial sums over
    this rank's intermediate rows; the per-token sigmoid gate scales the shared part (linear, so it may act on
    the partial sum), and the sum is all-reduced once.

    Shapes: ``[b, s, h]`` -> ``[b, s, h]``, replicated. Collectives: forward one all-reduce ``[b s, h]``; backward
    one all-reduce of the input gradient ``[b s, h]`` and one of the routing weights' and shared gate's gradients
    together ``[b s, k + 1]`` (they scale partial sums, so each rank's gradient is partial).

    Raises:
        ValueError: a shared expert with biases, or the errors of :class:`TPExperts`.
    """

    def __init__(self, block: nn.Module, tp: Group, *, expert_partition: Partition, shared_partition: Partition):
        super().__init__()
        se = block.shared_expert
        if any(getattr(se, n).bias is not None for n in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError("a shared expert with biases is not supported by tensorpar's one-reduction MoE block")
        self.tp = tp
        self.gate = block.gate
        self.experts = TPExperts(block.experts, tp, partition=expert_partition, region=False)
        self.shared_expert = TPGatedMLP(se, tp, partition=shared_partition)
        self.shared_expert_gate = block.shared_expert_gate

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        b, s, h = hidden_states.shape
        flat = hidden_states.reshape(-1, h)
        _, routing_weights, selected = self.gate(flat)
        g = torch.sigmoid(self.shared_expert_gate(flat))                                # [b s, 1] replicated
        k = routing_weights.shape[-1]
        # the weights multiply partial sums, so their gradients are partial: enter the region (one all-reduce
        # in backward for the routing weights and the shared gate together)
        wg = comm.copy_to_tp_region(torch.cat([routing_weights.to(g.dtype), g], -1), self.tp)
        x = comm.copy_to_tp_region(flat, self.tp)
        routed = self.experts(x, selected, wg[:, :k])                                   # [b s, h] partial
        se = self.shared_expert
        shared = F.linear(se.act_fn(se.gate_proj.forward_local(x)) * se.up_proj.forward_local(x),
                          se.down_proj.weight)                                          # [b s, h] partial
        y = routed + wg[:, k:] * shared
        return comm.reduce_from_tp_region(y, self.tp).reshape(b, s, h)

    def extra_repr(self) -> str:
        return f"tp={self.tp.size}, one all-reduce for routed and shared experts"


class TPSpanningRMSNorm(TPRMSNorm):
    """:class:`TPRMSNorm` for a norm applied after the split into heads (OLMoE's ``q_norm [heads * d]`` /
    ``k_norm [kv_heads * d]``): input and output ``[b, s, heads_r, d]``, normalised over all heads' features.

    As ``OlmoeRMSNorm``, the normalised value is cast to the input dtype before the weight multiplies it.
    Collectives: those of :class:`TPRMSNorm` (one all-reduce of ``[b, s, 1]`` in forward and in backward).
    """

    def normalize(self, x: torch.Tensor, sum_of_squares: torch.Tensor) -> torch.Tensor:
        y = x.float() * torch.rsqrt(sum_of_squares / self.n + self.variance_epsilon)
        return self.weight * y.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        return super().forward(x.reshape(*shape[:-2], -1)).view(shape)


class TPOlmoeAttention(TPAttention):
    """:class:`TPAttention` for OLMoE, whose ``q_norm`` / ``k_norm`` normalise over all heads at once
    (``[heads * d]``, ``[kv_heads * d]``), not per head: each becomes a :class:`TPSpanningRMSNorm` over the
    rank's q rows / KV rows. Shapes and collectives as :class:`TPAttention`, plus one all-reduce of
    ``[b, s, 1]`` per norm in forward and in backward.

    Raises:
        ValueError: ``config.clip_qkv`` set (not applied by the tensor-parallel attention).
    """

    def __init__(self, attn: nn.Module, tp: Group, layout: HeadLayout, **kw):
        if getattr(attn.config, "clip_qkv", None) is not None:
            raise ValueError(f"clip_qkv={attn.config.clip_qkv} is not supported by tensorpar's OLMoE attention; "
                             f"use a config with clip_qkv=None")
        q_norm, k_norm = attn.q_norm, attn.k_norm
        super().__init__(attn, tp, layout, **kw)
        self.q_norm = TPSpanningRMSNorm(q_norm, tp, layout.q_rows)
        self.k_norm = TPSpanningRMSNorm(k_norm, tp, layout.kv_rows)


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
