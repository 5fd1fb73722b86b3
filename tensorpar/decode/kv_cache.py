"""The lean decode path's KV cache and the attention that reads it (:class:`LeanKVCache`), and the batches of rows
a step runs (:class:`Segment`). :class:`~tensorpar.decode.lean.LeanDecoder` owns one; the per-layer math around
attention is in :mod:`tensorpar.decode.block`. No collectives.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_RUNS_MIN_ROW_POSITIONS = 512   # batch rows x cached positions from which decode attention runs per KV-head run


class Segment:
    """A batch of rows within :meth:`~tensorpar.decode.lean.LeanDecoder.forward_segments`: ``b`` rows of ``s``
    tokens each.

    K/V go to ``start`` (rows ``0..b-1`` of the cache, positions ``start .. start+s-1``) or, with ``slots`` ``[b]``
    int64 and ``cache_pos`` ``[b, s]`` int64, to each row's own slot and positions; attention reads cache
    entries ``[0, length)`` under ``mask`` ``[b, 1, s, length]`` bool (True = attend; ``None``: all of them).
    """
    __slots__ = ("b", "s", "mask", "length", "start", "slots", "cache_pos")

    def __init__(self, b: int, s: int, mask: torch.Tensor | None, length: int, *, start: int | None = None,
                 slots: torch.Tensor | None = None, cache_pos: torch.Tensor | None = None):
        if (start is None) == (slots is None) or (slots is None) != (cache_pos is None):
            raise ValueError("a segment takes either start or slots with cache_pos")
        self.b, self.s, self.mask, self.length = b, s, mask, length
        self.start, self.slots, self.cache_pos = start, slots, cache_pos


def offsets(segments) -> list[int]:
    """Where each segment's tokens start in a ``forward_segments`` call."""
    out, o = [], 0
    for g in segments:
        out.append(o)
        o += g.b * g.s
    return out


