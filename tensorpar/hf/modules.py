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
from tensorpar.shard import Partition


def _enter(x: torch.Tensor, tp: Group, sequence_parallel: bool) -> torch.Tensor:
    if sequence_parallel:
        return comm.gather_from_sequence_region(x, tp, dim=1)
    return comm.copy_to_tp_region(x, tp)


class TPAttention(nn.Module):
    """Self-attention with query heads split and KV heads selected per rank (:class:`HeadLayout`).

    Replaces a Llama/Mistral/Qwen2 ``*Attention`` module and keeps its call signature.
    Shapes: input ``[b, s, h]`` (``[b, s_r, h]`` under sequence parallelism); local query heads
    ``[b, q_local, s, d]``; local KV heads ``[b, kv_local, s_kv, d]`` (what the cache stores);
    output ``[b, s, h]`` replicated (``[b, s_r, h]`` under sequence parallelism).

    Collectives: forward one all-reduce in ``o_proj`` (reduce-scatter with sequence parallelism,
    plus an all-gather at entry); backward one all-reduce at entry (reduce-scatter with
    sequence parallelism, plus an all-gather at ``o_proj``).
    """

    def __init__(self, attn: nn.Module, tp: Group, layout: HeadLayout, *, sequence_parallel: bool = False):
        super().__init__()
        self.tp, self.layout, self.sequence_parallel = tp, layout, sequence_parallel
        self.config = attn.config
        self.layer_idx = attn.layer_idx
        self.head_dim = layout.head_dim
        self.scaling = attn.scaling
        self.attention_dropout = getattr(attn, "attention_dropout", 0.0)
        self.sliding_window = getattr(attn, "sliding_window", None)
        self.is_causal = True
        # Uniform local groups: the attention kernel broadcasts each KV head to its g query heads
        # (HF's sdpa/eager paths); otherwise (a group straddling ranks) KV heads are gathered per query head.
        self._group = layout.uniform_group(tp.rank)
        self.num_key_value_groups = self._group or 1
        self._rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self._attn_default = sys.modules[type(attn).__module__].eager_attention_forward
        self.q_proj = ColumnParallelLinear.from_linear(attn.q_proj, tp, partition=layout.q_rows)
        self.k_proj = ColumnParallelLinear.from_linear(attn.k_proj, tp, partition=layout.kv_rows)
        self.v_proj = ColumnParallelLinear.from_linear(attn.v_proj, tp, partition=layout.kv_rows)
        self.o_proj = RowParallelLinear.from_linear(attn.o_proj, tp, partition=layout.q_rows,
                                                    sequence_parallel=sequence_parallel)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        kwargs.pop("past_key_values", None)
        x = _enter(hidden_states, self.tp, self.sequence_parallel)
        b, s = x.shape[:2]
        q = self.q_proj.forward_local(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # [b, q_local, s, d]
        k = self.k_proj.forward_local(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # [b, kv_local, s, d]
        v = self.v_proj.forward_local(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = self._rope(q, k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        if self._group is None:
            k = self.layout.expand_kv(k, self.tp.rank)  # [b, q_local, s_kv, d]
            v = self.layout.expand_kv(v, self.tp.rank)
        fn = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self._attn_default)
        extra = {"sliding_window": self.sliding_window} if self.sliding_window is not None else {}
        out, weights = fn(self, q, k, v, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
                          scaling=self.scaling, **extra, **kwargs)
        out = out.reshape(b, s, -1).contiguous()  # [b, s, q_local * d]
        return self.o_proj(out), weights

    def extra_repr(self) -> str:
        return f"tp={self.tp.size}, {self.layout.describe()}"


class TPGatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with the intermediate dim split (column, column, row).

    Shapes: input/output ``[b, s, h]`` (``[b, s_r, h]`` with sequence parallelism); the
    intermediate ``[b, s, f_r]`` with ``f_r = partition.sizes[tp_rank]``.
    Collectives: forward one all-reduce (reduce-scatter, plus an all-gather at entry, with
    sequence parallelism); backward one all-reduce (or reduce-scatter + all-gather).
    """

    def __init__(self, mlp: nn.Module, tp: Group, *, partition: Partition | None = None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.tp, self.sequence_parallel = tp, sequence_parallel
        part = partition or tp.partition(mlp.gate_proj.out_features, what="intermediate_size")
        self.gate_proj = ColumnParallelLinear.from_linear(mlp.gate_proj, tp, partition=part)
        self.up_proj = ColumnParallelLinear.from_linear(mlp.up_proj, tp, partition=part)
        self.down_proj = RowParallelLinear.from_linear(mlp.down_proj, tp, partition=part,
                                                       sequence_parallel=sequence_parallel)
        self.act_fn = mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _enter(x, self.tp, self.sequence_parallel)
        return self.down_proj(self.act_fn(self.gate_proj.forward_local(x)) * self.up_proj.forward_local(x))

    def extra_repr(self) -> str:
        return f"tp={self.tp.size}, intermediate local {self.gate_proj.out_features_local}"


def sequence_parallel_entry(layer: nn.Module, tp: Group) -> None:
    """Make ``layer`` (the first decoder block) split its input along the sequence.

    ``[b, s, h] -> [b, s_r, h]``; forward split (no communication), backward all-gather.
    The block's ``forward`` is wrapped on the instance, so parameter names are unchanged.
    """
    inner = layer.forward

    def forward(hidden_states, *args, **kwargs):
        return inner(comm.scatter_to_sequence_region(hidden_states, tp, dim=1), *args, **kwargs)

    layer.forward = forward
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
