"""The int8 format of ``--quantize int8`` (:mod:`tensorpar.decode.quantize` makes it): :class:`Int8Weight` (``q``
int8 and one fp16 scale per block of 32 inputs of each output row, llama.cpp's Q8_0 layout split in two tensors),
its matmul (:func:`int8_linear`), the quantizers (:func:`quantize_weight`, :func:`quantize_blocks`), and the
Linear / embedding classes a module becomes once its fp weight is freed.

Compute (:func:`int8_linear`, llama.cpp's Q8_0 x Q8_0): the activations are quantized on the fly per row and block
of 32 (``d = max|x| / 127``, ``xq = round(x / d)`` as ``round(x * (1/d))``, half to even), each block's int8 x int8
dot product is summed exactly in int32 and multiplied by ``d * s`` in fp32. On a CPU with AVX512-VNNI or AVX2 this is
our kernel (:mod:`tensorpar.decode.q8_kernel`); elsewhere (CUDA, other CPUs, no compiler, ``TENSORPAR_Q8_KERNEL=0``)
the kernel's arithmetic in PyTorch, sum for sum (:func:`int8_linear_reference`: the same bits, so the two paths
compute one quantized model at any tp). The result is cast to ``x``'s dtype (fp32 or bf16 models alike).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from tensorpar import comm
from tensorpar.decode import q8_kernel
from tensorpar.layers.embedding import VocabParallelEmbedding
from tensorpar.layers.linear import ColumnParallelLinear, RowParallelLinear

#: inputs per scale (llama.cpp's QK8_0): weights and activations are quantized in blocks of 32 along the input dim
BLOCK = 32
#: weights dequantized per call of the PyTorch path (8 MB of fp32): a chunk stays in the allocator's reuse range
_CHUNK_ELEMS = 2 ** 21


class Int8Weight(NamedTuple):
    """``q`` ``[out_local, in_local]`` int8, ``scale`` ``[out_local, in_local / 32]`` float16 (one per block of 32
    consecutive inputs of a row), ``dtype`` the model's compute dtype; ``W[o, k] ≈ q[o, k] * scale[o, k // 32]``.
    ``device`` and ``shape`` are those of the weight it stands for."""
    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``q * s`` ``[out_local, in_local]`` in ``dtype`` (default the compute dtype; a new tensor)."""
        return _dequantize(self.q, self.scale).to(dtype or self.dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """:func:`int8_linear` of ``x`` ``[..., in]`` -> ``[..., out]``."""
        return int8_linear(x, self, bias)

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        """Rows ``idx`` ``[*]`` of ``q * s`` -> ``[*, in]`` in the compute dtype (a tied embedding's lookup). Raises
        IndexError for an id outside ``[0, out_local)`` (a negative one would index from the end)."""
        rows = self.q.shape[0]
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= rows):
            raise IndexError(f"token id out of range: the embedding has {rows} rows on this rank")
        return _dequantize(self.q[idx], self.scale[idx]).to(self.dtype)

    def narrow(self, start: int, n: int) -> "Int8Weight":
        """Rows ``[start, start + n)`` (views)."""
        return Int8Weight(self.q[start:start + n], self.scale[start:start + n], self.dtype)

    def stored_bytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()


def _dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q`` ``[..., K]`` int8, ``scale`` ``[..., K / 32]`` -> ``q * scale`` per block, float32 ``[..., K]``."""
    return (q.float().unflatten(-1, (-1, BLOCK)) * scale.float().unsqueeze(-1)).flatten(-2)


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The activations' quantization (llama.cpp's ``quantize_row_q8_0``, scales kept in fp32): ``x`` ``[..., K]``
    (``K % 32 == 0``) -> ``xq`` int8 ``[..., K]``, ``d`` float32 ``[..., K / 32]`` with ``d = max|x_block| / 127``
    and ``xq = round(x * (1/d))`` (half to even; 0 where ``d == 0``), in fp32: bit for bit what the kernel
    computes. No collectives."""
    xb = x.float().unflatten(-1, (-1, BLOCK))
    d = xb.abs().amax(-1) / 127
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return torch.round(xb * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8).flatten(-2), d


