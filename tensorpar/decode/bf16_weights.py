"""The bf16 weight storage of ``--quantize bf16`` (:func:`tensorpar.decode.quantize.store_bf16` makes it): every
Linear of the decoder and the LM head of an fp32 model stored as bfloat16, computing in fp32, as llama.cpp's BF16
file type (weights bf16, activations, norms and the KV cache fp32).

:class:`Bf16Weight` stands where :mod:`tensorpar.decode.int8`'s :class:`~tensorpar.decode.int8.Int8Weight` stands
(the same modules read it: their ``weight`` converts it to fp32 on access, their local product is
:func:`bf16_linear`, a tied embedding looks up its rows). Its matmul, :func:`bf16_linear`: ``F.linear(x,
W.float())`` up to the order of the fp32 sums, without an fp32 copy of ``W`` at a few rows (our GEMV widens the
weights in registers, :func:`tensorpar.decode.gemv_kernel.bf16w_linear`); elsewhere (more rows, no kernel)
:func:`chunked_linear`: the weight converted 2M elements at a time into one 8 MB buffer. No collectives.
"""
from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tensorpar.decode import gemv_kernel


class Bf16Weight(NamedTuple):
    """The bf16 weight ``W`` ``[out_local, in_local]`` (``W.float()`` is what the model computes with), ``dtype``
    the model's compute dtype (float32). ``n`` None: ``w`` is ``W`` itself, ``[out_local, in_local]`` bfloat16
    contiguous; ``n`` an int: ``W`` is ``n`` rows held only in the bf16 blocked layout of our GEMV, ``w``
    ``[ceil(n / 32), in_local, 32]`` (:func:`~tensorpar.decode.gemv_kernel.block_bf16`; a row view of a fused
    weight may hold more rows in its last block, past ``n``). ``device`` and ``shape`` are those of ``W``."""
    w: torch.Tensor
    dtype: torch.dtype
    n: int | None = None

    @property
    def blocked(self) -> bool:
        return self.n is not None

    @property
    def device(self) -> torch.device:
        return self.w.device

    @property
    def shape(self) -> torch.Size:
        return self.w.shape if self.n is None else torch.Size((self.n, self.w.shape[1]))

    def plain(self) -> torch.Tensor:
        """``W`` ``[out_local, in_local]`` bfloat16 (``w`` itself, or a new tensor from the blocked layout)."""
        return self.w if self.n is None else gemv_kernel.unblock_bf16(self.w, self.n)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``W`` ``[out_local, in_local]`` in ``dtype`` (default the compute dtype; a new tensor)."""
        return self.plain().to(dtype or self.dtype)

    def dense(self) -> torch.Tensor:
        """``W`` ``[out_local, in_local]`` in the compute dtype: held as the packed layout of a bf16 model
        (:func:`tensorpar.decode.matmuls.use_blocked`), bit for bit the weight that was blocked."""
        return self.dequantize()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """:func:`bf16_linear` of ``x`` ``[..., in]`` -> ``[..., out]``."""
        return bf16_linear(x, self, bias)

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        """Rows ``idx`` ``[*]`` of ``W`` -> ``[*, in]`` in the compute dtype (a tied embedding's lookup). Raises
        IndexError for an id outside ``[0, out_local)`` (the blocked layout's padding rows are never read)."""
        rows = self.shape[0]
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= rows):
            raise IndexError(f"token id out of range: the embedding has {rows} rows on this rank")
        if self.n is None:
            return self.w[idx].to(self.dtype)
        b = gemv_kernel.BLOCK
        return self.w[idx // b, :, gemv_kernel.bf16_position(idx % b)].to(self.dtype)

    def row_chunk(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``W`` ``[stop - start, in]`` bfloat16 (blocked: a new tensor). Raises
        ValueError for a range outside ``[0, out_local]``."""
        _check_range(start, stop, self.shape[0])
        if self.n is None:
            return self.w[start:stop]
        out = torch.empty(stop - start, self.w.shape[1], dtype=torch.bfloat16, device=self.w.device)
        self.copy_rows(out, start, stop)
        return out

    def copy_rows(self, dst: torch.Tensor, start: int, stop: int) -> None:
        """``dst`` ``[stop - start, in]`` (contiguous, any float dtype) = rows ``[start, stop)`` of ``W``, converted:
        from the blocked layout whole blocks at a time through a strided view (no copy but ``dst``; 32 rows at
        most for a block cut by ``start`` or ``stop``); a bf16 ``dst`` through our kernel's library where it runs
        (``tp_unblock_bf16``: about 5x the strided copy's rate, what a bf16 model's prefill chunks convert)."""
        if self.n is None:
            dst.copy_(self.w[start:stop])
            return
        ours = dst.dtype == torch.bfloat16 and dst.is_contiguous() and self.w.device.type == "cpu"
        if ours and gemv_kernel.available():
            _check_range(start, stop, self.shape[0])
            _unblock()(self.w.data_ptr(), self.w.shape[1], start, stop, dst.data_ptr())
            return
        b, h, k = gemv_kernel.BLOCK, gemv_kernel.BLOCK // 2, self.w.shape[1]
        r = start
        while r < stop:
            blk, o = divmod(r, b)
            full = (stop - r) // b if o == 0 else 0
            if full:                    # rows 32 blk + 16 i + j sit at p[blk, :, 2 j + i]
                src = self.w[blk:blk + full].view(full, k, h, 2).permute(0, 3, 2, 1)
                dst[r - start:r - start + full * b].view(full, 2, h, k).copy_(src)
                r += full * b
            else:
                e = min(stop, (blk + 1) * b)
                one = self.w[blk].view(k, h, 2).permute(2, 1, 0).reshape(b, k)
                dst[r - start:e - start].copy_(one[o:o + e - r])
                r = e

    def narrow(self, start: int, n: int) -> "Bf16Weight":
        """Rows ``[start, start + n)`` (a view; blocked: ``start`` a multiple of 32, else ValueError)."""
        _check_range(start, start + n, self.shape[0])
        if self.n is None:
            return Bf16Weight(self.w[start:start + n], self.dtype)
        b = gemv_kernel.BLOCK
        if start % b:
            raise ValueError(f"a view of a blocked bf16 weight starts at a multiple of {b} rows, not {start}")
        return Bf16Weight(self.w[start // b:-(-(start + n) // b)], self.dtype, n)

    def stored_bytes(self) -> int:
        return self.w.numel() * self.w.element_size()


def _unblock():
    """csrc/gemv.cpp ``tp_unblock_bf16`` (p, K, start, stop, dst) from our kernel's library."""
    f = gemv_kernel._lib().tp_unblock_bf16
    if f.restype is not None:
        f.restype, f.argtypes = None, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return f


def _check_range(start: int, stop: int, rows: int) -> None:
    if not 0 <= start <= stop <= rows:
        raise ValueError(f"rows [{start}, {stop}) of a bf16 weight of {rows} rows: must lie within [0, {rows}]")


#: the shortest row (inputs) a bf16 weight is blocked at (:func:`to_bf16`): bench/results/gemv-bf16w-blocked-epyc.md
#: (AMD EPYC, one thread, weights from memory) read the 1.1B Llama's matrices (rows of 1024-5632 inputs) at
#: 1.37-1.91x the plain layout's rate at one row (0.85-0.96 of the one-thread read limit) and 2.1-2.5x at 4 rows,
#: SmolLM2's (288-768 inputs) at 0.82-0.89x at one row except tp=1's down (1.60x), 0.88-1.28x at 4 rows: blocks
#: of such short rows are too short a stream each
BLOCK_MIN_IN = 1024


def to_bf16(w: torch.Tensor, cuts: tuple[int, ...] = ()) -> Bf16Weight:
    """``w`` ``[out, in]`` (fp32) rounded to bfloat16 (round to nearest even), a new tensor: in our GEMV's bf16
    blocked layout where the kernel runs here, ``in >= BLOCK_MIN_IN`` and every row offset in ``cuts`` (where
    modules take row views of a fused weight, :meth:`Bf16Weight.narrow`) is a multiple of 32; else plain and
    contiguous."""
    b = gemv_kernel.BLOCK
    if (w.dim() == 2 and w.shape[1] >= max(1, BLOCK_MIN_IN) and w.shape[0] > 0 and w.device.type == "cpu"
            and all(c % b == 0 for c in cuts) and gemv_kernel.available()):
        return Bf16Weight(gemv_kernel.block_bf16(w), w.dtype, w.shape[0])
    return Bf16Weight(w.detach().to(torch.bfloat16).contiguous(), w.dtype)


#: the most rows :func:`bf16_linear` sends to our GEMV (more: :func:`chunked_linear`). bench/bench_bf16_batch.py
#: (bench/results/bf16_batch.md, one thread, load 5-6 on 2 cores) at the 1.1B Llama's and SmolLM2's matrices: at 4,
#: 16 and 32 rows the GEMV took 0.26-0.85x the chunks' CPU time except the 1.1B down projection at 32 rows (1.14x);
#: summed over a layer's matrices and the head at 32 rows 151 vs 181 ms (1.1B), 32 vs 59 ms (SmolLM2); at 64 rows
#: 282 vs 279 and 63 vs 95; at 128 and 512 the GEMM ahead for the 1.1B (up to 2.2x: it reuses the weights across
#: all rows, the GEMV per 4)
GEMV_ROWS = 32
#: the most weights converted to the compute dtype at a time by :func:`bf16_linear` above the GEMV's rows (2M: an
#: 8 MB fp32 buffer), so a batch's transient memory does not grow with the weight (a whole LM head converted per call
#: was 113 MB for SmolLM2's)
_CHUNK_ELEMS = 2 ** 21


def chunked_linear(x2: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x2, W.to(x2.dtype), bias)`` for ``x2`` ``[M, K]``, ``W`` ``[N, K]`` (``w``: a tensor of any
    dtype, or a :class:`Bf16Weight`, plain or blocked) -> ``[M, N]`` in ``x2``'s dtype, converting at most
    :data:`_CHUNK_ELEMS` weights at a time: each chunk of output rows is copied into one reused buffer and multiplied
    (``addmm``, as ``F.linear``) into its columns of the preallocated output (a weight of at most ``_CHUNK_ELEMS``:
    ``F.linear`` itself).
    Each output is still summed over the whole K in fp32 by one GEMM call, but the BLAS picks its kernel (and so its
    summation order) by the GEMM's shape. On this machine (torch 2.13 CPU, one thread) bitwise equal to
    ``F.linear(x2, w.to(x2.dtype), bias)`` at all ten matrices of SmolLM2 and the 1.1B Llama (tp=1) with 3, 33, 64
    and 512 rows, bias or none (checked), but not everywhere: at K 300 the 11 outputs of a last chunk of 11 rows
    (and a few more at 3 rows) differ, within 4e-7 of the largest output (fp32 summation order only). No
    collectives."""
    if isinstance(w, Bf16Weight):
        take, copy_rows = w.row_chunk, w.copy_rows
    else:
        def take(c: int, e: int) -> torch.Tensor:
            return w[c:e]

        def copy_rows(dst: torch.Tensor, c: int, e: int) -> None:
            dst.copy_(w[c:e])
    n, k = w.shape
    step = max(1, min(n, _CHUNK_ELEMS // max(1, k)))
    if step < n and step >= gemv_kernel.BLOCK:
        step -= step % gemv_kernel.BLOCK            # chunks of whole blocks (copy_rows of a blocked weight)
    if step == n:                                    # one chunk: the weight converted whole is within the bound
        return F.linear(x2, take(0, n).to(x2.dtype), None if bias is None else bias.to(x2.dtype))
    y = torch.empty(x2.shape[0], n, dtype=x2.dtype, device=x2.device)
    buf = torch.empty(step, k, dtype=x2.dtype, device=x2.device)
    for c in range(0, n, step):
        e = min(n, c + step)
        wc = buf[:e - c]
        copy_rows(wc, c, e)
        if bias is None:
            torch.mm(x2, wc.t(), out=y[:, c:e])
        else:
            torch.addmm(bias[c:e].to(x2.dtype), x2, wc.t(), out=y[:, c:e])
    return y


#: the most rows of a bf16 input (``--dtype bfloat16``) :func:`bf16_linear` sends to our GEMV on the blocked layout
#: (more: :func:`chunked_linear`, oneDNN's bf16 GEMM on chunks converted back by ``tp_unblock_bf16``).
#: bench/results/gemv-bf16act-epyc.md (AMD EPYC Zen 4, one thread, the 1.1B's tp=2 matrices from memory): at one row
#: ours on the blocked layout read 15.5-24.9 GB/s, on the plain one 10.0-20.1, oneDNN prepacked 13.3-14.7; per
#: layer's four matmuls at 5 / 8 / 16 / 32 / 64 rows ours 2.9 / 3.9 / 7.6 / 14.2 / 26.8 ms, the converted chunks
#: 8.6 / 9.0 / 11.0 / 14.0 / 19.9 (``F.linear`` on plain weights 4.3 / 4.9 / 6.4 / 9.6 / 15.6: our fp32 FMAs do half of
#: ``vdpbf16ps``'s products per instruction, the chunks pay the conversion), so ours up to 32 rows
BF16_ACT_ROWS = 32


def bf16_linear(x: torch.Tensor, w: Bf16Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W.float(), bias)`` for ``x`` ``[..., in]`` in the compute dtype -> ``[..., out]``: our GEMV
    (:func:`~tensorpar.decode.gemv_kernel.bf16w_linear`, or on the blocked layout
    :func:`~tensorpar.decode.gemv_kernel.bf16w_blocked_linear`; the weights widened in registers, fp32 sums in another
    order: within 1e-5 relative) on a CPU that runs it, at up to :data:`GEMV_ROWS` rows (the blocked layout: at any
    row count), else :func:`chunked_linear` (the weight converted :data:`_CHUNK_ELEMS` at a time into one buffer,
    never the whole fp32 copy; ``F.linear`` up to the order of the fp32 sums). Neither allocates more than the
    output and one chunk (the blocked kernel: the input rows packed, about 4 MiB per thread).

    A bf16 model's weights held blocked (compute dtype bf16, :func:`tensorpar.decode.matmuls.use_blocked`): ``x``
    bf16, ``F.linear(x, W, bias)`` in bf16: at up to :data:`BF16_ACT_ROWS` rows our blocked GEMV on ``x`` widened
    to fp32 (exact) and its fp32 sums rounded to bf16 once, as oneDNN's bf16 GEMM rounds its fp32 sums (another
    order: within one bf16 rounding); more rows :func:`chunked_linear` (``F.linear`` in bf16 per chunk). No
    collectives."""
    x2 = x.reshape(-1, x.shape[-1])
    b = None if bias is None else bias.float()
    cpu = x2.device.type == "cpu" and w.w.is_contiguous() and gemv_kernel.available()
    ours = x2.dtype == torch.float32 and cpu
    if cpu and w.blocked and x2.dtype == w.dtype == torch.bfloat16 and x2.shape[0] <= BF16_ACT_ROWS:
        y = gemv_kernel.bf16w_blocked_linear(x2.float(), w.w, w.n, b).to(torch.bfloat16)
    elif ours and w.blocked:      # at any row count: prefill's 512 rows 1.4x the chunks (bench/results/gemv-packed-epyc.md)
        y = gemv_kernel.bf16w_blocked_linear(x2, w.w, w.n, b)
    elif ours and x2.shape[0] <= GEMV_ROWS:
        y = gemv_kernel.bf16w_linear(x2, w.w, b)
    else:
        y = chunked_linear(x2, w, bias)
    return y.view(*x.shape[:-1], y.shape[-1])


def quantize_reference_bf16(model) -> None:
    """The same storage on an unsharded ``*ForCausalLM`` in plain PyTorch: every ``nn.Linear`` under
    ``model.model.layers`` and the LM head get ``W.bfloat16().float()`` in place (a tied embedding with it); the
    model keeps computing in its dtype. No collectives."""
    linears = [m for layer in model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for m in linears + [model.lm_head]:
            m.weight.copy_(m.weight.to(torch.bfloat16).to(m.weight.dtype))
