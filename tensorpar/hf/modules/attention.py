"""Tensor-parallel attention for the rotary decoders (llama-shaped, StarCoder2, OLMo 2, OLMoE) and encoders (ViT):
q/k/v column-parallel by heads (KV heads duplicated where a GQA group straddles ranks), o row-parallel.
"""
from __future__ import annotations

import sys

import torch
import torch.nn as nn

from tensorpar import comm
from tensorpar.comm import Group
from tensorpar.hf.modules.common import _head_rows, _lean_fused, _project
from tensorpar.hf.modules.norms import TPRMSNorm, TPSpanningRMSNorm, all_reduce_sum
from tensorpar.layers.attention import HeadLayout
from tensorpar.layers.linear import ColumnParallelLinear, RowParallelLinear

def _partial_rotary_dim(config, head_dim: int) -> int | None:
    """The rotated features of a head under partial rotary (``partial_rotary_factor`` < 1, in the config or its
    ``rope_parameters``), else None."""
    rp = getattr(config, "rope_parameters", None)
    f = rp.get("partial_rotary_factor") if isinstance(rp, dict) else None
    f = f if f is not None else getattr(config, "partial_rotary_factor", None)
    return int(head_dim * f) if isinstance(f, (int, float)) and 0 < f < 1 else None


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

    Context parallelism: with ``cp`` (a :class:`~tensorpar.comm.Group` of more than one rank, set by
    :func:`context_parallelize`) the rank holds ``s / cp`` positions of each sequence (load-balanced, the rotary
    tables come from the caller's ``position_ids``) and attention runs over the whole sequence by
    :func:`tensorpar.layers.ring_attention.cp_attention` (``cp_mode`` "ring" or "all2all"); the attention mask is
    the causal one of the global positions (the model's own ``attention_mask`` is not used).

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
        self._rotary_dim = _partial_rotary_dim(attn.config, layout.head_dim)
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
        # an nn.Dropout the module applies after its output projection (GPT-BigCode's resid_dropout): kept, made a
        # keyed dropout by parallelize like the families' output dropouts
        rd = getattr(attn, "resid_dropout", None)
        self.output_dropout = nn.Dropout(rd.p) if isinstance(rd, nn.Dropout) and rd.p > 0 else None
        self.overlap_grad_comm = True
        self.cp, self.cp_mode = None, "ring"

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
        fused q/k/v rows (:func:`tensorpar.decode.prepare.fuse_projections`) run as one matmul."""
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
        for key in ("past_key_values", "layer_past"):   # the cache's name in the family's block (GPT-BigCode)
            c = kwargs.pop(key, None)
            cache = cache if cache is not None else c
        q, k, v = self._qkv(hidden_states)                                                # [b, heads, s, d]
        b, s = q.shape[0], q.shape[2]
        if position_embeddings is not None and self._rope is not None:
            q, k = self._rotate(q, k, *position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        if self._group is None:
            k = self.layout.expand_kv(k, self.tp.rank)  # [b, q_local, s_kv, d]
            v = self.layout.expand_kv(v, self.tp.rank)
        if self.cp is not None and self.cp.size > 1:    # s = s_global / cp positions; attention over all of them
            from tensorpar.layers.ring_attention import cp_attention
            out = cp_attention(q, k, v, self.cp, self.cp_mode, scale=self.scaling).transpose(1, 2)  # [b, s, h, d]
            weights = None
        else:
            out, weights = self._attend(q, k, v, attention_mask, **kwargs)
        out = out.reshape(b, s, -1).contiguous()  # [b, s, q_local * d]
        out = getattr(self, self.o_name)(out)
        if self.output_dropout is not None:
            out = self.output_dropout(out)
        return out, weights

    def _rotate(self, q, k, cos, sin):
        """The family's rotary embedding on q, k ``[b, heads, s, d]``. Partial rotary (the config's
        ``partial_rotary_factor`` < 1 and tables ``[.., r]`` of ``r = d * factor`` features: Phi and StableLM rotate
        the first ``r`` features of each head in the attention forward and pass the rest): the family's function
        gets those ``r`` features only (one that splits them itself, GLM's, sees ``r`` of ``r`` and passes
        nothing). Tables narrower than the head for another reason (GPT-OSS's half-width ones, factor 1) go to the
        family's function whole, as before."""
        r, d = cos.shape[-1], q.shape[-1]
        if r >= d or r != self._rotary_dim:
            return self._rope(q, k, cos, sin)
        (qr, qp), (kr, kp) = q.split([r, d - r], -1), k.split([r, d - r], -1)
        qr, kr = self._rope(qr, kr, cos, sin)
        return torch.cat([qr, qp], -1), torch.cat([kr, kp], -1)

    def _attend(self, q, k, v, attention_mask, **kwargs):
        """The kernel of one process over the whole sequence: ``(out [b, s, heads, d], weights)``."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        keyed = self.training and self.attention_fn is not None
        fn = self.attention_fn if keyed else ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, self._attn_default)
        extra = {"sliding_window": self.sliding_window} if self.sliding_window is not None else {}
        if self.softcap is not None:
            extra["softcap"] = self.softcap
        if self.sinks is not None:
            extra["s_aux"] = self.sinks  # as gpt_oss passes them (flash / flex kernels); eager reads self.sinks
        return fn(self, q, k, v, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
                  scaling=self.scaling, **extra, **kwargs)

    def extra_repr(self) -> str:
        return f"tp={self.tp.size}, {self.layout.describe()}"


def context_parallelize(model: nn.Module, cp: Group, mode: str = "ring") -> int:
    """Give every :class:`TPAttention` of ``model`` the context-parallel group ``cp`` and ``mode`` ("ring" or
    "all2all"); returns how many modules were set. The caller feeds each rank its positions of the sequence
    (:func:`tensorpar.layers.ring_attention.cp_shard`) and their ``position_ids``.

    Raises:
        ValueError: ``cp`` has more than one rank and the model has no :class:`TPAttention` (a family whose
            attention does not support it), or a module windows or soft-caps its attention, or has sinks.
    """
    n = 0
    for name, m in model.named_modules():
        if isinstance(m, TPAttention):
            if m.sliding_window is not None or m.softcap is not None or m.sinks is not None:
                raise ValueError(f"{name}: context parallelism needs plain causal attention (no sliding window, "
                                 f"soft-cap or sinks); use cp=1")
            m.cp, m.cp_mode = cp, mode
            n += 1
    if n == 0 and cp.size > 1:
        raise ValueError(f"cp={cp.size}: {type(model).__name__} has no attention module that supports context "
                         f"parallelism; use cp=1")
    model.tensorpar_cp = cp   # pipeline stages read it for their positions
    return n


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
