"""The int8 weight format of ``--quantize int8`` (:mod:`tensorpar.decode.quantize` makes it): :class:`Int8Weight`
(``q`` int8 and one scale per output row), its matmul (:func:`int8_linear`), the per-row quantizer
(:func:`quantize_rows`), and the Linear / embedding classes a module becomes once its fp weight is freed.

Compute (:func:`int8_linear`): ``torch._weight_int8pack_mm(x, q, s)`` (gpt-fast's CPU int8 kernel) for bfloat16
activations on CPU when ``in_features % 16 == 0`` (torch 2.13 segfaults otherwise); for float32 that kernel is
slower than the fp32 matmul itself (bench/results/decode_int8.md), so float32 (and every other case, CUDA
included) runs ``F.linear(x, q.to(x.dtype)) * s``, dequantizing at most 2M weights at a time. That path is
correct but slower than fp32 decode on this CPU (the int8 -> fp32 conversion dominates; docs/quantize.md):
int8 pays off with ``--dtype bfloat16``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from tensorpar import comm
from tensorpar.comm import Group
from tensorpar.layers.embedding import VocabParallelEmbedding
from tensorpar.layers.linear import ColumnParallelLinear, RowParallelLinear

#: weights dequantized per call of the float32 path (8 MB of fp32): a chunk stays in the allocator's reuse range
_CHUNK_ELEMS = 2 ** 21


class Int8Weight(NamedTuple):
    """``q`` ``[out_local, in_local]`` int8 and ``scale`` ``[out_local]`` in the compute dtype;
    ``W ≈ q * scale[:, None]``. ``dtype``, ``device`` and ``shape`` are those of the weight it stands for."""
    q: torch.Tensor
    scale: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.scale.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """``q * s`` ``[out_local, in_local]`` in the compute dtype (a new tensor): the values
        :func:`quantize_rows` wrote into the fp weight, bit for bit."""
        return (self.q.float() * self.scale.float()[:, None]).to(self.scale.dtype)


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


def quantize_rows(w: torch.Tensor, tp: Group | None, *, write: bool = True) -> Int8Weight:
    """Quantize ``w`` ``[out, in_local]``; ``tp``: all-reduce the row absmax (row-parallel: the input dim is
    sharded), ``None``: the rows are whole. ``write``: overwrite ``w`` in place with ``q * s``. Works on blocks of
    at most ``_CHUNK_ELEMS`` weights, so its temporaries stay small (a whole fp32 LM head would need three
    transient copies); the result is the same elementwise."""
    rows = range(0, w.shape[0], max(1, _CHUNK_ELEMS // max(1, w.shape[1])))
    step = rows.step
    wd = w.detach()
    amax = torch.cat([wd[r:r + step].float().abs().amax(dim=1) for r in rows])
    if tp is not None:
        amax = comm.all_reduce(amax, tp, op="max")
    scale = (amax.clamp_min(1e-12) / 127).to(w.dtype)        # the stored scale, in the compute dtype
    sf = scale.float()[:, None]
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    for r in rows:
        q[r:r + step] = torch.round(wd[r:r + step].float() / sf[r:r + step]).clamp_(-127, 127)
    out = Int8Weight(q, scale.contiguous())
    if write:
        with torch.no_grad():
            for r in rows:
                w[r:r + step] = Int8Weight(q[r:r + step], out.scale[r:r + step]).dequantize()
    return out


class _Int8Weighted:
    """Mixin of a Linear whose fp ``weight`` parameter was freed by :func:`quantize_int8`: ``weight`` dequantizes
    ``_int8_weight`` (an :class:`Int8Weight`) on each access, so the module's own forward computes the quantized
    model with a transient fp copy of this one matrix. Inference only (the dequantized tensor has no gradient)."""

    @property
    def weight(self) -> torch.Tensor:
        return self.__dict__["_int8_weight"].dequantize()


class Int8ColumnParallelLinear(_Int8Weighted, ColumnParallelLinear):
    """A :class:`~tensorpar.layers.linear.ColumnParallelLinear` quantized by :func:`quantize_int8` (shapes and
    collectives unchanged; ``weight`` ``[n_r, in]`` is dequantized on access, see :class:`_Int8Weighted`)."""


class Int8RowParallelLinear(_Int8Weighted, RowParallelLinear):
    """A :class:`~tensorpar.layers.linear.RowParallelLinear` quantized by :func:`quantize_int8` (shapes and
    collectives unchanged; ``weight`` ``[out, k_r]`` is dequantized on access, see :class:`_Int8Weighted`)."""


class Int8VocabParallelEmbedding(VocabParallelEmbedding):
    """A :class:`~tensorpar.layers.embedding.VocabParallelEmbedding` tied to a quantized LM head: its rows are
    looked up in the head's int8 tensor and dequantized, ``q[id] * s[id]``, bit-equal to the fake-quantized table
    the fp embedding held. Shapes: ids ``[*]`` -> ``[*, h]`` replicated. Collectives: forward one all-reduce (as
    the fp module; sequence parallelism is refused by :func:`quantize_int8`). ``weight`` dequantizes the whole
    table ``[V_r, h]`` on access (nothing in the forward reads it). Inference only."""

    @property
    def weight(self) -> torch.Tensor:
        return self.__dict__["_int8_weight"].dequantize()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.__dict__["_int8_weight"]
        outside = None
        if self.tp.size == 1:
            local = ids
        else:           # as VocabParallelEmbedding.forward: rows of other ranks are looked up as row 0, then zeroed
            outside = (ids < self.vocab_start) | (ids >= self.vocab_stop)
            local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = (w.q[local].float() * w.scale.float()[local].unsqueeze(-1)).to(w.scale.dtype)     # [*, h]
        if outside is not None:
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.embed_scale is not None:
            out = out * self.embed_scale.to(out.dtype)
        return comm.reduce_from_tp_region(out, self.tp)


_INT8_CLASSES = ((ColumnParallelLinear, Int8ColumnParallelLinear), (RowParallelLinear, Int8RowParallelLinear),
                 (VocabParallelEmbedding, Int8VocabParallelEmbedding))


def free_weight(mod: torch.nn.Module, w8: Int8Weight) -> None:
    """Drop ``mod``'s fp ``weight`` parameter (its storage is freed once nothing else holds it) and make ``mod``
    the Int8 class of its type, reading ``w8``."""
    cls = next((q for fp, q in _INT8_CLASSES if type(mod) is fp), None)
    if cls is None:
        raise ValueError(f"--quantize int8 cannot free the weight of a {type(mod).__name__} (it quantizes "
                         f"{', '.join(fp.__name__ for fp, _ in _INT8_CLASSES)}); use --quantize none")
    del mod._parameters["weight"]
    mod.__class__ = cls
    mod.__dict__["_int8_weight"] = w8


def lean_weight(mod):
    """What :class:`tensorpar.decode.lean.LeanDecoder` multiplies by for the Linear ``mod``: its
    :class:`Int8Weight` when :func:`tensorpar.decode.quantize.quantize_int8` freed its fp weight, else
    ``mod.weight``."""
    w8 = mod.__dict__.get("_int8_weight")
    return mod.weight if w8 is None else w8



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
