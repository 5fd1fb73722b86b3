"""The bf16 weight storage of ``--quantize bf16`` (:func:`tensorpar.decode.quantize.store_bf16` makes it): every
Linear of the decoder and the LM head of an fp32 model stored as bfloat16, computing in fp32, as llama.cpp's BF16
file type (weights bf16, activations, norms and the KV cache fp32).

:class:`Bf16Weight` stands where :mod:`tensorpar.decode.int8`'s :class:`~tensorpar.decode.int8.Int8Weight` stands
(the same modules read it: their ``weight`` converts it to fp32 on access, their local product is
:func:`bf16_linear`, a tied embedding looks up its rows). Its matmul, :func:`bf16_linear`: ``F.linear(x,
W.float())`` up to the order of the fp32 sums, without an fp32 copy of ``W`` at a few rows (our GEMV widens the
weights in registers, :func:`tensorpar.decode.gemv_kernel.bf16w_linear`); elsewhere (more rows, no kernel) the
weight converted for the call. No collectives.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from tensorpar.decode import gemv_kernel


class Bf16Weight(NamedTuple):
    """``w`` ``[out_local, in_local]`` bfloat16 (contiguous), ``dtype`` the model's compute dtype (float32);
    ``W = w.float()``. ``device`` and ``shape`` are those of the weight it stands for."""
    w: torch.Tensor
    dtype: torch.dtype

    @property
    def device(self) -> torch.device:
        return self.w.device

    @property
    def shape(self) -> torch.Size:
        return self.w.shape

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``W`` ``[out_local, in_local]`` in ``dtype`` (default the compute dtype; a new tensor)."""
        return self.w.to(dtype or self.dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """:func:`bf16_linear` of ``x`` ``[..., in]`` -> ``[..., out]``."""
        return bf16_linear(x, self, bias)

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        """Rows ``idx`` ``[*]`` of ``W`` -> ``[*, in]`` in the compute dtype (a tied embedding's lookup)."""
        return self.w[idx].to(self.dtype)

    def narrow(self, start: int, n: int) -> "Bf16Weight":
        """Rows ``[start, start + n)`` (a view)."""
        return Bf16Weight(self.w[start:start + n], self.dtype)

    def stored_bytes(self) -> int:
        return self.w.numel() * self.w.element_size()


def to_bf16(w: torch.Tensor) -> Bf16Weight:
    """``w`` ``[out, in]`` (fp32) rounded to bfloat16 (round to nearest even), a new contiguous tensor."""
    return Bf16Weight(w.detach().to(torch.bfloat16).contiguous(), w.dtype)


def bf16_linear(x: torch.Tensor, w: Bf16Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w.w.float(), bias)`` for ``x`` ``[..., in]`` in the compute dtype -> ``[..., out]``: our GEMV
    (:func:`~tensorpar.decode.gemv_kernel.bf16w_linear`, fp32 sums in another order: within 1e-5 relative) at up to
    :data:`~tensorpar.decode.gemv_kernel.MAX_ROWS` rows on a CPU that runs it, else ``F.linear`` on the weight
    converted for this call. No collectives."""
    x2 = x.reshape(-1, x.shape[-1])
    if (x2.shape[0] <= gemv_kernel.MAX_ROWS and x2.dtype == torch.float32 and x2.device.type == "cpu"
            and w.w.is_contiguous() and gemv_kernel.available()):
        y = gemv_kernel.bf16w_linear(x2, w.w, None if bias is None else bias.float())
    else:
        y = F.linear(x2, w.w.to(x2.dtype), bias)
    return y.view(*x.shape[:-1], y.shape[-1])


def quantize_reference_bf16(model) -> None:
    """The same storage on an unsharded ``*ForCausalLM`` in plain PyTorch: every ``nn.Linear`` under
    ``model.model.layers`` and the LM head get ``W.bfloat16().float()`` in place (a tied embedding with it); the
    model keeps computing in its dtype. No collectives."""
    linears = [m for layer in model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for m in linears + [model.lm_head]:
            m.weight.copy_(m.weight.to(torch.bfloat16).to(m.weight.dtype))