def fake_quantize_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., K]`` replaced by its blockwise-quantized values ``xq * d`` (:func:`quantize_blocks`), in ``x``'s
    dtype: the input a plain-PyTorch reference Linear sees (:func:`tensorpar.decode.quantize.quantize_reference_int8`)."""
    return _dequantize(*quantize_blocks(x)).to(x.dtype)


def int8_linear_reference(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`int8_linear` in PyTorch, the kernel's arithmetic step for step (csrc/q8_linear.cpp's header), so that
    it gives the kernel's bits: ``x`` quantized by :func:`quantize_blocks`; per block of 32 the eight exact integer
    sums of four products ``xq * q`` (the kernel's int32 lanes; exact in fp32 too, ``|sum| <= 4 * 127^2``); each
    times the block's fp32 scale ``s * d`` and added into 16 fp32 lanes (0-7 the even blocks, 8-15 the odd
    ones, block pair after block pair) as the kernel's fused multiply-add: the product is exact in float64 and the
    sum rounded to fp32 once (through float64: a second rounding can differ only where the float64 sum is exactly
    halfway between two fp32 values, about 2^-29 of the additions whose exact sum needs more than 53 bits); the
    16 lanes reduced in the kernel's fixed tree; an odd last block's integer sum times its scale added in fp32;
    then ``bias`` (0.0 without one, as the kernel). Why not one fp32 matmul of the dequantized values: that sums
    in another order, and an activation of the next layer whose ``x / d`` lies within that rounding of a half step
    rounds to the other int8 step, which moves every later value (measured: 7e-3 on the logits of
    tests/decode/test_quant.py's llama at tp=2, one flip at ``x / d = 7.50002``). At most ``_CHUNK_ELEMS`` lane
    sums at a time. ``x`` ``[..., K]`` -> ``[..., N]`` in ``x``'s dtype. No collectives."""
    K = x.shape[-1]
    xq, d = quantize_blocks(x.reshape(-1, K))                                   # [M, K] int8, [M, nb] fp32
    M, nb, N = xq.shape[0], K // BLOCK, w.q.shape[0]
    lanes_x = xq.float().view(M, nb * 8, 4).transpose(0, 1)                     # [nb*8, M, 4]: lane l of block b
    step = max(1, _CHUNK_ELEMS // max(1, M * nb * 8))
    outs = []
    for c in range(0, N, step):
        q, s = w.q[c:c + step], w.scale[c:c + step]
        n = q.shape[0]
        lanes = torch.bmm(lanes_x, q.float().view(n, nb * 8, 4).permute(1, 2, 0))   # [nb*8, M, n], exact integers
        lanes = lanes.view(nb, 8, M, n)
        scale = (s.float().T.unsqueeze(1) * d.T.unsqueeze(2))                         # [nb, M, n]: s * d, fp32
        pairs = nb // 2
        acc = torch.zeros(16, M, n, dtype=torch.float64, device=x.device)
        for j in range(pairs):          # lanes 0-7: block 2j, 8-15: block 2j + 1; fp32 fused multiply-add
            prod = (lanes[2 * j:2 * j + 2].double() * scale[2 * j:2 * j + 2].double().unsqueeze(1)).view(16, M, n)
            acc = (acc + prod).float().double()
        a = acc.float()
        t = a[8:] + a[:8]                                                            # hsum16: hi + lo
        u = t[4:] + t[:4]
        v = (u[0] + u[2]) + (u[1] + u[3])                                            # [M, n]
        if nb & 1:                      # the odd last block: its int32 sum, times its scale, added in fp32
            v = v + lanes[nb - 1].sum(0) * scale[nb - 1]
        outs.append(v)
    y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
    y = y + (bias.float() if bias is not None else 0.0)
    return y.view(*x.shape[:-1], N).to(x.dtype)


def int8_linear(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + bias`` for ``x`` ``[..., in]`` with ``x`` quantized per block of 32 (see the module docstring);
    returns ``[..., out]`` in ``x``'s dtype. Our kernel (AVX512-VNNI or AVX2) on a CPU that has one, else
    :func:`int8_linear_reference`. No collectives."""
    if x.device.type == "cpu" and q8_kernel.available():
        y = torch.ops.tensorpar.q8_linear(x.reshape(-1, x.shape[-1]).float(), w.q, w.scale,
                                          None if bias is None else bias.float())
        return y.view(*x.shape[:-1], -1).to(x.dtype)
    return int8_linear_reference(x, w, bias)


def quantize_weight(w: torch.Tensor, *, write: bool = True) -> Int8Weight:
    """Quantize ``w`` ``[out, in]`` (``in % 32 == 0``) per block of 32 inputs of each row: ``s = max|w_block| / 127``
    stored as float16, ``q = round(w / s)`` clamped to [-127, 127] (0 where ``s`` is 0). ``write``: overwrite ``w``
    in place with ``q * s`` (the fake-quantized weight). Works on at most ``_CHUNK_ELEMS`` weights at a time, so its
    temporaries stay small. No collectives: a block never spans two ranks (:func:`block_misfit`)."""
    if w.shape[1] % BLOCK:
        raise ValueError(f"--quantize int8: a weight with {w.shape[1]} inputs is not a whole number of blocks of "
                         f"{BLOCK}; use --quantize none")
    rows = range(0, w.shape[0], max(1, _CHUNK_ELEMS // max(1, w.shape[1])))
    step = rows.step
    wd = w.detach()
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(w.shape[0], w.shape[1] // BLOCK, dtype=torch.float16, device=w.device)
    for r in rows:
        b = wd[r:r + step].float().unflatten(-1, (-1, BLOCK))
        s = (b.abs().amax(-1) / 127).clamp_(max=65504).to(torch.float16)
        sf = s.float().unsqueeze(-1)
        qb = torch.where(sf != 0, torch.round(b / sf), torch.zeros_like(b)).clamp_(-127, 127)
        q[r:r + step] = qb.flatten(-2).to(torch.int8)
        scale[r:r + step] = s
    out = Int8Weight(q, scale, w.dtype)
    if write:
        with torch.no_grad():
            for r in rows:
                w[r:r + step] = _dequantize(q[r:r + step], scale[r:r + step]).to(w.dtype)
    return out


def block_misfit(sizes: dict[str, list[int]]) -> str | None:
    """``sizes``: per quantized weight name, the input features each rank holds. ``None`` if every one is a
    multiple of 32 (then no block of 32 spans two ranks, and the tp=k model quantizes exactly as tp=1), else a
    line saying which is not. The launching process (:func:`tensorpar.decode.quantize.check_quantize`, from the
    sharding plan) and every rank (:func:`tensorpar.decode.quantize.quantize_int8`, from the modules) apply it."""
    for name, ks in sizes.items():
        bad = [k for k in ks if k % BLOCK]
        if bad:
            return (f"--quantize int8 needs every rank's share of each Linear's input features to be a multiple of "
                    f"{BLOCK} (its scale blocks); {name} is split as {list(ks)}; use another --tp or --quantize none")
    return None


class _Int8Weighted:
    """Mixin of a Linear whose fp ``weight`` parameter was freed by :func:`quantize_int8`: ``weight`` dequantizes
    ``_int8_weight`` (an :class:`Int8Weight`) on each access, so the module's own forward computes the quantized
    model with a transient fp copy of this one matrix, except the local product, which is :func:`int8_linear`
    (``forward_local``, what :func:`~tensorpar.layers.linear.column_parallel_linears` calls). Inference only."""

    @property
    def weight(self) -> torch.Tensor:
        return self.__dict__["_int8_weight"].dequantize()

    def forward_local(self, x: torch.Tensor) -> torch.Tensor:
        """``int8_linear(x, W_r, b)`` (``bf16_linear`` for a :class:`~tensorpar.decode.bf16_weights.Bf16Weight`):
        the lean path's matmul, no collectives."""
        return self.__dict__["_int8_weight"].linear(x, self.bias)


class Int8ColumnParallelLinear(_Int8Weighted, ColumnParallelLinear):
    """A :class:`~tensorpar.layers.linear.ColumnParallelLinear` quantized by :func:`quantize_int8` (shapes and
    collectives unchanged; its local product is :func:`int8_linear`, as on the lean path; ``weight`` ``[n_r, in]``
    is dequantized on access, see :class:`_Int8Weighted`)."""


class Int8RowParallelLinear(_Int8Weighted, RowParallelLinear):
    """A :class:`~tensorpar.layers.linear.RowParallelLinear` quantized by :func:`quantize_int8`. Shapes: ``x``
    ``[*, k_r]`` (or ``[*, in]`` if not ``input_is_parallel``) -> ``[*, out]`` replicated. Collectives: forward the
    all-reduce of the partial products (a scatter of the input first if not ``input_is_parallel``), as the fp
    module; sequence parallelism is refused by :func:`quantize_int8`. The partial product is :func:`int8_linear`
    (the bias added after the reduction); ``weight`` ``[out, k_r]`` is dequantized on access."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = comm.scatter_to_tp_region(x, self.tp, self.partition)
        y = comm.reduce_from_tp_region(self.__dict__["_int8_weight"].linear(x), self.tp)
        return y if self.bias is None else y + self.bias


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
        out = w.rows(local)                                                                    # [*, h]
        if outside is not None:
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.embed_scale is not None:
            out = out * self.embed_scale.to(out.dtype)
        return comm.reduce_from_tp_region(out, self.tp)


_INT8_CLASSES = ((ColumnParallelLinear, Int8ColumnParallelLinear), (RowParallelLinear, Int8RowParallelLinear),
                 (VocabParallelEmbedding, Int8VocabParallelEmbedding))


def free_weight(mod: torch.nn.Module, w8) -> None:
    """Drop ``mod``'s fp ``weight`` parameter (its storage is freed once nothing else holds it) and make ``mod``
    the Int8 class of its type, reading ``w8`` (an :class:`Int8Weight`, or the
    :class:`~tensorpar.decode.bf16_weights.Bf16Weight` of ``--quantize bf16``: the classes read either through its
    ``dequantize``, ``linear`` and ``rows``)."""
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
            if hasattr(w, "stored_bytes"):          # Int8Weight, or Bf16Weight (--quantize bf16)
                n += w.stored_bytes()
    return n
