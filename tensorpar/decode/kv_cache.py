"""The lean decode path's KV cache, a pool of fixed-size blocks read through block tables, and the attention that
reads it (:class:`LeanKVCache`), and the batches of rows a step runs (:class:`Segment`).
:class:`~tensorpar.decode.lean.LeanDecoder` owns one; the per-layer math around attention is in
:mod:`tensorpar.decode.block`. No collectives.

Paging (Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with PagedAttention",
SOSP): position ``p`` of a row lives in block ``table[p // block_size]`` at offset ``p % block_size``. The static
per-slot cache is the special case ``block_size = max_len`` with one block per row (``generate``, ``verify``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tensorpar.decode import fused

_RUNS_MIN_ROW_POSITIONS = 512   # batch rows x cached positions from which decode attention runs per KV-head run


def block_bytes(num_layers: int, kv_local: int, block_size: int, head_dim: int, element_size: int) -> int:
    """Bytes of one block of the pool on a rank holding ``kv_local`` KV heads: keys and values of
    ``block_size`` positions of every layer. The serve launcher sizes the pool with this rule
    (``--kv-cache-memory``) and every rank allocates it (:class:`LeanKVCache`, the module path's slots)."""
    return 2 * num_layers * kv_local * block_size * head_dim * element_size


class Segment:
    """A batch of rows within :meth:`~tensorpar.decode.lean.LeanDecoder.forward_segments`: ``b`` rows of ``s``
    tokens each.

    K/V go to ``start`` (rows ``0..b-1`` are blocks ``0..b-1``, one block per row, positions
    ``start .. start+s-1``) or, with ``blocks`` ``[b, nb]`` int64 (each row's block table: position ``p`` in block
    ``blocks[row, p // block_size]``, ``nb * block_size >= length``) and ``cache_pos`` ``[b, s]`` int64, to each
    row's own positions; ``write`` ``[b, s]`` bool (``None``: all) says which tokens are stored (a padded prefill's
    pads are not: their position may lie beyond the row's table). Attention reads each row's positions
    ``[0, length)`` under ``mask`` ``[b, 1, s, length]`` bool (True = attend; ``None``: all of them).
    """
    __slots__ = ("b", "s", "mask", "length", "start", "blocks", "cache_pos", "write")

    def __init__(self, b: int, s: int, mask: torch.Tensor | None, length: int, *, start: int | None = None,
                 blocks: torch.Tensor | None = None, cache_pos: torch.Tensor | None = None,
                 write: torch.Tensor | None = None):
        if (start is None) == (blocks is None) or (blocks is None) != (cache_pos is None):
            raise ValueError("a segment takes either start or blocks with cache_pos")
        self.b, self.s, self.mask, self.length = b, s, mask, length
        self.start, self.blocks, self.cache_pos, self.write = start, blocks, cache_pos, write


def token_positions(g: Segment) -> list[tuple[int, int, int]]:
    """``(row, column, cache position)`` of each token of segment ``g`` whose K/V are stored (a padded prefill's
    pads are left out): the queries the deterministic attention runs one by one (:meth:`LeanKVCache.attention`)."""
    pos = (g.cache_pos.tolist() if g.cache_pos is not None
           else [list(range(g.start, g.start + g.s))] * g.b)
    write = g.write.tolist() if g.write is not None else None
    return [(r, c, pos[r][c]) for r in range(g.b) for c in range(g.s) if write is None or write[r][c]]


def offsets(segments) -> list[int]:
    """Where each segment's tokens start in a ``forward_segments`` call."""
    out, o = [], 0
    for g in segments:
        out.append(o)
        o += g.b * g.s
    return out


class LeanKVCache:
    """A pool of ``num_blocks`` KV blocks of ``block_size`` positions of this rank's KV heads for all layers,
    ``[num_layers, kv_local, num_blocks, block_size, d]`` for keys and as much for values, allocated once.

    A step takes each segment's write and read plan (:meth:`views`), writes its new K/V in place (a view when the
    positions are contiguous in one block, else ``index_copy_`` to ``block * block_size + offset``) and attends
    to each row's first ``length`` positions (:meth:`attention`): a view of the pool when the rows' blocks are
    consecutive (one block per row in consecutive blocks, or one row in consecutive blocks: the layout puts the
    KV head first so that a run of blocks is one contiguous range of positions), else gathered per layer by one
    ``index_select`` (measured: bench/results/serve_prefix.md).

    Memory: ``num_blocks * block_bytes(...)`` (:func:`block_bytes`); a bf16/fp16 cache on the CPU also keeps two
    fp32 buffers of one layer's ``[max_batch, kv_local, max_len, d]`` for decode attention; a paged read that
    gathers keeps two buffers of the largest gather so far (one layer's keys or values of the step's rows, at most
    ``[kv_local, rows x blocks per row, block_size, d]``, :meth:`_gathered`).
    """

    def __init__(self, num_layers: int, num_blocks: int, n_kv: int, block_size: int, head_dim: int, *,
                 max_batch: int, max_len: int, dtype: torch.dtype, device: torch.device):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_batch, self.max_len, self.n_kv, self.head_dim = max_batch, max_len, n_kv, head_dim
        shape = (num_layers, n_kv, num_blocks, block_size, head_dim)
        self.kcache = torch.zeros(shape, dtype=dtype, device=device)
        self.vcache = torch.zeros(shape, dtype=dtype, device=device)
        self.k, self.v = list(self.kcache.unbind(0)), list(self.vcache.unbind(0))
        self._fp32_bufs: list[torch.Tensor | None] = [None, None]
        self._gather_bufs: list[torch.Tensor | None] = [None, None]     # keys, values read by block (:meth:`_gathered`)
        self._kv_of: dict[int, torch.Tensor] = {}     # per layer: each query head's KV head (:meth:`_fused_decode`)

    def nbytes(self) -> int:
        """Bytes held by the KV cache."""
        return self.kcache.numel() * self.kcache.element_size() * 2

    def views(self, g: Segment):
        """``(kw, vw, dest, src, keys_all, vals_all, gather)`` of segment ``g``: per-layer views the new K/V are
        written to (``None``: written by index, to flat pool positions ``dest`` ``[n]`` from the segment's tokens
        ``src`` ``[n]``, ``None`` = all in order), and per-layer views read (``None``: gathered per layer, blocks
        ``gather`` ``[b * nb]``). Raises ValueError for a row whose positions its block table does not cover."""
        b, s, length, bs = g.b, g.s, g.length, self.block_size
        kw = vw = dest = src = keys_all = vals_all = gather = None
        if g.blocks is None:        # rows 0..b-1 are blocks 0..b-1
            if g.start + s > bs or length > bs or b > self.num_blocks:
                raise ValueError(f"a start segment needs one block per row of at least {max(g.start + s, length)} "
                                 f"positions; blocks hold {bs}")
            kw = self.kcache[:, :, :b, g.start:g.start + s].transpose(1, 2).unbind(0)
            vw = self.vcache[:, :, :b, g.start:g.start + s].transpose(1, 2).unbind(0)
            keys_all, vals_all = self.read_views(0, b, 1, length)
            return kw, vw, dest, src, keys_all, vals_all, gather
        blocks, pos = g.blocks, g.cache_pos
        nb = -(-length // bs)                           # blocks each row reads
        if blocks.shape[1] < nb:
            raise ValueError(f"block tables of {blocks.shape[1]} blocks do not cover {length} positions of "
                             f"{bs}-position blocks")
        blocks = blocks[:, :nb]
        j = int(blocks[0, 0])
        p0 = int(pos[0, 0])
        if b == 1 and g.write is None and (p0 % bs) + s <= bs and \
                (s == 1 or torch.equal(pos[0], torch.arange(p0, p0 + s, device=pos.device))):
            w = int(blocks[0, p0 // bs])                # one row's contiguous positions within one block: a view
            o = p0 % bs
            kw = [t[:, w:w + 1, o:o + s].transpose(0, 1) for t in self.k]
            vw = [t[:, w:w + 1, o:o + s].transpose(0, 1) for t in self.v]
        else:
            blk = blocks.gather(1, (pos // bs).clamp(max=nb - 1))                      # [b, s]
            flat = (blk * bs + pos % bs).reshape(-1)
            if g.write is not None:
                src = g.write.reshape(-1).nonzero().squeeze(1)
                flat = flat.index_select(0, src)
            dest = flat
        run = torch.arange(j, j + b * nb, device=blocks.device).view(b, nb)
        if torch.equal(blocks, run):            # consecutive blocks: the pool read through views
            keys_all, vals_all = self.read_views(j, b, nb, length)
        if keys_all is None:
            gather = blocks.reshape(-1)
        return kw, vw, dest, src, keys_all, vals_all, gather

    def read_views(self, j: int, b: int, nb: int, length: int):
        """Per-layer views ``[b, kv_local, length, d]`` of the keys and of the values of ``b`` rows whose ``nb``
        blocks each are the consecutive blocks ``j, j + 1, ...`` (row after row), or ``(None, None)`` when they
        cannot be views (several rows of several blocks). A few framework calls for all layers (``unbind``)."""
        if nb == 1:                          # one block per row
            return tuple(c[:, :, j:j + b, :length].transpose(1, 2).unbind(0) for c in (self.kcache, self.vcache))
        if b == 1:                           # one row over a run of blocks: one range of positions
            n_layers, n, _, bs, d = self.kcache.shape
            return tuple(c[:, :, j:j + nb].reshape(n_layers, n, nb * bs, d)[:, None, :, :length].unbind(0)
                         for c in (self.kcache, self.vcache))
        return None, None

    def _gathered(self, which: int, t: torch.Tensor, gather: torch.Tensor, b: int, length: int) -> torch.Tensor:
        """Layer tensor ``t`` ``[kv_local, num_blocks, block_size, d]`` read at blocks ``gather`` ``[b * nb]``
        (each row's ``nb`` blocks in order): ``[b, kv_local, length, d]``, a view of gather buffer ``which`` (0 keys,
        1 values), reused by every layer and step: read before the next gather of its kind.

        Why a buffer: into a fresh ``[kv_local, b * nb, block_size, d]`` tensor per layer (1.5-1.8 MB at 32 rows of
        SmolLM2 at tp=2) the gathers took 1.74 ms a call and 42 % of a 32-row paged decode step inside the engine,
        into these buffers 0.32 ms (bench/results/serve_fast.md; not glibc's trimming or mmap: turning those off
        did not help)."""
        n, _, bs, d = t.shape
        nb = gather.numel() // b
        numel = n * gather.numel() * bs * d
        buf = self._gather_bufs[which]
        if buf is None or buf.numel() < numel or buf.dtype != t.dtype or buf.device != t.device:
            buf = self._gather_bufs[which] = torch.empty(numel, dtype=t.dtype, device=t.device)
        out = buf[:numel].view(n, gather.numel(), bs, d)
        torch.index_select(t, 1, gather, out=out)
        return out.view(n, b, nb * bs, d)[:, :, :length].transpose(0, 1)

    def attention(self, i: int, L, qk: torch.Tensor, v_new: torch.Tensor, segments: list[Segment], views: list,
                  n_q: int, per_token: list | None = None) -> torch.Tensor:
        """Layer ``i``'s attention for all segments: write each segment's new K/V into the pool, attend its
        queries to each row's positions ``[0, length)``.

        ``qk`` ``[T, q_local + kv_local, d]``: the rotated query and key heads; ``v_new`` ``[T, kv_local, d]``;
        ``views``: :meth:`views` of each segment; ``L``: the layer's :class:`~tensorpar.decode.block.Layer`
        (``scaling``, ``gqa``, ``kv_runs``, ``kv_idx``). Returns ``[T, q_local * d]`` in the cache's dtype.

        ``per_token`` (the deterministic mode): per segment, :func:`token_positions`; each of those queries then
        attends alone (``[1, q_local, 1, d]``) to fresh contiguous copies of its row's keys and values at positions
        ``[lo, p]`` (``lo = p - window + 1`` on a sliding-window layer, else 0), in fp32 for a bf16/fp16 cache on
        the CPU, so its result is that of the same token decoded alone, whatever the segment's rows, length or
        padding; the pads' outputs are zeros.
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
        for g, (kw, vw, dest, src, keys_all, vals_all, gather) in zip(segments, views):
            b, s, t1 = g.b, g.s, t0 + g.b * g.s
            q = qk[t0:t1, :n_q].view(b, s, n_q, d).transpose(1, 2)                     # [b, q_local, s, d]
            k = qk[t0:t1, n_q:].view(b, s, nkv, d).transpose(1, 2)                     # [b, kv_local, s, d]
            v = v_new[t0:t1].view(b, s, nkv, d).transpose(1, 2)
            t0 = t1
            if kw is not None:
                kw[i].copy_(k)
                vw[i].copy_(v)
            else:                           # to flat positions block * block_size + offset of the pool
                for new, pool in ((k, self.k[i]), (v, self.v[i])):
                    x = new.permute(1, 0, 2, 3).reshape(nkv, b * s, d)                  # [kv_local, b*s, d]
                    if src is not None:
                        x = x.index_select(1, src)
                    pool.view(nkv, -1, d).index_copy_(1, dest, x)
            if s == 1 and per_token is None and self._fused(L, qk):     # decode: the blocks read in place
                outs.append(self._fused_decode(i, L, q, g, n_q))
                continue
            if keys_all is not None:
                keys, vals = keys_all[i], vals_all[i]
            else:                           # rows in scattered blocks: gather them
                keys = self._gathered(0, self.k[i], gather, b, g.length)
                vals = self._gathered(1, self.v[i], gather, b, g.length)
            if per_token is not None:
                outs.append(self._per_token(L, q, keys, vals, per_token[len(outs)], low))
                continue
            up = low and s == 1
            if up:                          # CPU decode in bf16/fp16: attention in fp32 (see low above)
                q, keys, vals = q.float(), self._fp32(0, keys), self._fp32(1, vals)
            mask = g.mask
            if L.kv_runs is None:
                o = sdpa(q, keys, vals, attn_mask=mask, scale=L.scaling, enable_gqa=L.gqa)   # [b, q_local, s, d]
            elif s == 1 and b * g.length >= _RUNS_MIN_ROW_POSITIONS:   # decode: per run of query heads with its
                # KV head (the copied-heads result, bitwise on AVX-512, within an ulp on AVX2); below the threshold the copies cost less than the
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

    def _fused(self, L, qk: torch.Tensor) -> bool:
        """Whether layer ``L``'s decode attention runs :func:`tensorpar.decode.fused.decode_attention` (fp32 on a CPU
        where the fused kernels run, the plain ``scaled_dot_product_attention``: no soft-capping)."""
        return (qk.dtype == torch.float32 and qk.device.type == "cpu" and L.sdpa is F.scaled_dot_product_attention
                and fused.available())

    def _fused_decode(self, i: int, L, q: torch.Tensor, g: Segment, n_q: int) -> torch.Tensor:
        """Decode attention of segment ``g`` (one query per row, its K/V already written) at layer ``i`` by the fused
        kernel, reading each row's blocks of the pool in place (no gather, no copies per query head, one call for
        all rows and heads); ``q`` ``[b, q_local, 1, d]``. Returns ``[b, q_local * d]``. Within fp32 rounding of
        the ``scaled_dot_product_attention`` path it replaces (``fused.decode_attention``)."""
        b, d, length, bs = g.b, self.head_dim, g.length, self.block_size
        kv_of = self._kv_of.get(i)
        if kv_of is None:          # each query head's KV head: the layer's uneven map, or enable_gqa's grouping
            idx = L.kv_idx.tolist() if L.kv_idx is not None else [h * self.n_kv // n_q for h in range(n_q)]
            kv_of = self._kv_of[i] = torch.tensor(idx, dtype=torch.int64)
        if g.blocks is not None:
            blocks = g.blocks if g.blocks.stride(-1) == 1 else g.blocks.contiguous()
        else:                      # rows 0..b-1 in blocks 0..b-1
            blocks = torch.arange(b, dtype=torch.int64).view(b, 1)
        mask = g.mask
        if mask is not None and mask.stride(-1) != 1:
            mask = mask.contiguous()
        q = q.reshape(b, n_q, d).contiguous()
        out = torch.empty(b, n_q * d, dtype=torch.float32)
        scratch = torch.empty(length, dtype=torch.float32)
        k, v = self.k[i], self.v[i]
        scale = float(L.scaling if L.scaling is not None else d ** -0.5)
        fused.decode_attention((q.data_ptr(), b, n_q, d, k.data_ptr(), v.data_ptr(), k.stride(0),
                                blocks.data_ptr(), blocks.stride(0), bs, length,
                                None if mask is None else mask.data_ptr(), 0 if mask is None else mask.stride(0),
                                kv_of.data_ptr(), scale, scratch.data_ptr(), out.data_ptr()))
        return out

    def _per_token(self, L, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, tokens: list, low: bool):
        """:meth:`attention` of one segment in the deterministic mode: ``q`` ``[b, q_local, s, d]``, ``keys`` /
        ``vals`` ``[b, kv_local, length, d]``, ``tokens`` its :func:`token_positions`. Returns ``[b * s,
        q_local * d]``."""
        b, nq, s, d = q.shape
        out = q.new_zeros(b, s, nq, d)
        w, idx = L.window, L.kv_idx
        if idx is not None:                 # KV heads copied per query head (uneven layouts), once per segment
            keys, vals = keys.index_select(1, idx), vals.index_select(1, idx)
        gqa = idx is None and L.gqa
        fresh = dict(dtype=torch.float32 if low else q.dtype, memory_format=torch.contiguous_format, copy=True)
        for r, c, p in tokens:
            lo = 0 if w is None else max(0, p - w + 1)
            qt = q[r:r + 1, :, c:c + 1].to(**fresh)                                         # [1, q_local, 1, d]
            kt = keys[r:r + 1, :, lo:p + 1].to(**fresh)                                     # [1, heads, n, d]
            vt = vals[r:r + 1, :, lo:p + 1].to(**fresh)
            o = L.sdpa(qt, kt, vt, scale=L.scaling, enable_gqa=gqa)                        # [1, q_local, 1, d]
            out[r, c] = o[0, :, 0]
        return out.view(b * s, nq * d)

    def _fp32(self, which: int, t: torch.Tensor) -> torch.Tensor:
        """``t`` (cache keys or values read for attention, ``[b, kv_local, L, d]``) cast into a view of fp32 buffer
        ``which`` (0 keys, 1 values; ``[max_batch, kv_local, max_len, d]``, allocated on first use, larger if a
        step needs more): a fresh fp32 tensor per layer would be a large allocation each time, which glibc may
        serve by mmap and page faults (measured: the casts then cost as much as the bf16 attention they
        replace)."""
        bufs = self._fp32_bufs
        b, n, L, _ = t.shape
        if bufs[which] is None or bufs[which].shape[0] < b or bufs[which].shape[2] < L:
            bufs[which] = torch.empty(max(self.max_batch, b), self.n_kv, max(self.max_len, L), self.head_dim,
                                      dtype=torch.float32, device=t.device)
        return bufs[which][:b, :n, :L].copy_(t)
