"""One decoder layer of the lean decode path as plain tensors and callables (:class:`Layer`, built by
:func:`build_layer` from a sharded Hugging Face layer): what :class:`~tensorpar.decode.lean.LeanDecoder` runs per
layer around attention (:mod:`tensorpar.decode.kv_cache`).

Each family feature is read from the sharded modules, not from the family's name: which norms the layer has
(pre-norms; Gemma 2/3's sandwich norms; OLMo 2's post-norms only), q/k norms (per head: Qwen3, Gemma 3; over the
whole projection with an all-reduced sum of squares: OLMo 2, OLMoE), the projections fused in the checkpoint
(Phi-3's ``qkv_proj`` / ``gate_up_proj``), a gated or plain MLP (StarCoder2's ``c_fc``/``c_proj``), the
activation, attention logit soft-capping (Gemma 2), the layer's sliding window and its rotary table (Gemma 3's
local/global). Norms run as fewer framework calls only where a probe shows them bitwise equal to the module
(:func:`~tensorpar.decode.kernels.rms_norm_fn`, :func:`gemma_norm_fn`), else the module runs. Collectives: only
OLMo 2's q/k norm (one all-reduce of ``[T, 2]`` fp32, as its module); the decoder runs the layer's two others.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from tensorpar import comm
from tensorpar.comm import Group
from tensorpar.decode.int8 import lean_weight
from tensorpar.decode.kernels import is_silu, kv_runs, rms_norm_fn
from tensorpar.hf.families import sliding_window
from tensorpar.hf.modules import TPGatedMLP, TPGPTNeoXAttention, TPMLP
from tensorpar.hf.modules.attention import TPOlmo2Attention
from tensorpar.hf.modules.norms import TPRMSNorm, all_reduce_sum
from tensorpar.layers.fused import fused_weight


class Layer:
    """A layer's pieces: norms ``ln1`` (before attention), ``post_attn`` (on attention's output), ``ln2`` (before
    the MLP), ``post_ff`` (on the MLP's output), each a callable or ``None`` where the family has none; matmul
    weights ``wqkv`` ``[h, (q+2kv)_local*d]``, ``wo`` ``[q_local*d, h]``, ``wgu`` ``[h, 2 f_local]`` (gated) or
    ``[h, f_local]`` (``gated`` False: up only), ``wd`` ``[f_local, h]`` (``[in, out]`` views of the module
    weights; :class:`~tensorpar.decode.int8.Int8Weight` ``[out, in]`` when quantized; oneDNN-packed when the
    decoder prepacks) with their biases (``None`` when absent), ``f`` = ``f_local``, the activation ``act``
    (``silu``: it is ``F.silu``, run in place); ``interleaved``: the q/k/v rows are per head (GPT-NeoX's
    ``query_key_value``); ``parallel``: the residual is ``x + attn(ln1(x)) + mlp(ln2(x))`` (GPT-NeoX); ``moe``: a
    mixture-of-experts block (``[1, T, h] -> [1, T, h]``, its all-reduce inside) called as it is instead of the
    matmuls, else ``None``; ``qk_norm`` ``(q [T, q_local, d], k [T, kv_local, d]) -> (q, k)`` or ``None``; attention's ``scaling``, ``sdpa`` (the kernel: ``F.scaled_dot_product_attention``, or
    :func:`softcap_sdpa`'s), ``window`` (sliding window or ``None``), ``rope`` (the key of its rotary table),
    ``gqa`` (query heads share KV heads in equal groups), ``kv_runs`` / ``kv_idx`` (unequal groups:
    :func:`~tensorpar.decode.kernels.kv_runs`); ``packs``: ``(field, owner, key, weight, params)`` of each
    matmul weight the decoder may prepack (``params()``: the parameters it is fused from, read only when packing:
    a quantized model's freed fp weights are never touched)."""
    __slots__ = ("ln1", "post_attn", "wqkv", "bqkv", "wo", "bo", "ln2", "post_ff", "gated", "wgu", "bgu", "f", "wd",
                 "bd", "act", "silu", "qk_norm", "kv_idx", "kv_runs", "gqa", "scaling", "sdpa", "window", "rope",
                 "packs", "moe", "interleaved", "parallel")


def gemma_norm_fn(mod):
    """Gemma's RMSNorm ``(x * rsqrt(mean(x^2) + eps)) * (1 + w)`` (all in fp32, cast back to the input's dtype) in
    fewer framework calls, or ``mod`` itself when a probe says it is not that formula bit for bit."""
    w = getattr(mod, "weight", None)
    eps = getattr(mod, "eps", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or not isinstance(eps, float):
        return mod

    def fn(x):
        h = x.float()
        return torch.mul(h, torch.mul(h, h).mean(-1, keepdim=True).add_(eps).rsqrt_()).mul_(w.float() + 1.0) \
            .to(x.dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n in (3, 1):
            probe = (torch.randn(n, w.shape[0], generator=g) * 3).to(w.device, w.dtype)
            if not torch.equal(fn(probe), mod(probe)):
                return mod
    return fn


def norm_fn(mod):
    """The fastest callable bitwise equal to norm module ``mod`` (``None`` stays ``None``)."""
    if mod is None:
        return None
    fn = rms_norm_fn(mod)
    return gemma_norm_fn(mod) if fn is mod else fn


def softcap_sdpa(cap: float):
    """An attention kernel with ``F.scaled_dot_product_attention``'s signature (the arguments the decoder passes)
    that soft-caps the logits, ``cap * tanh(scores / cap)``, before the mask and an fp32 softmax: transformers'
    eager attention with ``softcap`` (Gemma 2), which the fused kernel cannot do. ``q`` ``[b, n, s, d]``, ``k``/``v``
    ``[b, n_kv, L, d]`` (``n_kv`` divides ``n``: each KV head read by its group)."""
    def sdpa(q, k, v, attn_mask=None, scale=None, enable_gqa=False):
        if k.shape[1] != q.shape[1]:
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        w = torch.matmul(q, k.transpose(-1, -2)) * scale                     # [b, n, s, L]
        w = torch.tanh(w / cap) * cap
        if attn_mask is not None:
            w = w.masked_fill(~attn_mask, torch.finfo(w.dtype).min)
        return torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)
    return sdpa


def ordered_all_reduce(x: torch.Tensor, tp: Group) -> torch.Tensor:
    """Sum of ``x`` over ``tp`` in which every element is added in rank order, whatever ``x``'s shape: the
    shared-memory all-reduce (one host) and any all-reduce of two ranks (``a + b == b + a`` exactly) as they are;
    else (a ring or tree over three or more ranks, whose order per element depends on where the element falls in
    the chunks) one all-gather and a sum in rank order. Shapes: any -> the same. Collectives: one all-reduce, or
    one all-gather of ``[tp, *x.shape]``."""
    from tensorpar.shm.hierarchical import HierarchicalComm
    if tp.size <= 2 or (tp.fast is not None and x.is_cpu and not isinstance(tp.fast, HierarchicalComm)):
        return comm.all_reduce(x, tp)
    parts = comm.all_gather(x.unsqueeze(0), tp, dim=0)                                  # [tp, *x.shape]
    out = parts[0].clone()
    for r in range(1, tp.size):
        out.add_(parts[r])
    return out


def _qk_norm(a, tp: Group, ordered: bool = False):
    """The layer's q/k norm as ``(q [T, q_local, d], k [T, kv_local, d]) -> (q, k)``, or ``None``."""
    if a.q_norm is None:
        return None
    if isinstance(a, TPOlmo2Attention):   # over the whole projection: one all-reduce of both sums of squares
        qn, kn = a.q_norm, a.k_norm

        def full(q, k):
            T = q.shape[0]
            qf, kf = q.reshape(T, -1), k.reshape(T, -1)
            ss = (ordered_all_reduce if ordered else all_reduce_sum)(
                torch.cat([qn.local_sum_of_squares(qf), kn.local_sum_of_squares(kf)], -1), tp)
            return qn.normalize(qf, ss[:, :1]).view_as(q), kn.normalize(kf, ss[:, 1:]).view_as(k)
        return full
    if isinstance(a.q_norm, TPRMSNorm):       # OLMoE's norm over all heads: its module, all-reduce and all
        qn, kn = a.q_norm, a.k_norm
    else:                                     # per head (Qwen3, Gemma 3)
        qn, kn = norm_fn(a.q_norm), norm_fn(a.k_norm)
    return lambda q, k: (qn(q), kn(k))


def _norms(layer):
    """``(ln1, post_attn, ln2, post_ff)`` modules of a decoder layer, by transformers' names: pre-norms (Llama),
    pre- and post-norms (Gemma 2/3: ``pre_feedforward_layernorm``), post-norms only (OLMo 2: no
    ``input_layernorm``)."""
    g = lambda n: getattr(layer, n, None)      # noqa: E731
    if g("input_layernorm") is None:
        return None, g("post_attention_layernorm"), None, g("post_feedforward_layernorm")
    if g("pre_feedforward_layernorm") is not None:
        return g("input_layernorm"), g("post_attention_layernorm"), g("pre_feedforward_layernorm"), \
            g("post_feedforward_layernorm")
    return g("input_layernorm"), None, g("post_attention_layernorm"), None


def _projections(mod, fused: str | None, names: tuple[str, ...]):
    """``(weight [out, in] or Int8Weight, bias, () -> pack params)`` of a module's fused projection: the checkpoint's
    own (``fused``, e.g. Phi-3's ``qkv_proj``) or the one :func:`~tensorpar.decode.prepare.fuse_projections` made."""
    if fused:
        lin = getattr(mod, fused)
        return lean_weight(lin), lin.bias, lambda: (lin.weight,)
    w, b = fused_weight(mod, names)
    return w, b, lambda: tuple(getattr(mod, n).weight for n in names)


def _mlp(L: Layer, m, int8: bool, probe_w: torch.Tensor) -> None:
    """Fill ``L``'s MLP fields from the dense MLP ``m`` (gated, or up -> act -> down)."""
    if L.gated:
        wgu, L.bgu, pg = _projections(m, m.fused, ("gate_proj", "up_proj"))
        down = m.down_proj
    else:                                       # TPMLP: up -> act -> down
        up, down = getattr(m, m.up), getattr(m, m.down)
        wgu, L.bgu, pg = lean_weight(up), up.bias, lambda: (up.weight,)
    wd = lean_weight(down)
    # int8: Int8Weights [out, in] as they are; else [in, out] views (torch.mm(x, w.t()) is F.linear's own call)
    L.wgu, L.wd = (wgu, wd) if int8 else (wgu.t(), wd.t())
    L.packs += [("wgu", m, "gu", wgu, pg), ("wd", m, "down", wd, tuple)]
    L.bd = down.bias
    L.f = wd.shape[1]
    L.act = m.act_fn
    L.silu = is_silu(m.act_fn, probe_w)


def build_layer(layer, tp: Group, *, int8: bool, probe_w: torch.Tensor, rope=None,
                ordered: bool = False) -> Layer:
    """The :class:`Layer` of sharded decoder layer ``layer`` (``self_attn`` a
    :class:`~tensorpar.hf.modules.TPAttention`, or ``attention`` a :class:`~tensorpar.hf.modules.TPGPTNeoXAttention`;
    ``mlp`` a :class:`~tensorpar.hf.modules.TPGatedMLP`,
    :class:`~tensorpar.hf.modules.TPMLP` or a mixture-of-experts block; the projections fused by
    :func:`~tensorpar.decode.prepare.fuse_projections`). ``int8``: the model was quantized (its weights are
    :class:`~tensorpar.decode.int8.Int8Weight`); ``probe_w``: a weight whose dtype and device the activation
    probe uses; ``rope``: the key of the layer's rotary table; ``ordered``: OLMo 2's q/k norm all-reduce adds in rank
    order (:func:`ordered_all_reduce`, the deterministic mode)."""
    neox = isinstance(getattr(layer, "attention", None), TPGPTNeoXAttention)
    a, m = (layer.attention if neox else layer.self_attn), layer.mlp
    L = Layer()
    L.ln1, L.post_attn, L.ln2, L.post_ff = (norm_fn(n) for n in _norms(layer))
    wqkv, L.bqkv, pq = _projections(a, "query_key_value" if neox else a.fused, ("q_proj", "k_proj", "v_proj"))
    L.interleaved = neox                        # rows [h0: q, k, v | h1: q, k, v | ...]
    L.parallel = neox and bool(getattr(a.config, "use_parallel_residual", False))
    o = getattr(a, "dense" if neox else a.o_name)
    wo = lean_weight(o)
    # int8: Int8Weights [out, in] as they are; else [in, out] views (torch.mm(x, w.t()) is F.linear's own call)
    L.wqkv, L.wo = (wqkv, wo) if int8 else (wqkv.t(), wo.t())
    L.bo = o.bias
    L.packs = [("wqkv", a, "qkv", wqkv, pq), ("wo", a, "o", wo, tuple)]
    L.gated = isinstance(m, TPGatedMLP)
    L.moe = None if isinstance(m, (TPGatedMLP, TPMLP)) else m      # routed per token by the block itself
    if L.moe is None:
        _mlp(L, m, int8, probe_w)
    L.qk_norm = None if neox else _qk_norm(a, tp, ordered)
    L.gqa = a._group is not None and a._group > 1
    idx = a.layout.kv_index(tp.rank)
    # query heads whose KV heads are not in equal groups (heads split unevenly): attention per KV head on
    # views, each run of query heads with its one KV head, instead of copying every KV head per query head
    L.kv_runs = None if a._group is not None else kv_runs(idx)
    L.kv_idx = None if a._group is not None else torch.tensor(idx, device=probe_w.device)
    L.scaling = a.scaling
    cap = getattr(a, "softcap", None)
    L.sdpa = F.scaled_dot_product_attention if cap is None else softcap_sdpa(float(cap))
    L.window = layer_window(a.config, a.layer_idx)
    L.rope = rope
    return L


def layer_window(config, i: int) -> int | None:
    """Layer ``i``'s sliding window: the model's (:func:`tensorpar.hf.families.sliding_window`) on every layer
    without ``layer_types`` (Mistral, StarCoder2, Phi-3 read it from the config, not the attention module), else
    on the ``sliding_attention`` layers only (Qwen2 from ``max_window_layers``, Gemma 2/3)."""
    w = sliding_window(config)
    types = getattr(config, "layer_types", None)
    return w if w is None or not types or types[i] == "sliding_attention" else None


def windowed(segments: list, window: int | None, device: torch.device) -> list:
    """``segments`` with each mask narrowed to a sliding window: the query at cache position ``p`` attends to
    positions ``(p - window, p]`` (transformers' sliding-window mask, over cache positions as ``generate``'s
    ``cache_position``) and, as before, only where the segment's mask allows; a query always keeps itself. A
    segment no query of which reaches past the window (``length <= window``) is returned as it is."""
    if window is None:
        return segments
    out = []
    for g in segments:
        if g.length <= window:
            out.append(g)
            continue
        qpos = g.cache_pos if g.cache_pos is not None else \
            torch.arange(g.start, g.start + g.s, device=device).expand(g.b, g.s)        # [b, s]
        k = torch.arange(g.length, device=device)
        q = qpos[:, None, :, None]
        win = ((k > q - window) & (k <= q)) if g.mask is None else (k > q - window) & g.mask
        ng = copy.copy(g)
        ng.mask = win | (k == q)                                                        # [b, 1, s, length]
        out.append(ng)
    return out


def rotate(qk: torch.Tensor, cos: torch.Tensor, sin_sign: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """The families' rotary formula ``q*cos + rotate_half(q)*sin`` on the first ``rd = cos.shape[-1]`` features
    of each head of ``qk`` ``[T, heads, d]`` (the others pass: partial rotary), ``rotate_half(q)*sin`` computed
    exactly as ``q[..., perm] * sin_sign`` (``cos``, ``sin_sign`` ``[T, 1, rd]``). Returns a new tensor."""
    rd = cos.shape[-1]
    if rd == qk.shape[-1]:
        rot = qk.index_select(-1, perm).mul_(sin_sign)
        return torch.mul(qk, cos).add_(rot)
    part = qk[..., :rd]
    rot = part.index_select(-1, perm).mul_(sin_sign)
    return torch.cat([torch.mul(part, cos).add_(rot), qk[..., rd:]], -1)
