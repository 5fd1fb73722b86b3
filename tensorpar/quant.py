"""int8 weight-only quantization for the lean decode path (``--quantize int8``).

Every Linear of the decoder (the fused q/k/v and gate/up projections, o_proj, down_proj) and the LM head is stored
as ``int8`` with one scale per output channel (symmetric absmax, round to nearest: ``s = max|W[o, :]| / 127``,
``q = round(W / s)`` clamped to [-127, 127]; the scheme of gpt-fast's ``WeightOnlyInt8QuantHandler`` and of
LLM.int8()'s weight side). Activations stay in the model's dtype; the matmul dequantizes on the fly.

Sharding invariance: a scale covers a whole row of the *full* (unsharded) weight. Column-parallel layers and the
vocabulary-parallel LM head hold whole rows, so their local absmax is the full row's. Row-parallel layers
(o_proj, down_proj) hold a slice of every row: their absmax is all-reduced with ``op="max"`` over the
tensor-parallel group, which gives the scale of the full row. ``q`` is elementwise given ``s``, so each rank
holds exactly the slice of the full quantized weight, and a row-parallel partial sum ``x_r q_r^T`` times the
common ``s`` sums to ``(x q^T) s``: the quantized model at any tp equals the quantized model at tp=1 up to
floating-point summation order (tests/test_quant.py: greedy tokens equal at tp 1/2/3). No group scales are
used, so no shard boundary can cut a group.

Compute (:func:`int8_linear`): ``torch._weight_int8pack_mm(x, q, s)`` (gpt-fast's CPU int8 kernel) for bfloat16
activations on CPU when ``in_features % 16 == 0`` (torch 2.13 segfaults otherwise); for float32 that kernel is
slower than the fp32 matmul itself (bench/results/decode_int8.md), so float32 (and every other case, CUDA
included) runs ``F.linear(x, q.to(x.dtype)) * s``, dequantizing at most 2M weights at a time. That path is
correct but slower than fp32 decode on this CPU (the int8 -> fp32 conversion dominates; docs/quantize.md):
int8 pays off with ``--dtype bfloat16``.

The model's floating-point weights are overwritten with the dequantized values ``q * s`` ("fake quantization"),
so the module path (``path="hf"``) and :mod:`tensorpar.verify` see the same quantized model; the fp copies stay
resident (the memory saving is not taken; only the lean path reads the int8 tensors).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from tensorpar import comm
from tensorpar.comm import Group

#: weights dequantized per call of the float32 path (8 MB of fp32): a chunk stays in the allocator's reuse range
_CHUNK_ELEMS = 2 ** 21

#: values of ``--quantize``
QUANTIZE_CHOICES = ("none", "int8")


class Int8Weight(NamedTuple):
    """``q`` ``[out_local, in_local]`` int8 and ``scale`` ``[out_local]`` in the compute dtype;
    ``W ≈ q * scale[:, None]``."""
    q: torch.Tensor
    scale: torch.Tensor


def int8_linear(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (q * s)^T + bias`` for ``x`` ``[..., in]``; returns ``[..., out]`` in ``x``'s dtype. No collectives."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.shape[-1] % 16 == 0:
        # torch 2.13's CPU kernel crashes (SIGSEGV, no error) unless in_features is a multiple of 16
        y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), w.q, w.scale).view(*x.shape[:-1], -1)
    else:
        # dequantize at most _CHUNK_ELEMS weights at a time: a whole LM head (SmolLM2: 28M) dequantized at once
        # is a fresh 113 MB buffer per call, page-faulted in every time (12x slower than fp32, measured)
        step = max(1, _CHUNK_ELEMS // w.q.shape[1])
        n = w.q.shape[0]
        if n <= step:
            y = F.linear(x, w.q.to(x.dtype))
        else:
            y = torch.cat([F.linear(x, w.q[c:c + step].to(x.dtype)) for c in range(0, n, step)], dim=-1)
        y = y * w.scale
    return y if bias is None else y + bias


def _quantize(w: torch.Tensor, tp: Group | None) -> Int8Weight:
    """Quantize ``w`` ``[out, in_local]`` in place (its values become ``q * s``); ``tp``: all-reduce the row absmax
    (row-parallel: the input dim is sharded), ``None``: the rows are whole."""
    wf = w.detach().float()
    amax = wf.abs().amax(dim=1)
    if tp is not None:
        amax = comm.all_reduce(amax, tp, op="max")
    scale = (amax.clamp_min(1e-12) / 127).to(w.dtype)        # the stored scale, in the compute dtype
    sf = scale.float()[:, None]
    q = torch.round(wf / sf).clamp_(-127, 127).to(torch.int8)
    with torch.no_grad():
        w.copy_((q.float() * sf).to(w.dtype))
    return Int8Weight(q.contiguous(), scale.contiguous())


def quantize_int8(model, tp: Group) -> None:
    """Quantize the decoder's Linears and the LM head of ``model`` (sharded by
    :func:`tensorpar.hf.apply.parallelize`, a family the lean path runs) to int8 with per-output-channel scales,
    in place; the int8 tensors are kept for :class:`tensorpar.lean.LeanDecoder` (see the module docstring).

    Collectives: one all-reduce (max) of ``[h]`` per row-parallel layer (2 per decoder layer), in layer order on
    every rank. Raises ValueError if the model cannot run the lean path or is already quantized.
    """
    from tensorpar.lean import fuse_projections, fused_weight, lean_unsupported

    why = lean_unsupported(model)
    if why is not None:
        raise ValueError(f"--quantize int8 runs on the lean decode path, which cannot run this model: {why}; "
                         f"use --quantize none")
    if model.__dict__.get("_tensorpar_int8") is not None:
        raise ValueError("the model is already quantized (quantize_int8 was called twice)")
    fuse_projections(model)
    q = {}
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        q[id(a)] = {"qkv": _quantize(fused_weight(a, ("q_proj", "k_proj", "v_proj"))[0], None),
                    "o": _quantize(a.o_proj.weight, tp)}
        q[id(m)] = {"gu": _quantize(fused_weight(m, ("gate_proj", "up_proj"))[0], None),
                    "down": _quantize(m.down_proj.weight, tp)}
    q["lm_head"] = _quantize(model.lm_head.weight, None)
    q["dtype"] = model.lm_head.weight.dtype
    model.__dict__["_tensorpar_int8"] = q


def quantize_reference_int8(model) -> None:
    """The same quantization on an unsharded ``*ForCausalLM`` (the reference of :mod:`tensorpar.verify`), in plain
    PyTorch: every ``nn.Linear`` under ``model.model.layers`` and the LM head get ``round(W / s) * s`` with
    ``s = max|W[o, :]| / 127`` per output row, in place. No int8 tensors are kept; no collectives."""
    linears = [m for layer in model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    for m in linears + [model.lm_head]:
        _quantize(m.weight, None)


def int8_weights(model) -> dict | None:
    """The int8 tensors :func:`quantize_int8` stored on ``model`` (``None`` if it was not quantized)."""
    return model.__dict__.get("_tensorpar_int8")


def int8_weight_bytes(model) -> int:
    """Bytes of this rank's int8 weights and scales (what the lean path reads per token for its Linears and LM
    head; norms, biases and the one embedding row per token are not counted)."""
    q = int8_weights(model)
    n = 0
    for v in q.values():
        for w in (v.values() if isinstance(v, dict) else [v]):
            if isinstance(w, Int8Weight):
                n += w.q.numel() + w.scale.numel() * w.scale.element_size()
    return n
