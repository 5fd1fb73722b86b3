"""The matmuls of the row step (:mod:`tensorpar.decode.row_step`) into its preallocated buffers, per
weight format: our GEMV on fp32 weights, our Q8_0 x Q8_0 kernel on ``--quantize int8``'s weights, our GEMV widening
``--quantize bf16``'s weights; each the kernel the general loop runs at these rows."""
from __future__ import annotations

import torch

from tensorpar.decode import fused, gemv_kernel, q8_kernel
from tensorpar.decode.bf16_weights import Bf16Weight
from tensorpar.decode.int8 import Int8Weight


#: per weight format: (the kernel runs here, its run-into-buffers call)
_KERNELS = {"int8": (q8_kernel.available, q8_kernel.linear_into),
            "bf16": (gemv_kernel.available, gemv_kernel.bf16w_linear_into),
            None: (gemv_kernel.available, gemv_kernel.linear_into)}


class _Matmuls:
    """The matmul of a :class:`RowStep` into its preallocated buffers: our GEMV on fp32 weights
    (:func:`~tensorpar.decode.gemv_kernel.into_args`), our Q8_0 x Q8_0 kernel on the :class:`Int8Weight` of
    ``--quantize int8`` (:func:`~tensorpar.decode.q8_kernel.into_args`, the activations quantized into one scratch
    the step's matmuls share: they run one after the other), or our GEMV widening the :class:`Bf16Weight` of
    ``--quantize bf16``, plain or blocked, and a bf16 model's bf16 weights, plain tensors or blocked
    (:func:`~tensorpar.decode.gemv_kernel.bf16w_into_args`: on the step's fp32 buffers; the step rounds the output
    to bf16; a bf16 model's blocked weights by ``vdpbf16ps`` on pairs of inputs,
    :func:`~tensorpar.decode.gemv_kernel.bf16_blocked_linear_into`). Each is the kernel the general loop runs at these
    rows, so a matmul's output is bitwise the general loop's given the same input (but a bf16 model's plain weights:
    the general loop's bf16 x bf16 GEMV pairs its products, ``vdpbf16ps``, the step widens them; within one bf16
    rounding)."""

    def __init__(self, fmt: str | None, rows: int, k: int, threads: int):
        self.threads = threads
        self.scratch = q8_kernel.scratch(rows, k) if fmt == "int8" else None
        self.run = _KERNELS[fmt][1]

    def args(self, x: torch.Tensor, w, y: torch.Tensor, bias: torch.Tensor | None = None) -> tuple:
        """The arguments of ``y = x @ W.T + bias`` for ``self.run``: ``x`` ``[M, K]``, ``w`` ``[N, K]`` (a tensor or
        an :class:`Int8Weight` or :class:`Bf16Weight`), ``y`` ``[M, N]``, ``bias`` ``[N]`` or None (the kernel adds
        it, as the general loop's call of the same kernel does; the caller keeps it alive)."""
        if isinstance(w, Int8Weight):
            return q8_kernel.into_args(x, w.q, w.scale, y, self.scratch, self.threads, bias=bias)
        if isinstance(w, Bf16Weight):
            return gemv_kernel.bf16w_into_args(x, w.w, y, self.threads, bias=bias, n=w.n, k=w.k)
        if w.dtype == torch.bfloat16:       # a bf16 model's plain weight [out, in], on the step's fp32 buffers
            return gemv_kernel.bf16w_into_args(x, w, y, self.threads, bias=bias)
        return gemv_kernel.into_args(x, w, y, self.threads, bias=bias)

    def run_into(self, x: torch.Tensor, w, y: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """``y = x @ W.T + bias`` now (:meth:`args`' matmul; a blocked :class:`Bf16Weight` by its own entry)."""
        a = self.args(x, w, y, bias)
        if isinstance(w, Bf16Weight) and w.blocked:
            (gemv_kernel.bf16_blocked_linear_into if _bf16_act(w) else gemv_kernel.bf16w_blocked_linear_into)(a)
        else:
            self.run(a)

    def op(self, x: torch.Tensor, w, y: torch.Tensor, bias: torch.Tensor | None = None) -> tuple:
        """The same matmul as an op of a :func:`~tensorpar.decode.fused.program`: its kind, the kernel's address and
        :meth:`args`."""
        a = self.args(x, w, y, bias)
        if isinstance(w, Int8Weight):
            return (fused.OP_Q8, q8_kernel.address("tp_q8_linear_into"), *a)
        if isinstance(w, Bf16Weight) or w.dtype == torch.bfloat16:      # the blocked entry takes the same arguments
            name = "tp_gemv_bf16w"
            if isinstance(w, Bf16Weight) and w.blocked:
                name = "tp_gemv_bf16_blocked" if _bf16_act(w) else "tp_gemv_bf16w_blocked"
            return (fused.OP_GEMV_BF16W, gemv_kernel.address(name), *a)
        return (fused.OP_GEMV, gemv_kernel.address("tp_gemv"), *a)


def _bf16_act(w: Bf16Weight) -> bool:
    """Whether ``w`` is a bf16 model's weight (bf16 activations: ``vdpbf16ps`` on pairs, as the general loop's
    :func:`~tensorpar.decode.bf16_weights.bf16_linear`), not ``--quantize bf16``'s (fp32 activations)."""
    return w.dtype == torch.bfloat16
