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

from typing import NamedTuple

import torch
import torch.nn.functional as F

from tensorpar.decode import gemv_kernel


class Bf16Weight(NamedTuple):
    """The bf16 weight ``W`` ``[out_local, in_local]`` (``W.float()`` is what the model computes with), ``dtype``
    the model's compute dtype (float32). ``n`` None: ``w`` is ``W`` itself, ``[out_local, in_local]`` bfloat16
    contiguous; ``n`` an int: ``W`` is ``n`` rows held only in the bf16 blocked layout of our GEMV, ``w``
    ``[ceil(n / 32), in_local + in_local % 2, 32]`` (:func:`block_bf16`, :func:`blocked`; a row view of a fused
    weight may hold more rows in its last block, past ``n``); ``k`` the inputs where the layout padded an odd
    ``in_local`` (else None). ``device`` and ``shape`` are those of ``W``."""
    w: torch.Tensor
    dtype: torch.dtype
    n: int | None = None
    k: int | None = None

    @property
    def blocked(self) -> bool:
        return self.n is not None

    @property
    def device(self) -> torch.device:
        return self.w.device

    @property
    def shape(self) -> torch.Size:
        return self.w.shape if self.n is None else torch.Size((self.n, self.w.shape[1] if self.k is None else self.k))

    def plain(self) -> torch.Tensor:
        """``W`` ``[out_local, in_local]`` bfloat16 (``w`` itself, or a new tensor from the blocked layout)."""
        return self.w if self.n is None else unblock_bf16(self.w, self.n, self.k)

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
        return bf16_rows(self.w, idx, self.k).to(self.dtype)

    def row_chunk(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``W`` ``[stop - start, in]`` bfloat16 (blocked: a new tensor). Raises
        ValueError for a range outside ``[0, out_local]``."""
        _check_range(start, stop, self.shape[0])
        if self.n is None:
            return self.w[start:stop]
        out = torch.empty(stop - start, self.shape[1], dtype=torch.bfloat16, device=self.w.device)
        self.copy_rows(out, start, stop)
        return out

    def copy_rows(self, dst: torch.Tensor, start: int, stop: int) -> None:
        """``dst`` ``[stop - start, in]`` (contiguous, any float dtype) = rows ``[start, stop)`` of ``W``, converted:
        from the blocked layout whole blocks at a time through a strided view (no copy but ``dst``; 32 rows at
        most for a block cut by ``start`` or ``stop``); a bf16 ``dst`` through our kernel's library where it runs
        (``tp_unblock_bf16``: about 5x the strided copy's rate, what a bf16 model's prefill chunks convert). Raises
        ValueError for a range outside ``[0, out_local]`` or a ``dst`` of another shape."""
        _check_range(start, stop, self.shape[0])
        if tuple(dst.shape) != (stop - start, self.shape[1]):
            raise ValueError(f"copy_rows: dst {tuple(dst.shape)} for rows [{start}, {stop}) of a bf16 weight of "
                             f"{self.shape[1]} inputs: takes [{stop - start}, {self.shape[1]}]")
        if self.n is None:
            dst.copy_(self.w[start:stop])
            return
        ours = dst.dtype == torch.bfloat16 and dst.is_contiguous() and self.w.device.type == "cpu"
        if ours and gemv_kernel.available():
            gemv_kernel._lib().tp_unblock_bf16(self.w.data_ptr(), self.shape[1], start, stop, dst.data_ptr())
            return
        b, k, kin = gemv_kernel.BLOCK, self.w.shape[1], self.shape[1]
        r = start
        while r < stop:
            blk, o = divmod(r, b)
            full = (stop - r) // b if o == 0 else 0
            if full:                    # row 32 blk + j, inputs 2 i and 2 i + 1 at p[blk].view(k / 2, 32, 2)[i, j]
                src = self.w[blk:blk + full].view(full, k // 2, b, 2).transpose(1, 2).reshape(full, b, k)
                dst[r - start:r - start + full * b].view(full, b, kin).copy_(src[..., :kin])
                r += full * b
            else:
                e = min(stop, (blk + 1) * b)
                one = self.w[blk].view(k // 2, b, 2).transpose(0, 1).reshape(b, k)[:, :kin]
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
        return Bf16Weight(self.w[start // b:-(-(start + n) // b)], self.dtype, n, self.k)

    def stored_bytes(self) -> int:
        return self.w.numel() * self.w.element_size()


def block_bf16(w: torch.Tensor) -> torch.Tensor:
    """``w`` ``[n, K]`` (any float dtype; rounded to bfloat16, nearest even) in the bf16 blocked layout
    ``[ceil(n / 32), K + K % 2, 32]`` bfloat16 (a new tensor): :func:`~tensorpar.decode.gemv_kernel.block`'s blocks
    of 32 output rows with the inputs in pairs (an odd ``K`` padded with a zero input): per pair ``i`` (inputs
    ``2i``, ``2i + 1``) the block's rows ``j`` at positions ``64 i + 2 j`` and ``64 i + 2 j + 1`` of the block
    (viewed ``[K / 2, 32, 2]``). A 32-bit lane holds one row's two inputs: widened to fp32 by a shift and an and for
    an fp32 input (csrc/gemv.cpp ``tp_gemv_bf16w_blocked``), or multiplied as a pair by ``vdpbf16ps`` with a bf16
    input (``tp_gemv_bf16_blocked``). Exact on bf16 input (:func:`unblock_bf16` gives it back)."""
    n, k = w.shape
    b, kp = gemv_kernel.BLOCK, k + k % 2
    nb = -(-n // b)
    w = w.detach().to(torch.bfloat16)
    if nb * b != n or kp != k:
        w = torch.nn.functional.pad(w, (0, kp - k, 0, nb * b - n))
    return w.reshape(nb, b, kp // 2, 2).transpose(1, 2).contiguous().view(nb, kp, b)


def blocked(w: torch.Tensor, dtype: torch.dtype) -> Bf16Weight:
    """``w`` ``[n, K]`` held in :func:`block_bf16`'s layout as a :class:`Bf16Weight` of compute dtype ``dtype``."""
    return Bf16Weight(block_bf16(w), dtype, w.shape[0], w.shape[1] if w.shape[1] % 2 else None)


def unblock_bf16(p: torch.Tensor, n: int, k: int | None = None) -> torch.Tensor:
    """The inverse of :func:`block_bf16`: ``[ceil(n / 32), Kp, 32]`` -> ``[n, k]`` bfloat16 (a new tensor; ``k``
    default ``Kp``, an odd ``k`` drops the padding input); a ``p`` of more blocks than ``n`` rows need (a row view
    of a fused weight) gives its first ``n`` rows."""
    nb, kp, _ = p.shape
    w = p.view(nb, kp // 2, gemv_kernel.BLOCK, 2).transpose(1, 2).reshape(nb * gemv_kernel.BLOCK, kp)
    return (w[:n] if k in (None, kp) else w[:n, :k]).clone(memory_format=torch.contiguous_format)


def bf16_rows(p: torch.Tensor, idx: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """Rows ``idx`` (any shape, values in ``[0, 32 * p.shape[0])``) of the weight of ``k`` inputs (default
    ``p.shape[1]``) held as ``p`` in :func:`block_bf16`'s layout -> ``[*idx.shape, k]`` bfloat16 (a tied embedding's
    lookup)."""
    nb, kp, b = p.shape
    rows = p.view(nb, kp // 2, b, 2)[idx // b, :, idx % b].reshape(*idx.shape, kp)
    return rows if k in (None, kp) else rows[..., :k]


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
        return blocked(w, w.dtype)
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


def bf16_linear(x: torch.Tensor, w: Bf16Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W.float(), bias)`` for ``x`` ``[..., in]`` in the compute dtype -> ``[..., out]``: our GEMV
    (:func:`~tensorpar.decode.gemv_kernel.bf16w_linear`, or on the blocked layout
    :func:`~tensorpar.decode.gemv_kernel.bf16w_blocked_linear`; the weights widened in registers, fp32 sums in another
    order: within 1e-5 relative) on a CPU that runs it, at up to :data:`GEMV_ROWS` rows (the blocked layout: at any
    row count), else :func:`chunked_linear` (the weight converted :data:`_CHUNK_ELEMS` at a time into one buffer,
    never the whole fp32 copy; ``F.linear`` up to the order of the fp32 sums). Neither allocates more than the
    output and one chunk (the blocked kernel: the input rows packed, about 4 MiB per thread).

    A bf16 model's weights held blocked (compute dtype bf16, :func:`tensorpar.decode.matmuls.use_blocked`): ``x``
    bf16, ``F.linear(x, W, bias)`` in bf16 at any row count: our blocked GEMV
    (:func:`~tensorpar.decode.gemv_kernel.bf16_blocked_linear`: ``vdpbf16ps`` on pairs of inputs with AVX512_BF16)
    and its fp32 sums rounded to bf16 once, as oneDNN's bf16 GEMM rounds its fp32 sums (another order: within one
    bf16 rounding). bench/results/gemv-bf16dp-epyc.md (AMD EPYC Zen 4, one thread, the 1.1B's tp=2 matrices from
    memory): per layer's four matmuls at 4 / 8 / 16 / 32 rows 1.13 / 1.18 / 1.09 / 1.03x as fast as oneDNN's bf16
    GEMM on weights prepacked for the rows, at 64 and 128 rows level with it (1.00x, 0.98x) and ahead of ``F.linear``
    on plain weights (1.15x, 1.05x); the fp32 FMAs this replaced took 1.9-2.0x its time from 16 rows.
    No collectives. Raises ValueError for an ``x`` that is not floating point or whose last dim is not the weight's
    input count."""
    if not x.is_floating_point() or x.dim() == 0 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"bf16_linear: x must be floating point [..., {w.shape[1]}] (the weight's inputs), got "
                         f"{x.dtype} {tuple(x.shape)}")
    x2 = x.reshape(-1, x.shape[-1])
    b = None if bias is None else bias.float()
    cpu = x2.device.type == "cpu" and w.w.is_contiguous() and gemv_kernel.available()
    ours = x2.dtype == torch.float32 and cpu
    if cpu and w.blocked and x2.dtype == w.dtype == torch.bfloat16:
        y = gemv_kernel.bf16_blocked_linear(x2, w.w, w.n, b, w.k).to(torch.bfloat16)
    elif ours and w.blocked:      # at any row count: prefill's 512 rows 1.4x the chunks (bench/results/gemv-packed-epyc.md)
        y = gemv_kernel.bf16w_blocked_linear(x2, w.w, w.n, b, w.k)
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
