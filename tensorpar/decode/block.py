"""One decoder layer of the lean decode path as plain tensors and callables (:class:`Layer`, built by
:func:`build_layer` from a sharded Hugging Face layer): what :class:`~tensorpar.decode.lean.LeanDecoder` runs per
layer around attention (:mod:`tensorpar.decode.kv_cache`). No collectives here; the decoder runs the layer's two
all-reduces.
"""
from __future__ import annotations

import torch

from tensorpar.comm import Group
from tensorpar.decode.int8 import lean_weight
from tensorpar.decode.kernels import is_silu, kv_runs, rms_norm_fn
from tensorpar.layers.fused import fused_weight


class Layer:
    """A layer's pieces: norms ``ln1``/``ln2`` (callables), matmul weights ``wqkv`` ``[h, (q+2kv)_local*d]``,
    ``wo`` ``[q_local*d, h]``, ``wgu`` ``[h, 2 f_local]``, ``wd`` ``[f_local, h]`` (``[in, out]`` views of the
    module weights; :class:`~tensorpar.decode.int8.Int8Weight` ``[out, in]`` when quantized; oneDNN-packed when the
    decoder prepacks) with their biases (``None`` when absent), ``f`` = ``f_local``, the activation ``act``
    (``silu``: it is ``F.silu``, run in place), and attention's ``scaling``, ``gqa`` (query heads share KV heads in
    equal groups), ``kv_runs`` / ``kv_idx`` (unequal groups: :func:`~tensorpar.decode.kernels.kv_runs`)."""
    __slots__ = ("ln1", "wqkv", "bqkv", "wo", "bo", "ln2", "wgu", "bgu", "f", "wd", "bd", "act", "silu",
                 "kv_idx", "kv_runs", "gqa", "scaling")


def build_layer(layer, tp: Group, *, int8: bool, probe_w: torch.Tensor) -> Layer:
    """The :class:`Layer` of sharded decoder layer ``layer`` (``self_attn`` a
    :class:`~tensorpar.hf.modules.TPAttention`, ``mlp`` gated with ``gate_proj``/``up_proj``/``down_proj``; the
    projections fused by :func:`~tensorpar.decode.prepare.fuse_projections`). ``int8``: the model was quantized
    (its weights are :class:`~tensorpar.decode.int8.Int8Weight`); ``probe_w``: a weight whose dtype and device the
    activation probe uses."""
    a, m = layer.self_attn, layer.mlp
    L = Layer()
    L.ln1, L.ln2 = rms_norm_fn(layer.input_layernorm), rms_norm_fn(layer.post_attention_layernorm)
    wqkv, L.bqkv = fused_weight(a, ("q_proj", "k_proj", "v_proj"))
    wgu, L.bgu = fused_weight(m, ("gate_proj", "up_proj"))
    wo, wd = lean_weight(a.o_proj), lean_weight(m.down_proj)
    if int8:        # Int8Weights [out, in] (the fp weights were freed): int8_linear reads them as they are
        L.wqkv, L.wo, L.wgu, L.wd = wqkv, wo, wgu, wd
    else:           # [in, out] views of the [out, in] weights: torch.mm(x, w.t()) is F.linear's own call
        L.wqkv, L.wo, L.wgu, L.wd = wqkv.t(), wo.t(), wgu.t(), wd.t()
    L.bo, L.bd = a.o_proj.bias, m.down_proj.bias
    L.f = wd.shape[1]
    L.act = m.act_fn
    L.silu = is_silu(m.act_fn, probe_w)
    L.gqa = a._group is not None and a._group > 1
    idx = a.layout.kv_index(tp.rank)
    # query heads whose KV heads are not in equal groups (heads split unevenly): attention per KV head on
    # views, each run of query heads with its one KV head, instead of copying every KV head per query head
    L.kv_runs = None if a._group is not None else kv_runs(idx)
    L.kv_idx = None if a._group is not None else torch.tensor(idx, device=probe_w.device)
    L.scaling = a.scaling
    return L