class LeanKVCache:
    """A static KV cache of this rank's KV heads for all layers, ``[num_layers, max_batch, kv_local, max_len, d]``
    for keys and as much for values, allocated once; a step takes the write and read views of all layers in one
    call each (:meth:`views`), writes its new K/V in place and attends to a view of the first ``length`` entries
    (:meth:`attention`).

    Memory: ``2 * num_layers * max_batch * kv_local * max_len * head_dim`` elements of ``dtype``; a bf16/fp16 cache
    on the CPU also keeps two fp32 buffers of one layer's ``[max_batch, kv_local, max_len, d]`` for decode attention.
    """

    def __init__(self, num_layers: int, max_batch: int, n_kv: int, max_len: int, head_dim: int, *,
                 dtype: torch.dtype, device: torch.device):
        self.max_batch, self.max_len, self.n_kv, self.head_dim = max_batch, max_len, n_kv, head_dim
        shape = (num_layers, max_batch, n_kv, max_len, head_dim)
        self.kcache = torch.zeros(shape, dtype=dtype, device=device)
        self.vcache = torch.zeros(shape, dtype=dtype, device=device)
        self.k, self.v = list(self.kcache.unbind(0)), list(self.vcache.unbind(0))
        self._fp32_bufs: list[torch.Tensor | None] = [None, None]

    def nbytes(self) -> int:
        """Bytes held by the KV cache."""
        return self.kcache.numel() * self.kcache.element_size() * 2

    def views(self, g: Segment):
        """``(kw, vw, keys_all, vals_all)`` of segment ``g``: per-layer cache views the new K/V are written to
        (``None``: scattered, written by index) and read from (``None``: scattered slots, gathered per layer)."""
        b, s, length = g.b, g.s, g.length
        kw = vw = keys_all = vals_all = None
        if g.slots is None:
            kw, vw = self.kcache[:, :b, :, g.start:g.start + s].unbind(0), \
                self.vcache[:, :b, :, g.start:g.start + s].unbind(0)
            return kw, vw, self.kcache[:, :b, :, :length].unbind(0), self.vcache[:, :b, :, :length].unbind(0)
        slots, cache_pos = g.slots, g.cache_pos
        if b == 1:                  # one serving slot: its rows as a contiguous range when it is one
            j, p0 = int(slots[0]), int(cache_pos[0, 0])
            if s == 1 or torch.equal(cache_pos[0], torch.arange(p0, p0 + s, device=cache_pos.device)):
                kw, vw = self.kcache[:, j:j + 1, :, p0:p0 + s].unbind(0), self.vcache[:, j:j + 1, :, p0:p0 + s].unbind(0)
            return kw, vw, self.kcache[:, j:j + 1, :, :length].unbind(0), self.vcache[:, j:j + 1, :, :length].unbind(0)
        j = int(slots[0])           # serving rows in consecutive slots: read the cache through views
        if torch.equal(slots, torch.arange(j, j + b, device=slots.device)):
            keys_all = self.kcache[:, j:j + b, :, :length].unbind(0)
            vals_all = self.vcache[:, j:j + b, :, :length].unbind(0)
        return None, None, keys_all, vals_all

    def attention(self, i: int, L, qk: torch.Tensor, v_new: torch.Tensor, segments: list[Segment], views: list,
                  n_q: int) -> torch.Tensor:
        """Layer ``i``'s attention for all segments: write each segment's new K/V into the cache, attend its
        queries to the cache entries ``[0, length)``.

        ``qk`` ``[T, q_local + kv_local, d]``: the rotated query and key heads; ``v_new`` ``[T, kv_local, d]``;
        ``views``: :meth:`views` of each segment; ``L``: the layer's :class:`~tensorpar.decode.block.Layer`
        (``scaling``, ``gqa``, ``kv_runs``, ``kv_idx``). Returns ``[T, q_local * d]`` in the cache's dtype.
        """
        d, nkv = self.head_dim, self.n_kv
        sdpa = L.sdpa       # the layer's kernel (tensorpar.decode.block: F.scaled_dot_product_attention or soft-capped)
        # Decode (one query per row) in bf16/fp16 on the CPU: attention on fp32 copies of q and the cache entries
        # read (into two fp32 buffers allocated once, :meth:`_fp32`), output rounded back. torch's CPU flash
        # attention in bf16 is about 5x slower than this at the serving decode shape (32 rows of SmolLM2's tp=2
        # heads over 80 cached positions, casts included, torch 2.13, one thread: bench/results/attention_dtype.md)
        # and took most of a bf16 serving step before; the fp32 result is the more accurate one. Prefill keeps the
        # model dtype (there the two cost the same).
        dtype = qk.dtype
        low = dtype in (torch.bfloat16, torch.float16) and qk.device.type == "cpu"
        outs, t0 = [], 0
        for g, (kw, vw, keys_all, vals_all) in zip(segments, views):
            b, s, t1 = g.b, g.s, t0 + g.b * g.s
            q = qk[t0:t1, :n_q].view(b, s, n_q, d).transpose(1, 2)                     # [b, q_local, s, d]
            k = qk[t0:t1, n_q:].view(b, s, nkv, d).transpose(1, 2)                     # [b, kv_local, s, d]
            v = v_new[t0:t1].view(b, s, nkv, d).transpose(1, 2)
            t0 = t1
            if kw is not None:
                kw[i].copy_(k)
                vw[i].copy_(v)
            else:
                kc, vc = self.k[i], self.v[i]
                kc[g.slots[:, None], :, g.cache_pos] = k.transpose(1, 2)
                vc[g.slots[:, None], :, g.cache_pos] = v.transpose(1, 2)
            if keys_all is not None:
                keys, vals = keys_all[i], vals_all[i]
            else:                           # rows in scattered slots: gather them
                keys = self.k[i][:, :, :g.length].index_select(0, g.slots)
                vals = self.v[i][:, :, :g.length].index_select(0, g.slots)
            up = low and s == 1
            if up:                          # CPU decode in bf16/fp16: attention in fp32 (see low above)
                q, keys, vals = q.float(), self._fp32(0, keys), self._fp32(1, vals)
            mask = g.mask
            if L.kv_runs is None:
                o = sdpa(q, keys, vals, attn_mask=mask, scale=L.scaling, enable_gqa=L.gqa)   # [b, q_local, s, d]
            elif s == 1 and b * g.length >= _RUNS_MIN_ROW_POSITIONS:   # decode: per run of query heads with its
                # KV head (bitwise the copied-heads result); below the threshold the copies cost less than the
                # extra attention calls (batch-1 decode of SmolLM2 at tp=2: 4650 against 4127 aten ops per
                # token, bench/results/decode-0444-kv-runs-always.md against decode.md)
                o = torch.cat([sdpa(q[:, q0:q1], keys[:, j:j + 1], vals[:, j:j + 1], attn_mask=mask,
                                    scale=L.scaling, enable_gqa=q1 - q0 > 1) for j, q0, q1 in L.kv_runs], dim=1)
            else:       # prefill (CPU attention over s > 1 queries blocks by head count) or small: copy
                idx = L.kv_idx
                o = sdpa(q, keys.index_select(1, idx), vals.index_select(1, idx), attn_mask=mask,
                         scale=L.scaling)
            if up:
                o = o.to(dtype)
            outs.append(o.transpose(1, 2).reshape(b * s, -1))                          # [b*s, q_local*d]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _fp32(self, which: int, t: torch.Tensor) -> torch.Tensor:
        """``t`` (cache keys or values read for attention, ``[b, kv_local, L, d]``) cast into a view of fp32 buffer
        ``which`` (0 keys, 1 values; ``[max_batch, kv_local, max_len, d]``, allocated on first use): a fresh
        fp32 tensor per layer would be a large allocation each time, which glibc may serve by mmap and page
        faults (measured: the casts then cost as much as the bf16 attention they replace)."""
        bufs = self._fp32_bufs
        if bufs[which] is None:
            bufs[which] = torch.empty(self.max_batch, self.n_kv, self.max_len, self.head_dim, dtype=torch.float32,
                                      device=t.device)
        b, n, L, _ = t.shape
        return bufs[which][:b, :n, :L].copy_(t)
