"""The lean path's decode step of one or two rows, in few calls per layer (:class:`RowStep`).

Batch-1 decode of a small model is bound by the work around the matmuls, paid per layer by every rank: SmolLM2
at tp=2 spent 5.0 ms per token in 4127 framework ops (137 per layer) against 18 ms of matmuls (docs/benchmarks.md).
A :class:`RowStep` runs a step of at most :data:`~tensorpar.decode.gemv_kernel.MAX_ROWS` rows of one token each on
buffers allocated once, with the per-layer arguments of every kernel prepared once at construction:

* the four matmuls: our GEMV into the preallocated outputs (:func:`~tensorpar.decode.gemv_kernel.linear_into`);
* rotary on the q and k heads and the cache write of k and v: one call (:func:`~tensorpar.decode.fused.rope_store`),
  the tables once per step;
* each all-reduce fused with the residual add and the next RMSNorm (the layer's post-attention norm, the next
  layer's input norm, the final norm): one call that reads the ranks' partial sums in shared memory
  (:func:`~tensorpar.decode.fused.all_reduce_add_rms_norm`);
* attention: the cache views of all layers once per step (:meth:`~tensorpar.decode.kv_cache.LeanKVCache.read_views`),
  per layer ``scaled_dot_product_attention`` as :meth:`~tensorpar.decode.kv_cache.LeanKVCache.attention` calls it
  (the same kernel, views and head copies, so the same bits); SiLU and the gate product: two in-place ops.

It runs the layers of the plain Llama shape (:func:`why_not` says which it does not) in fp32 on the GEMV path
(:attr:`LeanDecoder.gemv <tensorpar.decode.lean.LeanDecoder>`); everything else, prefill and bigger steps run
:meth:`~tensorpar.decode.lean.LeanDecoder.forward_segments`' general loop. Results: the residual stream, rotary,
cache and attention bitwise those of the general loop given the same norm outputs; the norms within a few units
in the last place of it (their sum of squares in another order, :mod:`tensorpar.decode.fused`), so the logits
agree to fp32 rounding and greedy tokens equal transformers' (tests/decode/test_row_step.py).
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from tensorpar.decode import fused, gemv_kernel, kv_cache


def _norm(fn):
    """``(weight, eps)`` of a norm callable the fused kernel can replace (the fp32 RMSNorm of
    :func:`~tensorpar.decode.kernels.rms_norm_fn`), else ``None``."""
    w = getattr(fn, "weight", None)
    if fn is None or w is None or not isinstance(getattr(fn, "eps", None), float) or w.dtype != torch.float32:
        return None
    return w.contiguous(), fn.eps


def why_not(dec) -> str | None:
    """Why decoder ``dec`` (a :class:`~tensorpar.decode.lean.LeanDecoder`) cannot run its one-row steps as a
    :class:`RowStep` (``None``: it can)."""
    if dec.tile is not None or not (dec.first and dec.last):
        return "deterministic mode or a pipeline stage"
    if not dec.gemv or dec.lm_w.dtype != torch.float32:
        return "it runs without our GEMV or not in fp32"
    if dec.windows or dec.final_cap is not None or dec.tp.compression == "int8" or dec.lm_b is not None:
        return "sliding windows, logit soft-capping, --tp-comm int8 or an LM head bias"
    if not fused.available() or _norm(dec.norm) is None:
        return "no fused kernels here, or the final norm is not the plain fp32 RMSNorm"
    for L in dec.layers:
        plain = (L.post_attn is None and L.post_ff is None and L.bqkv is None and L.bo is None and L.bgu is None
                 and L.bd is None and L.gated and L.silu and L.moe is None and L.qk_norm is None
                 and not L.interleaved and not L.parallel and L.sdpa is F.scaled_dot_product_attention)
        if not plain or _norm(L.ln1) is None or _norm(L.ln2) is None:
            return "a layer that is not of the plain Llama shape (pre-RMSNorms, gated SiLU MLP, no biases)"
    return None


class _Layer:
    """One layer's prepared kernel arguments for ``rows`` rows."""
    __slots__ = ("qkv", "gu", "down", "norm2", "norm_next", "wo", "k", "v", "L")


