"""The lean path's step of one token per row, up to 32 rows, as one C program (:class:`RowStep`).

Small-batch decode of a small model is bound by the work around the matmuls (SmolLM2 at tp=2: 4127 framework ops
per token, docs/benchmarks.md). A :class:`RowStep` runs a step of at most
:data:`~tensorpar.decode.gemv_kernel.MAX_ROWS` rows of one token each on buffers allocated once, with every kernel's
arguments prepared once at construction:

* the four matmuls and the LM head: the general loop's kernel into the preallocated outputs: our GEMV on fp32
  weights (:func:`~tensorpar.decode.gemv_kernel.linear_into`), our Q8_0 x Q8_0 kernel on the int8 weights of
  ``--quantize int8`` (:func:`~tensorpar.decode.q8_kernel.linear_into`, the activations quantized into a scratch
  allocated once), our GEMV widening the bf16 weights of ``--quantize bf16`` to fp32;
* rotary on the q and k heads and the cache write of k and v: one kernel (:func:`~tensorpar.decode.fused.rope_store`),
  reading rows of tables of every position computed once at construction (bitwise the per-step call's; longrope
  computes them per step);
* each all-reduce fused with the residual add and the next RMSNorm (the layer's post-attention norm, the next
  layer's input norm, the final norm): the exchange (:func:`~tensorpar.decode.fused.all_reduce_exchange`) leaves
  the ranks' partial sums in shared memory and the next program's first op adds them in rank order and normalises
  (``OP_NORM``, the kernel of :func:`~tensorpar.decode.fused.all_reduce_add_rms_norm`);
* attention of the one query per row: one call that reads each query head's KV head where it lies in the cache
  (:func:`~tensorpar.decode.fused.decode_attention`: no head copies for uneven head splits, no views per layer);
  SiLU and the gate product: one call (:func:`~tensorpar.decode.fused.silu_mul`);
* the whole step runs from one Python call (:meth:`~tensorpar.decode.step_exchange.StepExchange.run` of one
  program, :func:`~tensorpar.decode.fused.program`): per layer add + input norm, QKV matmul, rotary and cache write,
  attention, output matmul, the all-reduce's exchange, add + post-attention norm, gate-up matmul, SiLU, down matmul,
  the exchange; on the shared-memory communicator the exchanges run in C too, elsewhere the program stops at each
  for Python's (120 calls per token for SmolLM2 before, 1.2 ms of Python at tp=2);
* the embedding: each rank copies the rows of the tokens it owns into the partial sums (zeros elsewhere) and
  their all-reduce is fused with the first layer's input norm (:meth:`RowStep._embed`).

It runs the layers of the plain Llama shape (:func:`why_not`) computing in fp32 on the GEMV path or on the int8 or
bf16 weights of ``--quantize``, over the static cache or the server's block tables; prompts whose tokens fit in its
rows run as one row per token (:mod:`~tensorpar.decode.step_rows`), longer prompts and bigger steps the general
loop. Results: residual stream, rotary, cache writes and matmul outputs bitwise the general loop's
given the same inputs; norms, attention and SiLU within fp32 rounding (sums in another order, ``expf``), so
logits agree to 1e-5 of the largest and greedy tokens equal transformers' (tests/decode/test_row_step.py); int8:
an activation within that rounding of a half step of its block may round to the other step.

bf16 models (``--dtype bfloat16``: ``max_batch`` <= 4, where the general loop runs our GEMV on the bf16 weights,
plain or blocked; or the int8 weights of ``--quantize int8``, whose kernel takes the input widened to fp32 and
whose output the general loop rounds to bf16 once, as here: bitwise): the same program on fp32 buffers that hold
bf16 values, every result rounded to bf16 (nearest even) where torch's bf16 ops round it: each matmul's fp32 sums
once (``OP_ROUND``, as the bf16 GEMM), the residual adds and the partial sums' adds, the normalised row and its
product with the weight, each rotary product and their sum, attention's weights (before they weight the values,
as torch's CPU flash attention) and output, SiLU and the gate product (``fused.OP_*_BF16``; over gloo the exchange
reduces a bf16 copy, :func:`~tensorpar.decode.fused.all_reduce_exchange`); the cache is the decoder's bf16 one,
the norm weights and biases fp32 copies (exact), the logits bf16. Against the general loop: the same rounding
points, sums in another order (the matmuls on plain weights, the norm's squares, attention), so within verify's
bf16 tolerance; greedy tokens equal transformers' bf16
model (tests/decode/test_bf16_act_blocked.py).
"""
from __future__ import annotations

