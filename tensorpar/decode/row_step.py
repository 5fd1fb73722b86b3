"""The lean path's decode step of one or two rows, in few calls per layer (:class:`RowStep`).

Batch-1 decode of a small model is bound by the work around the matmuls, paid per layer by every rank: SmolLM2
at tp=2 spent 5.0 ms per token in 4127 framework ops (137 per layer) against 18 ms of matmuls (docs/benchmarks.md).
A :class:`RowStep` runs a step of at most :data:`~tensorpar.decode.gemv_kernel.MAX_ROWS` rows of one token each on
buffers allocated once, with the per-layer arguments of every kernel prepared once at construction:

* the four matmuls and the LM head: the general loop's kernel into the preallocated outputs: our GEMV on fp32
  weights (:func:`~tensorpar.decode.gemv_kernel.linear_into`), our Q8_0 x Q8_0 kernel on the int8 weights of
  ``--quantize int8`` (:func:`~tensorpar.decode.q8_kernel.linear_into`, the activations quantized into a scratch
  allocated once), our GEMV widening the bf16 weights of ``--quantize bf16`` to fp32;
* rotary on the q and k heads and the cache write of k and v: one call (:func:`~tensorpar.decode.fused.rope_store`),
  the tables once per step;
* each all-reduce fused with the residual add and the next RMSNorm (the layer's post-attention norm, the next
  layer's input norm, the final norm): one call that reads the ranks' partial sums in shared memory
  (:func:`~tensorpar.decode.fused.all_reduce_add_rms_norm`);
* attention of the one query per row: one call that reads each query head's KV head where it lies in the cache
  (:func:`~tensorpar.decode.fused.decode_attention`: no head copies for uneven head splits, no views per layer);
  SiLU and the gate product: one call (:func:`~tensorpar.decode.fused.silu_mul`).

It runs the layers of the plain Llama shape (:func:`why_not` says which it does not) computing in fp32 (activations,
residual, norms, KV cache) on the GEMV path (:attr:`LeanDecoder.gemv <tensorpar.decode.lean.LeanDecoder>`) or on
the int8 or bf16 weights of ``--quantize``, each row's positions in one cache block (generate's static cache); everything else, prefill and
bigger steps run :meth:`~tensorpar.decode.lean.LeanDecoder.forward_segments`' general loop. Results: the residual
stream, rotary, cache writes and each matmul's output bitwise those of the general loop's ops given the same
inputs; the norms, attention and SiLU within fp32 rounding of them (sums in another order, ``expf``:
:mod:`tensorpar.decode.fused`), so the logits agree to fp32 rounding (1e-5 of the largest) and greedy tokens equal
transformers' (tests/decode/test_row_step.py); int8: an activation within that rounding of a half step of its
block's quantization may round to the other step, see the tests' tolerance.
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from tensorpar.decode import fused, gemv_kernel, q8_kernel
from tensorpar.decode.bf16_weights import Bf16Weight
from tensorpar.decode.int8 import Int8Weight


def _norm(fn):
    """``(weight, eps)`` of a norm callable the fused kernel can replace: the fp32 RMSNorm
    ``w * (x * rsqrt(mean(x^2) + eps))`` that :func:`~tensorpar.decode.kernels.rms_norm_fn` found bitwise equal to
    the family's module (its ``rms_norm`` attribute); anything else (a module, Gemma's ``(1 + w)``, LayerNorm, bf16)
    ``None``."""
    w, eps = getattr(fn, "rms_norm", (None, None))
    if w is None or not isinstance(eps, float) or w.dtype != torch.float32 or not w.is_contiguous():
        return None
    return w, eps


def why_not(dec) -> str | None:
    """Why decoder ``dec`` (a :class:`~tensorpar.decode.lean.LeanDecoder`) cannot run its one-row steps as a
    :class:`RowStep` (``None``: it can)."""
    if dec.tile is not None or not (dec.first and dec.last):
        return "deterministic mode or a pipeline stage"
    fmt = _format(dec.lm_w)
    if not (dec.gemv or (fmt is not None and _KERNELS[fmt][0]() and dec.max_batch <= gemv_kernel.MAX_ROWS)):
        return "it runs neither our GEMV (fp32 weights) nor our kernel of --quantize int8 / bf16 at <= 2 rows"
    if dec.lm_w.dtype != torch.float32:
        return "it does not compute in fp32"
    if dec.windows or dec.final_cap is not None or dec.tp.compression == "int8" or dec.lm_b is not None:
        return "sliding windows, logit soft-capping, --tp-comm int8 or an LM head bias"
    if not fused.available() or _norm(dec.norm) is None:
        return "no fused kernels here, or the final norm is not the plain fp32 RMSNorm"
    for L in dec.layers:
        plain = (L.moe is None and L.post_attn is None and L.post_ff is None and L.bqkv is None and L.bo is None
                 and L.bgu is None and L.bd is None and L.gated and L.silu and L.qk_norm is None
                 and not L.interleaved and not L.parallel and L.sdpa is F.scaled_dot_product_attention)
        if not plain or _norm(L.ln1) is None or _norm(L.ln2) is None:
            return "a layer that is not of the plain Llama shape (pre-RMSNorms, gated SiLU MLP, no biases)"
        if any(_format(w) != fmt for w in (L.wqkv, L.wo, L.wgu, L.wd)):
            return "weights of several formats"
    return None


def _format(w) -> str | None:
    """``int8`` / ``bf16`` for the stored weights of ``--quantize`` (:class:`Int8Weight`, :class:`Bf16Weight`),
    ``None`` for a plain tensor."""
    return "int8" if isinstance(w, Int8Weight) else "bf16" if isinstance(w, Bf16Weight) else None


#: per weight format: (the kernel runs here, its run-into-buffers call)
_KERNELS = {"int8": (q8_kernel.available, q8_kernel.linear_into),
            "bf16": (gemv_kernel.available, gemv_kernel.bf16w_linear_into),
            None: (gemv_kernel.available, gemv_kernel.linear_into)}


class _Matmuls:
    """The matmul of a :class:`RowStep` into its preallocated buffers: our GEMV on fp32 weights
    (:func:`~tensorpar.decode.gemv_kernel.into_args`), our Q8_0 x Q8_0 kernel on the :class:`Int8Weight` of
    ``--quantize int8`` (:func:`~tensorpar.decode.q8_kernel.into_args`, the activations quantized into one scratch
    the step's matmuls share: they run one after the other), or our GEMV widening the :class:`Bf16Weight` of
    ``--quantize bf16`` (:func:`~tensorpar.decode.gemv_kernel.bf16w_into_args`). Each is the kernel the general loop
    runs at these rows, so a matmul's output is bitwise the general loop's given the same input."""

    def __init__(self, fmt: str | None, rows: int, k: int, threads: int):
        self.threads = threads
        self.scratch = q8_kernel.scratch(rows, k) if fmt == "int8" else None
        self.run = _KERNELS[fmt][1]

    def args(self, x: torch.Tensor, w, y: torch.Tensor) -> tuple:
        """The arguments of ``y = x @ W.T`` for ``self.run``: ``x`` ``[M, K]``, ``w`` ``[N, K]`` (a tensor or an
        :class:`Int8Weight` or :class:`Bf16Weight`), ``y`` ``[M, N]``."""
        if isinstance(w, Int8Weight):
            return q8_kernel.into_args(x, w.q, w.scale, y, self.scratch, self.threads)
        if isinstance(w, Bf16Weight):
            return gemv_kernel.bf16w_into_args(x, w.w, y, self.threads)
        return gemv_kernel.into_args(x, w, y, self.threads)


class _Layer:
    """One layer's prepared kernel arguments for ``rows`` rows."""
    __slots__ = ("qkv", "gu", "down", "norm2", "norm_next", "o", "k", "v", "kv_of", "scale", "L")


class RowStep:
    """The one- or two-row decode step of decoder ``dec`` (:func:`why_not` must be ``None``); called by
    :meth:`~tensorpar.decode.lean.LeanDecoder.forward_segments` for a single segment of ``b <= MAX_ROWS`` rows of
    one token each whose tokens are all stored (``write`` None).

    Memory: a few buffers of ``MAX_ROWS`` rows (hidden, QKV, gate-up widths), fp32. Collectives: those of the
    general loop (the embedding's all-reduce, two per layer)."""

    def __init__(self, dec):
        self.dec = dec
        L0 = dec.layers[0]
        self.norm0 = _norm(L0.ln1)
        H = self.norm0[0].numel()
        nq, nkv, d = dec.n_q, dec.n_kv, dec.head_dim
        R = gemv_kernel.MAX_ROWS
        f = L0.f
        fmt = _format(dec.lm_w)
        # --quantize: the layers hold the stored weights [out, in]; else [in, out] views of the weights [out, in]
        out_in = (lambda w: w) if fmt is not None else (lambda w: w.t())
        e = dict(dtype=torch.float32, device=dec.lm_w.device)
        self.x, self.h, self.p = (torch.zeros(R, H, **e) for _ in range(3))      # residual, normed, partial sums
        self.qkv = torch.zeros(R, (nq + 2 * nkv) * d, **e)
        self.q = torch.zeros(R, nq, d, **e)
        self.gu = torch.zeros(R, 2 * f, **e)
        self.a = torch.zeros(R, f, **e)
        self.att = torch.zeros(R, nq * d, **e)                                   # attention's output
        self.scratch = torch.zeros(dec.cache.block_size, **e)                    # one query's scores
        self.rd = dec.perm.numel()
        cache = dec.cache
        self.head_stride = cache.k[0].stride(0)
        self.threads = torch.get_num_threads()
        self.mm = mm = _Matmuls(fmt, R, max(H, nq * d, f), self.threads)
        self.rows = {}
        for b in range(1, R + 1):
            layers = []
            for i, L in enumerate(dec.layers):
                la = _Layer()
                la.L = L
                la.qkv = mm.args(self.h[:b], out_in(L.wqkv), self.qkv[:b])
                la.gu = mm.args(self.h[:b], out_in(L.wgu), self.gu[:b])
                la.down = mm.args(self.a[:b], out_in(L.wd), self.p[:b])
                la.o = mm.args(self.att[:b], out_in(L.wo), self.p[:b])
                kv_of = (L.kv_idx.tolist() if L.kv_idx is not None
                         else [h * nkv // nq for h in range(nq)])                # each query head's KV head
                la.kv_of = (ctypes.c_int64 * nq)(*kv_of)
                la.scale = float(L.scaling if L.scaling is not None else d ** -0.5)
                w2, eps2 = _norm(L.ln2)
                la.norm2 = (self.x.data_ptr(), b, H, w2.data_ptr(), eps2, self.h.data_ptr())
                nxt = _norm(dec.layers[i + 1].ln1) if i + 1 < len(dec.layers) else _norm(dec.norm)
                la.norm_next = (self.x.data_ptr(), b, H, nxt[0].data_ptr(), nxt[1], self.h.data_ptr())
                la.k, la.v = cache.k[i].data_ptr(), cache.v[i].data_ptr()
                layers.append(la)
            self.rows[b] = (layers, self.x[:b], self.p[:b])

    def runs(self, segments) -> bool:
        """Whether this step is one :class:`RowStep` runs: one segment of at most MAX_ROWS rows of one token each,
        all stored, each row's positions in one block of the cache (generate's static cache; a paged row over
        several blocks takes the general loop)."""
        if len(segments) != 1:
            return False
        g = segments[0]
        return (g.s == 1 and g.b <= gemv_kernel.MAX_ROWS and g.write is None
                and g.length <= self.dec.cache.block_size)

    def _cache_plan(self, g):
        """``(row offsets, row blocks)`` as C arrays: the element offset in a layer's pool where each row's new K/V
        go, and the row's block (its one-block table, what attention reads). Raises ValueError for a row its block table or
        the cache does not cover."""
        cache, d = self.dec.cache, self.dec.head_dim
        bs, b, length = cache.block_size, g.b, g.length
        if g.blocks is None:
            if g.start + 1 > bs or length > bs or b > cache.num_blocks:
                raise ValueError(f"a start segment needs one block per row of at least {max(g.start + 1, length)} "
                                 f"positions; blocks hold {bs}")
            blocks, pos = list(range(b)), [g.start] * b
        else:
            if g.blocks.shape[1] < 1:
                raise ValueError("block tables of 0 blocks do not cover a position")
            blocks, pos = [t[0] for t in g.blocks.tolist()], [p for (p,) in g.cache_pos.tolist()]
        offs = [(blk * bs + p) * d for blk, p in zip(blocks, pos)]
        return (ctypes.c_int64 * b)(*offs), (ctypes.c_int64 * b)(*blocks)

    def __call__(self, ids: torch.Tensor, rope_pos: torch.Tensor, g) -> torch.Tensor:
        """Logits ``[b, V_r]`` of segment ``g``'s ``b`` rows (``ids``, ``rope_pos`` ``[b]``), their K/V written to
        the cache; what ``forward_segments(ids, rope_pos, [g])`` returns."""
        dec, tp = self.dec, self.dec.tp
        b = g.b
        layers, x, p = self.rows[b]
        nq, nkv, d, rd = dec.n_q, dec.n_kv, dec.head_dim, self.rd
        e = dec.embed(ids.view(1, b))                                                   # [1, b, h], all-reduced
        x.copy_(e.view(b, -1))
        tables = {}
        last = rope_pos if dec.rope_switch is not None else None   # longrope: a decode row's length is its position
        for key, rotary in dec.rotary.items():
            cos, sin = dec._rotary(rotary, e, rope_pos, last)                           # [b, 1, rd] each
            tables[key] = (cos.contiguous(), sin.contiguous())
        offs, blocks = self._cache_plan(g)
        bs = self.dec.cache.block_size
        mask, length = g.mask, g.length
        if mask is not None and mask.stride(-1) != 1:
            mask = mask.contiguous()
        mp, ms = (None, 0) if mask is None else (mask.data_ptr(), mask.stride(0))      # [b, 1, 1, L] bool
        w0, eps0 = self.norm0
        fused.rms_norm_raw((self.x.data_ptr(), b, x.shape[1], w0.data_ptr(), eps0, self.h.data_ptr()))
        qkv, qp, hs = self.qkv.data_ptr(), self.q.data_ptr(), self.head_stride
        sp, ap = self.scratch.data_ptr(), self.att.data_ptr()
        act = (self.gu.data_ptr(), b, self.a.shape[1], self.a.data_ptr())
        linear_into, rope_store, attention = self.mm.run, fused.rope_store, fused.decode_attention
        reduce_norm, silu_mul = fused.all_reduce_add_rms_norm, fused.silu_mul
        for la in layers:
            linear_into(la.qkv)                                                       # h -> qkv
            cos, sin = tables[la.L.rope]
            rope_store((qkv, b, nq, nkv, d, rd, cos.data_ptr(), sin.data_ptr(), qp, la.k, la.v, hs, offs))
            attention((qp, b, nq, d, la.k, la.v, hs, blocks, 1, bs, length, mp, ms, la.kv_of, la.scale, sp, ap))
            linear_into(la.o)                                                         # attention -> p
            reduce_norm(p, tp, la.norm2)                              # x += all_reduce(o W_o); h = ln2(x)
            linear_into(la.gu)
            silu_mul(act)                                                            # gu -> a
            linear_into(la.down)
            reduce_norm(p, tp, la.norm_next)                          # x += all_reduce(a W_d); h = next norm(x)
        logits = torch.empty(b, dec.lm_w.shape[0], dtype=torch.float32, device=x.device)
        linear_into(self.mm.args(self.h[:b], dec.lm_w, logits))
        return logits