class RowStep:
    """The one- or two-row decode step of decoder ``dec`` (:func:`why_not` must be ``None``); called by
    :meth:`~tensorpar.decode.lean.LeanDecoder.forward_segments` for a single segment of ``b <= MAX_ROWS`` rows of
    one token each whose tokens are all stored (``write`` None).

    Memory: a few buffers of ``MAX_ROWS`` rows (hidden, QKV, gate-up widths), fp32. Collectives: those of the
    general loop (the embedding's all-reduce, two per layer)."""

    def __init__(self, dec):
        self.dec = dec
        L0 = dec.layers[0]
        H = L0.wqkv.shape[0]
        nq, nkv, d = dec.n_q, dec.n_kv, dec.head_dim
        R = gemv_kernel.MAX_ROWS
        f = L0.f
        e = dict(dtype=torch.float32, device=dec.lm_w.device)
        self.x, self.h, self.p = (torch.zeros(R, H, **e) for _ in range(3))      # residual, normed, partial sums
        self.qkv = torch.zeros(R, (nq + 2 * nkv) * d, **e)
        self.q = torch.zeros(R, nq, d, **e)
        self.gu = torch.zeros(R, 2 * f, **e)
        self.a = torch.zeros(R, f, **e)
        self.rd = dec.perm.numel()
        cache = dec.cache
        self.head_stride = cache.k[0].stride(0)
        self.threads = torch.get_num_threads()
        self.norm0 = _norm(L0.ln1)
        self.rows = {}
        for b in range(1, R + 1):
            layers = []
            for i, L in enumerate(dec.layers):
                la = _Layer()
                la.L = L
                la.qkv = gemv_kernel.into_args(self.h[:b], L.wqkv.t(), self.qkv[:b], self.threads)
                la.gu = gemv_kernel.into_args(self.h[:b], L.wgu.t(), self.gu[:b], self.threads)
                la.down = gemv_kernel.into_args(self.a[:b], L.wd.t(), self.p[:b], self.threads)
                la.wo = (L.wo.t().data_ptr(), L.wo.shape[0], L.wo.shape[1])     # [out, in] weight, K, N
                w2, eps2 = _norm(L.ln2)
                la.norm2 = (self.x.data_ptr(), b, H, w2.data_ptr(), eps2, self.h.data_ptr())
                nxt = _norm(dec.layers[i + 1].ln1) if i + 1 < len(dec.layers) else _norm(dec.norm)
                la.norm_next = (self.x.data_ptr(), b, H, nxt[0].data_ptr(), nxt[1], self.h.data_ptr())
                la.k, la.v = cache.k[i].data_ptr(), cache.v[i].data_ptr()
                layers.append(la)
            self.rows[b] = (layers, self.x[:b], self.p[:b], self.q[:b].view(b, nq, 1, d), self.gu[:b, :f],
                            self.gu[:b, f:], self.a[:b])

    def runs(self, segments) -> bool:
        """Whether this step is one :class:`RowStep` runs: one segment of at most MAX_ROWS rows of one token each,
        all stored."""
        if len(segments) != 1:
            return False
        g = segments[0]
        return g.s == 1 and g.b <= gemv_kernel.MAX_ROWS and g.write is None

    def _cache_plan(self, g):
        """``(row offsets (C array), keys, vals, gather)``: where each row's new K/V go in a layer's pool (elements),
        and the per-layer views read (``None`` with ``gather`` the blocks to gather)."""
        cache, d = self.dec.cache, self.dec.head_dim
        bs, b, length = cache.block_size, g.b, g.length
        if g.blocks is None:
            if g.start + 1 > bs or length > bs or b > cache.num_blocks:
                raise ValueError(f"a start segment needs one block per row of at least {max(g.start + 1, length)} "
                                 f"positions; blocks hold {bs}")
            offs = [(r * bs + g.start) * d for r in range(b)]
            j, nb, consecutive = 0, 1, True
        else:
            nb = -(-length // bs)
            if g.blocks.shape[1] < nb:
                raise ValueError(f"block tables of {g.blocks.shape[1]} blocks do not cover {length} positions of "
                                 f"{bs}-position blocks")
            tables, pos = g.blocks.tolist(), g.cache_pos.tolist()
            offs = [(tables[r][p // bs] * bs + p % bs) * d for r, (p,) in enumerate(pos)]
            j = tables[0][0]
            consecutive = all(tables[r][k] == j + r * nb + k for r in range(b) for k in range(nb))
        keys, vals = cache.read_views(j, b, nb, length) if consecutive else (None, None)
        gather = None if keys is not None else g.blocks[:, :nb].reshape(-1)
        return (ctypes.c_int64 * b)(*offs), keys, vals, gather

    def __call__(self, ids: torch.Tensor, rope_pos: torch.Tensor, g) -> torch.Tensor:
        """Logits ``[b, V_r]`` of segment ``g``'s ``b`` rows (``ids``, ``rope_pos`` ``[b]``), their K/V written to
        the cache; what ``forward_segments(ids, rope_pos, [g])`` returns."""
        dec, tp = self.dec, self.dec.tp
        b = g.b
        layers, x, p, q4, gate, up, a = self.rows[b]
        nq, nkv, d, rd = dec.n_q, dec.n_kv, dec.head_dim, self.rd
        e = dec.embed(ids.view(1, b))                                                   # [1, b, h], all-reduced
        x.copy_(e.view(b, -1))
        tables = {}
        last = rope_pos if dec.rope_switch is not None else None   # longrope: a decode row's length is its position
        for key, rotary in dec.rotary.items():
            cos, sin = dec._rotary(rotary, e, rope_pos, last)                           # [b, 1, rd] each
            tables[key] = (cos.contiguous(), sin.contiguous())
        offs, keys_all, vals_all, gather = self._cache_plan(g)
        cache, mask, length = dec.cache, g.mask, g.length
        runs = b * length >= kv_cache._RUNS_MIN_ROW_POSITIONS   # read per step: tests change it
        w0, eps0 = self.norm0
        fused.rms_norm_raw((self.x.data_ptr(), b, x.shape[1], w0.data_ptr(), eps0, self.h.data_ptr()))
        qkv, qp, hs, th = self.qkv.data_ptr(), self.q.data_ptr(), self.head_stride, self.threads
        pp = self.p.data_ptr()
        linear_into, rope_store, reduce_norm = gemv_kernel.linear_into, fused.rope_store, fused.all_reduce_add_rms_norm
        for i, la in enumerate(layers):
            L = la.L
            linear_into(la.qkv)
            cos, sin = tables[L.rope]
            rope_store((qkv, b, nq, nkv, d, rd, cos.data_ptr(), sin.data_ptr(), qp, la.k, la.v, hs, offs))
            if keys_all is not None:
                keys, vals = keys_all[i], vals_all[i]
            else:
                keys = cache._gathered(cache.k[i], gather, b, length)
                vals = cache._gathered(cache.v[i], gather, b, length)
            if L.kv_runs is None:
                o = F.scaled_dot_product_attention(q4, keys, vals, attn_mask=mask, scale=L.scaling,
                                                   enable_gqa=L.gqa)                   # [b, q_local, 1, d]
            elif runs:      # as LeanKVCache.attention: per run of query heads with its KV head
                o = torch.cat([F.scaled_dot_product_attention(
                    q4[:, q0:q1], keys[:, j:j + 1], vals[:, j:j + 1], attn_mask=mask, scale=L.scaling,
                    enable_gqa=q1 - q0 > 1) for j, q0, q1 in L.kv_runs], dim=1)
            else:
                idx = L.kv_idx
                o = F.scaled_dot_product_attention(q4, keys.index_select(1, idx), vals.index_select(1, idx),
                                                   attn_mask=mask, scale=L.scaling)
            o = o.transpose(1, 2).reshape(b, nq * d).contiguous()                        # [b, q_local * d]
            wo, K, N = la.wo
            linear_into((0, gemv_kernel.MODE_ONE_ROW, o.data_ptr(), b, K, wo, N, None, pp, th,
                         gemv_kernel.PREFETCH))
            reduce_norm(p, tp, la.norm2)                              # x += all_reduce(o W_o); h = ln2(x)
            linear_into(la.gu)
            torch.mul(F.silu(gate, inplace=True), up, out=a)
            linear_into(la.down)
            reduce_norm(p, tp, la.norm_next)                          # x += all_reduce(a W_d); h = next norm(x)
        logits = torch.empty(b, dec.lm_w.shape[0], dtype=torch.float32, device=x.device)
        linear_into(gemv_kernel.into_args(self.h[:b], dec.lm_w, logits, th))
        return logits