import ctypes
import weakref

import torch
import torch.nn.functional as F

from tensorpar.decode import fused, gemv_kernel, step_rows
from tensorpar.decode.bf16_weights import Bf16Weight
from tensorpar.decode.gemv_kernel import BlockedWeight
from tensorpar.decode.packed import table_of
from tensorpar.decode.row_step_rules import (_embedding, _format, _norm, _reference_weight,  # noqa: F401 (tests)
                                             row_count, rows, why_not)
from tensorpar.decode.step_exchange import StepExchange
from tensorpar.decode.step_matmuls import _Matmuls


class RowStep:
    """The decode step of decoder ``dec`` (:func:`why_not` must be ``None``); called by
    :meth:`~tensorpar.decode.lean.LeanDecoder.forward_segments` (:meth:`run_split`) for ``b <= rows`` rows of one
    token each whose tokens are all stored (``write`` None): decode rows, and a step's prompts as one row per token
    (:mod:`~tensorpar.decode.step_rows`); ``rows`` = :func:`~tensorpar.decode.row_step_rules.rows` (32; a bf16
    model's bf16 weights of which some are plain 4); ``R`` given: that many instead, at most ``rows`` (the decoder
    passes the smallest over its ranks, :func:`~tensorpar.decode.row_step_rules.row_count`, so that every rank runs
    the same steps as rows and the same collectives).

    Memory: a few buffers of ``rows`` rows (hidden, QKV, gate-up widths), fp32; a program per row
    count run so far (:meth:`program`). Collectives: those of the
    general loop (the embedding's all-reduce, two per layer)."""

    def __init__(self, dec, R: int | None = None):
        # a weak reference: the decoder holds this step, and a cycle would keep a dropped decoder (its KV cache,
        # its references to the weights: a second copy once a new decoder packs them) alive until the next
        # garbage collection
        self.dec = weakref.proxy(dec)
        L0 = dec.layers[0]
        #: the model's compute dtype: fp32, or bf16 (``--dtype bfloat16``: the buffers stay fp32 and hold bf16 values,
        #: each op's result rounded as torch's bf16 ops round it: fused.OP_*_BF16, OP_ROUND after each matmul)
        self.dtype = dt = _reference_weight(dec).dtype
        self.bf16 = dt == torch.bfloat16
        self.f32: dict = {}             # id -> (a bf16 norm weight or bias, its fp32 copy), made once (exact)
        self.norm0 = _norm(L0.ln1, dt)
        H = self.norm0[0].numel()
        nq, nkv, d = dec.n_q, dec.n_kv, dec.head_dim
        fmt = _format(_reference_weight(dec))
        self.R = R = rows(dec, dt, fmt) if R is None else R     # decode rows, or a prompt's tokens as rows
        f = L0.f
        e = dict(dtype=torch.float32, device=_reference_weight(dec).device)
        # a pipeline stage before the last ends with x += the last exchange and no norm of its own: a unit-weight
        # RMSNorm into h, which nothing reads, does the add (OP_NORM)
        self.final_norm = _norm(dec.norm, dt) if dec.last else (torch.ones(H, **e), 1e-6)
        self.x, self.h, self.p = (torch.zeros(R, H, **e) for _ in range(3))      # residual, normed, partial sums
        self.qkv = torch.zeros(R, (nq + 2 * nkv) * d, **e)
        self.q = torch.zeros(R, nq, d, **e)
        self.gu = torch.zeros(R, 2 * f, **e)
        self.a = torch.zeros(R, f, **e)
        self.att = torch.zeros(R, nq * d, **e)                                   # attention's output
        self.scratch = torch.zeros(dec.max_len, **e)                             # one query's scores
        self.rd = dec.perm.numel()
        cache = dec.cache
        self.head_stride = cache.k[0].stride(0)
        self.threads = torch.get_num_threads()
        self.mm = _Matmuls(fmt, R, max(H, nq * d, f), self.threads)
        #: the blocks of a row's table (a row's positions over max_len / block_size blocks: paged, the server)
        self.nblk = nblk = -(-dec.max_len // cache.block_size)
        self.offs = [(ctypes.c_int64 * b)() for b in range(R + 1)]         # each row's K/V offset, per row count
        self.blocks = [(ctypes.c_int64 * (b * nblk))() for b in range(R + 1)]     # each row's block table
        keys = {k: j for j, k in enumerate(dec.rotary)}
        #: the step words of the programs (fused.STEP_*): attention's length and mask, each rotary table's rows
        self.step = (ctypes.c_int64 * (fused.STEP_TABLES + 2 * len(keys)))()
        self.keys = keys
        self.rows: dict = {}            # the program of each row count, built at its first step (program)
        self.H, self.fmt = H, fmt
        self.parts: dict = {}           # the ranks' partial sums' addresses (a tuple) -> their C array
        self.xp, self.pp = self.x.data_ptr(), self.p.data_ptr()
        self.tables = self._rotary_tables()
        self.rope_buf = {k: (torch.zeros(R, self.rd, **e), torch.zeros(R, self.rd, **e))
                         for k in (self.tables or {})}                        # the rows' tables, gathered
        self.embed = _embedding(dec.embed)

    def program(self, b: int) -> tuple:
        """``(address, StepExchange, x[:b], what keeps it alive)``: the one program of a step of ``b`` rows (11 ops
        per layer and the final norm), built at the first step of that many rows, so a decoder builds only the
        row counts it runs. No collectives."""
        got = self.rows.get(b)
        if got is not None:
            return got
        dec, H, hs, nblk = self.dec, self.H, self.head_stride, self.nblk
        nq, nkv, d, f = dec.n_q, dec.n_kv, dec.head_dim, dec.layers[0].f
        # --quantize, blocked fp32 / bf16: the layers hold the stored weights; else [in, out] views of [out, in] ones
        out_in = (lambda w: w if not isinstance(w, torch.Tensor) else w.t())
        mm, keys, cache = self.mm, self.keys, dec.cache
        qkv, q, att, gu, a = (t.data_ptr() for t in (self.qkv, self.q, self.att, self.gu, self.a))
        offs, blocks = ctypes.addressof(self.offs[b]), ctypes.addressof(self.blocks[b])
        bs = cache.block_size
        x_, h_ = self.x.data_ptr(), self.h.data_ptr()
        ex = StepExchange(self.p[:b], dec.tp, self.dtype)      # each all-reduce of p[:b], inside the program

        def norm(fn):       # x += the exchanged partial sums (step words); h = fn's RMSNorm of x
            w, eps = _norm(fn, self.dtype) if fn is not None else self.final_norm
            kind = fused.OP_NORM_BF16 if bf else fused.OP_NORM
            return (kind, x_, b, H, self._fp32(w).data_ptr(), fused.float_bits(eps), h_)

        def mm_op(x, w, y, bias=None):      # the matmul, then (bf16) its output rounded
            return [mm.op(x, out_in(w), y, self._fp32(bias))] + ([(fused.OP_ROUND, y.data_ptr(), y.numel())] if bf
                                                                   else [])
        bf = self.bf16
        rope, attn = (fused.OP_ROPE_BF16, fused.OP_ATTN_BF16) if bf else (fused.OP_ROPE, fused.OP_ATTN)
        ops, keep = [], [ex]
        for i, L in enumerate(dec.layers):
            kv_of = (L.kv_idx.tolist() if L.kv_idx is not None
                     else [h * nkv // nq for h in range(nq)])                # each query head's KV head
            kv_of = (ctypes.c_int64 * nq)(*kv_of)
            keep.append(kv_of)
            scale = fused.float_bits(float(L.scaling if L.scaling is not None else d ** -0.5))
            k, v = cache.k[i].data_ptr(), cache.v[i].data_ptr()
            ops += [norm(L.ln1),                                              # x += all_reduce; h = ln1(x)
                    *mm_op(self.h[:b], L.wqkv, self.qkv[:b], L.bqkv),                             # h -> qkv
                    (rope, qkv, b, nq, nkv, d, self.rd, keys[L.rope], q, k, v, hs, offs),
                    (attn, q, b, nq, d, k, v, hs, blocks, nblk, bs, ctypes.addressof(kv_of), scale,
                     self.scratch.data_ptr(), att),
                    *mm_op(self.att[:b], L.wo, self.p[:b]),                                       # -> p
                    ex.op(),                                                  # all-reduce of o W_o
                    norm(L.ln2),                                              # x += all_reduce; h = ln2(x)
                    *mm_op(self.h[:b], L.wgu, self.gu[:b], L.bgu),
                    (fused.OP_SILU_BF16 if bf else fused.OP_SILU, gu, b, f, a),                   # gu -> a
                    *mm_op(self.a[:b], L.wd, self.p[:b]),                                         # -> p
                    ex.op()]                                                  # all-reduce of a W_d
        ops.append(norm(dec.norm if dec.last else None))                    # x += all_reduce; h = norm(x)
        prog = fused.program(ops)
        self.rows[b] = got = (ctypes.addressof(prog), ex, self.x[:b], (prog, keep))
        return got

    def _rotary_tables(self) -> dict | None:
        """Per rotary key, ``(cos, sin_sign)`` ``[max_len, rd]`` of every position, computed once by the decoder's
        own call (:meth:`~tensorpar.decode.lean.LeanDecoder._rotary`: element-wise, so a position's row is bitwise
        a one-position step's, which a probe of four positions checks); ``None`` (a step computes its tables) for
        longrope, whose factors depend on the row's length, or where the probe differs."""
        dec = self.dec
        if dec.rope_switch is not None:
            return None
        n = dec.max_len
        x = torch.zeros(1, 1, 1, dtype=self.dtype, device=_reference_weight(dec).device)    # bf16: bf16 tables
        pos = torch.arange(n, device=x.device)
        out = {}
        for key, rotary in dec.rotary.items():
            cos, sin = dec._rotary(rotary, x, pos, None)                                # [n, 1, rd]
            cos, sin = cos.reshape(n, -1).contiguous(), sin.reshape(n, -1).contiguous()
            for p in sorted({0, 1, n // 2, n - 1} & set(range(n))):
                c1, s1 = dec._rotary(rotary, x, pos[p:p + 1], None)
                if not (torch.equal(c1.reshape(-1), cos[p]) and torch.equal(s1.reshape(-1), sin[p])):
                    return None
            out[key] = (cos.float(), sin.float())                                       # (exact)
        return out

    def _fp32(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """``t`` (a norm weight, a bias) as the fp32 the step's kernels read: itself, or (bf16) an fp32 copy made
        once and kept (exact)."""
        if t is None or t.dtype == torch.float32:
            return t
        got = self.f32.get(id(t))
        if got is None:
            got = self.f32[id(t)] = (t, t.float().contiguous())     # t kept: its id is not reused
        return got[1]

    def runs(self, segments) -> bool:
        """Whether this step is one :class:`RowStep` runs: one segment of at most ``rows`` rows of one token each,
        all stored, within ``max_len`` positions (a start segment's rows in one block each; with block tables, as
        the server's paged cache, over the table's blocks), and with sliding-window layers (Mistral) no more
        positions than the smallest window holds, where the window masks nothing
        (:func:`~tensorpar.decode.block.windowed`); longer steps take the general loop."""
        if len(segments) != 1:
            return False
        g = segments[0]
        windows = self.dec.windows        # sliding windows: only while every key is inside each (block.windowed)
        bs = self.dec.cache.block_size
        room = bs if g.blocks is None else bs * min(self.nblk, g.blocks.shape[1])
        return (g.s == 1 and g.b <= self.R and g.write is None and g.length <= min(room, self.dec.max_len)
                and (not windows or g.length <= windows[0]))

    def run_split(self, ids: torch.Tensor, rope_pos: torch.Tensor, segments, rest):
        """``forward_segments(ids, rope_pos, segments)``'s logits where the row step runs part of the step, else
        ``None``: a single segment it :meth:`runs` as it is; otherwise the segments as rows of one token, as many as
        fit, and the others through ``rest`` (:func:`~tensorpar.decode.step_rows.run_split`)."""
        if self.runs(segments):
            return self(ids, rope_pos, segments[0])
        return step_rows.run_split(self, ids, rope_pos, segments, rest)

    def _cache_plan(self, g):
        """``(row offsets, row blocks)`` as C arrays (allocated once per row count, filled here): the element offset
        in a layer's pool where each row's new K/V go, and each row's block table (``nblk`` apart; a start segment's
        one block per row), what attention reads. Raises ValueError for a row its block table or the cache does not
        cover."""
        cache, d = self.dec.cache, self.dec.head_dim
        bs, b, length = cache.block_size, g.b, g.length
        if g.blocks is None:
            if g.start + 1 > bs or length > bs or b > cache.num_blocks:
                raise ValueError(f"a start segment needs one block per row of at least {max(g.start + 1, length)} "
                                 f"positions; blocks hold {bs}")
            blocks, pos = range(b), [g.start] * b
        else:
            if g.blocks.shape[1] * bs < length:
                raise ValueError(f"block tables of {g.blocks.shape[1]} blocks of {bs} do not cover {length} positions")
            blocks, pos = [t[:self.nblk] for t in g.blocks.tolist()], [p for (p,) in g.cache_pos.tolist()]
        offs, table, n = self.offs[b], self.blocks[b], self.nblk
        for r, (blk, p) in enumerate(zip(blocks, pos)):
            if g.blocks is None:
                table[r * n], at = blk, blk
            else:
                table[r * n:r * n + len(blk)] = blk
                at = blk[p // bs]
            offs[r] = (at * bs + p % bs) * d
        return offs, table

    def _embed(self, ids: torch.Tensor, b: int):
        """``x[:b]`` = the embedding of ``ids`` ``[b]`` summed over the ranks, as the first program's ``OP_NORM`` adds
        it: returns ``(parts address, count, what to keep alive)`` for the step words. At tp > 1 the rows this rank
        owns are copied into the partial sums ``p`` (zeros elsewhere, as the module's mask), ``x`` is zeroed and
        their all-reduce's exchange runs (:func:`~tensorpar.decode.fused.all_reduce_exchange`): ``0 + (p0 + p1 + ...)``
        is bitwise the module's all-reduced sum (one rank's row plus zeros: a sum never -0). At tp = 1, or where the
        module must run (see :func:`_embedding`), ``x`` holds the embedding and nothing is added. Collectives: one
        all-reduce of ``[b, H]``, the module's."""
        emb, tp = self.embed, self.dec.tp
        if not self.dec.first:                  # a later pipeline stage: ids is the residual stream sent, [b, h]
            self.x[:b].copy_(ids.view(b, -1))
            return 0, 0, None
        row = self.x.shape[1] * 4
        toks = ids.tolist()
        raw = emb is not None and not (emb._forward_hooks or emb._forward_pre_hooks)
        table = table_of(emb) if raw else None

        def copy(dst: torch.Tensor, addr: int, t: int) -> None:     # row t of the table into dst (at addr)
            if isinstance(table, BlockedWeight):
                dst.copy_(table.p[t // gemv_kernel.BLOCK, :, t % gemv_kernel.BLOCK])
            else:
                ctypes.memmove(addr, table.data_ptr() + t * row, row)
        if raw and tp.size == 1 and all(0 <= t < table.shape[0] for t in toks):
            for r, t in enumerate(toks):
                copy(self.x[r], self.xp + r * row, t)
            return 0, 0, None
        if not raw or tp.size == 1:             # the module (it raises its own error for a bad id)
            self.x[:b].copy_(self.dec.embed(ids.view(1, b)).view(b, -1))                 # [1, b, h], all-reduced
            return 0, 0, None
        lo, hi = emb.vocab_start, emb.vocab_stop
        for r, t in enumerate(toks):
            if lo <= t < hi:
                copy(self.p[r], self.pp + r * row, t - lo)
            else:
                ctypes.memset(self.pp + r * row, 0, row)
        ctypes.memset(self.xp, 0, b * row)
        return fused.all_reduce_exchange(self.p[:b], tp, self.parts)

    def _rope(self, e: torch.Tensor, rope_pos: torch.Tensor, b: int) -> tuple[dict, list]:
        """Per rotary key the addresses ``(cos, sin_sign)`` of ``[b, rd]`` rows for the rows' rotary positions
        ``rope_pos`` ``[b]``: rows of the tables computed once (one row: in place; more: gathered into a buffer),
        else computed for this step (longrope: each row the factors of its own length); and the tensors to keep
        alive while the step runs."""
        dec = self.dec
        if self.tables is not None:
            pos = rope_pos.tolist()
            if 0 <= min(pos) and max(pos) < dec.max_len:
                if b == 1:
                    o = pos[0] * self.rd * 4
                    return {k: (c.data_ptr() + o, s.data_ptr() + o) for k, (c, s) in self.tables.items()}, []
                out = {}
                for k, (c, s) in self.tables.items():
                    cb, sb = self.rope_buf[k]
                    torch.index_select(c, 0, rope_pos, out=cb[:b])
                    torch.index_select(s, 0, rope_pos, out=sb[:b])
                    out[k] = (cb.data_ptr(), sb.data_ptr())
                return out, []
        last = rope_pos if dec.rope_switch is not None else None   # longrope: a decode row's length is its position
        out, keep = {}, []
        e = e if not self.bf16 else e[..., :1].to(self.dtype)      # the tables' dtype: the model's (bf16: rounded)
        for key, rotary in dec.rotary.items():
            cos, sin = dec._rotary(rotary, e, rope_pos, last)                           # [b, 1, rd] each
            cos, sin = cos.float().contiguous(), sin.float().contiguous()
            keep += [cos, sin]
            out[key] = (cos.data_ptr(), sin.data_ptr())
        return out, keep

    def __call__(self, ids: torch.Tensor, rope_pos: torch.Tensor, g, pick: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[b, V_r]`` of segment ``g``'s ``b`` rows (``ids``, ``rope_pos`` ``[b]``), their K/V written to
        the cache; what ``forward_segments(ids, rope_pos, [g])`` returns. On a pipeline stage after the first,
        ``ids`` is the residual stream ``[b, h]`` the stage before returned; a stage before the last returns its
        own ``[b, h]`` (after its last layer's all-reduce) instead of logits. ``pick`` ``[k]``: the LM head on
        those rows only (a prompt's last token), logits ``[k, V_r]``."""
        dec = self.dec
        b = g.b
        prog, ex, x, _ = self.program(b)
        step = self.step                                          # what the programs read at this step
        P, N = fused.STEP_PARTS, fused.STEP_NPARTS
        step[P], step[N], keep_parts = self._embed(ids, b)        # x = embedding (or 0 + its exchanged parts)
        tables, keep = self._rope(x.view(1, b, -1), rope_pos, b)
        self._cache_plan(g)                                       # each row's K/V offsets (the programs' arrays)
        mask = g.mask
        if mask is not None and mask.stride(-1) != 1:
            mask = mask.contiguous()
        step[fused.STEP_LENGTH] = g.length
        step[fused.STEP_MASK], step[fused.STEP_MASK_STRIDE] = ((0, 0) if mask is None
                                                               else (mask.data_ptr(), mask.stride(0)))  # [b,1,1,L]
        for key, j in self.keys.items():
            step[fused.STEP_TABLES + 2 * j], step[fused.STEP_TABLES + 2 * j + 1] = tables[key]
        # per layer: x += parts; h = ln1(x) -> qkv -> rotary, cache -> attention -> p; all-reduce of o W_o;
        # x += parts; h = ln2(x) -> gate-up -> SiLU -> down -> p; all-reduce of a W_d. Then x += parts; h = norm(x)
        ex.run(prog, step)
        del keep, keep_parts, mask                                # alive until the programs ran
        if not dec.last:            # a pipeline stage before the last: the residual stream goes on, [b, h]
            return x.to(self.dtype, copy=True)
        h = self.h[:b] if pick is None else self.h[:b].index_select(0, pick)    # the LM head on the rows asked
        logits = torch.empty(h.shape[0], dec.lm_w.shape[0], dtype=torch.float32, device=x.device)
        self.mm.run_into(h, dec.lm_w, logits)
        return logits if not self.bf16 else logits.to(self.dtype)      # bf16: the fp32 sums rounded once
