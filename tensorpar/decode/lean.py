"""The lean decode path: the per-token forward of a sharded Llama-family decoder without the framework around it.

Small-batch decode is memory-bound: a step should cost about the time to read the rank's weights once (Pope et
al. 2022, "Efficiently Scaling Transformer Inference", sec. 3.1). The Hugging Face forward adds, per step and per
layer, a cache object, mask construction, output dataclasses and three separate q/k/v (and two gate/up) matmuls;
at 135M parameters that Python and allocation work is as large as the matmuls. :class:`LeanDecoder` runs the same
math directly on the rank's tensors:

* one fused QKV matmul and one fused gate-up matmul per layer (:func:`fuse_projections`: the rank's q/k/v rows,
  and its gate/up rows, concatenated once; the original parameters become views of the fused tensor, so no
  second copy is kept and parameter names / ``state_dict`` keys are unchanged);
* a KV cache allocated once, a pool of blocks ``[num_layers, kv_local, num_blocks, block_size, d]`` holding only
  this rank's KV heads (:class:`~tensorpar.decode.kv_cache.LeanKVCache`; the static cache is one block of
  ``max_len`` per row); a step writes its new K/V in place and attends to each row's blocks through its block
  table (views where the blocks are consecutive, else gathered);
* the rotary tables computed once per step for all layers; the decode mask is a view of a preallocated
  ``[max_batch, max_len]`` key-validity buffer (``None`` when no row is padded);
* as few framework calls per layer as the math allows (the per-token cost every rank pays, which caps the
  tensor-parallel speed-up): RMSNorm in five calls, the matmuls as ``torch.mm`` on ``[in, out]``
  views of the weights (``F.linear``'s own kernel call), the residual adds and the SiLU in place;
* bf16 on a CPU (oneDNN with bf16 kernels): the matmuls run on weights reordered once into oneDNN's blocked
  layout (:func:`pack`), which *replaces* the plain weights (:func:`tensorpar.decode.packed.pack_weights`: no
  second copy; the modules convert back on access); ``F.linear`` calls the same oneDNN matmul but reorders the
  weight on every call, which made bf16 GEMV 1.5x slower than it needs to be (same bits);
* fp32 and bf16 on a CPU with AVX-512 BF16 or AVX2 + FMA: our GEMV (:mod:`tensorpar.decode.gemv_kernel`) at steps of
  up to 32 rows (fp32) or 4 (bf16), weights in its blocked layout where the model allows (fp32 at any ``max_batch``;
  bf16 of >= 1024 inputs; else ``torch.mm`` / ``F.linear``), within 1e-5 of ``F.linear`` (bf16: one rounding);
* decode steps (one token per row; more than 32 rows in chunks of 32) of layers of the plain Llama shape in fp32
  (fp32, int8 or bf16 weights) or bf16 run as a :class:`~tensorpar.decode.row_step.RowStep`: a few C++ calls a layer;
* a model quantized by :func:`tensorpar.decode.quantize.quantize_int8` (its fp weights freed) runs every matmul as
  :func:`tensorpar.decode.int8.int8_linear` (Q8_0 x Q8_0: the input quantized per block of 32, int8 x int8; the
  row step: the same kernel into its buffers) on the int8 ``[out, in]`` weights; one stored in bf16 by ``--quantize
  bf16`` (:func:`~tensorpar.decode.quantize.store_bf16`) :func:`~tensorpar.decode.bf16_weights.bf16_linear`, in fp32;
* collectives: one all-reduce for the embedding (vocabulary-parallel), two per layer (after the row-parallel
  projections), the module path's, through :func:`tensorpar.comm.all_reduce` (shared memory when it is on); with
  ``--tp-comm int8`` the per-layer ones through :func:`tensorpar.comm.reduce_partial`, as the module path's.

The math is the module path's, rounding for rounding except inside a matmul: RMSNorm by fewer calls only where
a probe at construction shows it bitwise equal to the family's module (else the module runs), the rotary
embedding module and the families' ``apply_rotary_pos_emb`` formula ``q*cos + rotate_half(q)*sin`` (applied to
the q and k heads in one go, ``rotate_half(q)*sin`` computed exactly as ``q[..., perm] * (sign*sin)``),
``scaled_dot_product_attention`` with the layer's scaling; only the order of operations inside a matmul may
differ, so greedy tokens equal transformers' (tests/decode/test_lean.py, tests/decode/test_generate.py, tests/decode/test_smollm2.py).

Families: every family whose record sets ``fast_decode`` (:func:`tensorpar.hf.families.why_not`): the per-layer
features (norm placements, q/k norms, soft-capping, sliding windows, partial and per-layer-type rotary, fused
checkpoint projections, plain MLPs, GPT-NeoX's per-head q/k/v rows and parallel residual, mixture-of-experts
blocks called as they are) are read from the sharded modules
by :func:`~tensorpar.decode.block.build_layer` (docs/decode.md). Others, and sequence-parallel models, run the
module path (:func:`lean_unsupported` says why).
"""
from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from tensorpar import comm
from tensorpar.comm import Group
from tensorpar.comm.compress import BLOCK as COMPRESS_BLOCK
from tensorpar.decode import gemv_kernel, row_step
from tensorpar.decode.bf16_weights import Bf16Weight, bf16_linear
from tensorpar.decode.block import Layer, build_layer, norm_fn, ordered_all_reduce, rotate, windowed
from tensorpar.decode.deterministic import DETERMINISTIC_TILE, deterministic_unsupported
from tensorpar.decode.int8 import int8_linear, int8_weights, lean_weight
from tensorpar.decode.kernels import can_pack, mm
from tensorpar.decode.kv_cache import LeanKVCache, Segment, offsets, token_positions
from tensorpar.decode.matmuls import blocks_every_matmul, use_blocked, use_gemv, use_packed
from tensorpar.decode.packed import unpack_weights
from tensorpar.decode.prepare import decoder_parts, fuse_projections, lean_unsupported
from tensorpar.decode.rope import rope_switch_length, row_rotary

__all__ = ["LeanDecoder", "Segment", "DETERMINISTIC_TILE", "deterministic_unsupported"]

class LeanDecoder:
    """Static-cache forward of a sharded Llama-family causal LM for prefill and decode (see the module docstring).

    Args:
        model: the sharded ``*ForCausalLM`` (:func:`lean_unsupported` must return ``None``).
        tp: its tensor-parallel group.
        max_batch: rows a step runs at most (and the blocks of the static cache).
        max_len: positions per row (prompt + new tokens).
        block_size, num_blocks: the pool's blocks (:class:`~tensorpar.decode.kv_cache.LeanKVCache`); default one
            block of ``max_len`` positions per row, ``max_batch`` of them (the static cache ``prefill`` and
            ``decode`` use).
        prepack: run the matmuls on weights reordered once into oneDNN's layout (bf16: bitwise ``F.linear``,
            which reorders a bf16 CPU weight per call; fp32: a few units in the last place from ``torch.mm``:
            :func:`~tensorpar.decode.matmuls.use_packed`). ``None``: our GEMV (:func:`~tensorpar.decode.matmuls.
            use_gemv`) where it runs and ``max_batch`` <= :func:`~tensorpar.decode.gemv_kernel.max_rows` (32 fp32,
            4 bf16), else prepacked (fp32, bf16 if oneDNN runs it). ``False``: plain ``torch.mm`` / ``F.linear``.
        block: with our GEMV on fp32 weights, hold them in its blocked layout in place of the plain ones
            (:func:`~tensorpar.decode.matmuls.use_blocked`); ``False``: the plain weights, the model left as it is.

    Memory: ``2 * num_layers * num_blocks * kv_local * block_size * head_dim`` elements of the weights' dtype,
    allocated here once. Packed or blocked weights replace the plain ones on the modules (one copy per rank:
    :func:`tensorpar.decode.packed.pack_weights`); a decoder built on a packed model unpacks it first, so the
    weights it reads are the current ones. Collectives at construction (tp > 1): two all-reduces on ``tp.pg`` (``comm.all_gather_json``: all
    ranks agree whether the row step runs). Raises ValueError if the model cannot run this path."""

    def __init__(self, model, tp: Group, *, max_batch: int, max_len: int, prepack: bool | None = None,
                 block_size: int | None = None, num_blocks: int | None = None, deterministic: bool = False,
                 block: bool = True):
        why = lean_unsupported(model)
        if why is not None:
            raise ValueError(f"the lean decode path cannot run this model: {why}")
        if deterministic and getattr(model, "tensorpar_stage", None) is not None:
            raise ValueError("deterministic (batch-invariant) decoding runs the whole model on each rank (pp=1)")
        q8 = int8_weights(model)        # tensorpar.decode.quantize.quantize_int8 ran: its fp weights were freed
        embed, layers, norm, rotary = decoder_parts(model)
        if q8 is not None and q8["dtype"] != norm.weight.dtype:
            raise ValueError(f"the model was quantized in {q8['dtype']} and is now {norm.weight.dtype}; "
                             f"quantize after the .to(dtype)")
        int8 = q8 is not None
        unpack_weights(model)           # a previous decoder packed it: plain weights again (this one may repack)
        fuse_projections(model)
        self.model, self.tp = model, tp
        # a pipeline stage (model.tensorpar_stage, tensorpar.pipeline.inference): its layers; the embedding on the
        # first stage only, the final norm and LM head on the last only
        stage = getattr(model, "tensorpar_stage", None)
        self.first, self.last = stage is None or stage.first, stage is None or stage.last
        idx = list(range(len(layers))) if stage is None else list(stage.layers)
        self.hf_layers = [layers[i] for i in idx]
        self.embed = embed if self.first else None
        self.rope_switch = rope_switch_length(rotary)
        self.norm = norm_fn(norm) if self.last else None
        self.lm_w, self.lm_b = ((lean_weight(model.lm_head), getattr(model.lm_head, "bias", None)) if self.last
                                else (None, None))
        #: Gemma 2/3's final logit soft-capping (element-wise, so exact on the vocab-sharded logits)
        self.final_cap = getattr(model.config, "final_logit_softcapping", None)
        self.max_batch, self.max_len = max_batch, max_len
        l0 = self.hf_layers[0]
        a0 = getattr(l0, "self_attn", None) or l0.attention
        w0 = self.lm_w if self.last else lean_weight(getattr(a0, "dense" if a0 is not getattr(l0, "self_attn", None)
                                                             else a0.o_name))
        dev = w0.device
        # the rotary tables: one, or one per layer type where the module takes it (Gemma 3's local and global)
        types = getattr(model.config, "layer_types", None)
        per_type = types is not None and "layer_type" in inspect.signature(rotary.forward).parameters
        self.rotary = ({t: functools.partial(rotary, layer_type=t) for t in set(types)} if per_type
                       else {None: rotary})
        self.layers: list[Layer] = [build_layer(layer, tp, int8=int8, probe_w=w0, ordered=deterministic,
                                                rope=types[i] if per_type else None)
                                    for i, layer in zip(idx, self.hf_layers)]
        n_q, n_kv, d = a0.layout.local_heads(tp.rank), a0.layout.local_kv_heads(tp.rank), a0.head_dim
        self.n_q, self.n_kv, self.head_dim = n_q, n_kv, d
        self.windows = sorted({L.window for L in self.layers if L.window is not None})
        self.cache = LeanKVCache(len(self.layers), num_blocks or max_batch, n_kv, block_size or max_len, d,
                                 max_batch=max_batch, max_len=max_len, dtype=w0.dtype, device=dev)
        # rotate_half(x) * sin == x[..., perm] * sin_sign (the halves swapped, the sign moved onto sin: exact), over
        # the rotary features of a head (rd: all d, or the first rd with partial rotary)
        rd = next(iter(self.rotary.values()))(torch.zeros(1, dtype=w0.dtype, device=dev),
                                             torch.zeros(1, 1, dtype=torch.long, device=dev))[0].shape[-1]
        half = rd // 2
        self.perm = torch.cat([torch.arange(half, rd), torch.arange(0, half)]).to(dev)
        self.sign = torch.cat([-torch.ones(half), torch.ones(rd - half)]).to(dev, w0.dtype)
        # the matmuls: self.lin for the layers, self.linear for the LM head; int8: the stored weights, int8 or bf16
        q = bf16_linear if isinstance(w0, Bf16Weight) else int8_linear
        self.lin, self.linear = (q, q) if int8 else (mm, F.linear)
        #: our GEMV (:func:`use_gemv`) up to gemv_kernel.max_rows rows; above them only on blocked weights (any rows)
        few = max_batch <= gemv_kernel.max_rows(w0.dtype)
        fits = few or (block and blocks_every_matmul(self, w0.dtype))
        self.gemv = not int8 and prepack is None and fits and use_gemv(self)
        self.blocked = block and self.gemv and use_blocked(self, model, not few)
        if self.gemv and not (few or self.blocked):     # oneDNN's prepacked weights instead (a tied head: F.linear)
            self.gemv, self.lin, self.linear = False, mm, F.linear
        self.packed = (not int8 and not self.gemv and (prepack if prepack is not None else can_pack(w0))
                       and w0.device.type == "cpu" and torch.backends.mkldnn.is_available())
        if self.packed:
            use_packed(self, model)
        #: key validity per row and position (False: left padding); decode masks are views of it
        self.valid = torch.ones(max_batch, max_len, dtype=torch.bool, device=dev)
        self.padded = False
        #: batch-invariant mode (``deterministic``): token-wise work in tiles of this many tokens, attention per
        #: token (:meth:`forward_segments`); ``None``: off
        self.tile = DETERMINISTIC_TILE if deterministic else None
        if deterministic:
            moe = next((i for i, L in zip(idx, self.layers) if L.moe is not None), None)
            if moe is not None:
                raise ValueError(f"deterministic (batch-invariant) decoding cannot run layer {moe}'s "
                                 f"mixture-of-experts block: it routes the step's tokens together")
            h = model.config.hidden_size
            if tp.compression == "int8" and h % COMPRESS_BLOCK:
                raise ValueError(f"deterministic (batch-invariant) decoding with --tp-comm int8 needs a hidden "
                                 f"size that is a multiple of {COMPRESS_BLOCK}, got {h}; use --tp-comm fp32")
        mine = ((ok := row_step.why_not(self) is None), row_step.row_count(self) if ok else 0)    # the row step,
        got = [mine] if tp.size == 1 else comm.all_gather_json(mine, tp.pg)    # where every rank runs it: one R
        self.row_step = row_step.RowStep(self, min(r for _, r in got)) if all(o for o, _ in got) else None

    def nbytes(self) -> int:
        """Bytes held by the KV cache."""
        return self.cache.nbytes()

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, rope_pos: torch.Tensor, mask: torch.Tensor | None, *, length: int,
                start: int | None = None, blocks: torch.Tensor | None = None, cache_pos: torch.Tensor | None = None,
                last_only: bool = True) -> torch.Tensor:
        """Run ``ids`` ``[b, s]`` through the model, writing their K/V into the cache; return vocab-sharded logits.

        Where the K/V go: either ``start`` (rows ``0..b-1`` in blocks ``0..b-1``, positions ``start .. start+s-1``)
        or ``blocks`` ``[b, nb]`` (block tables) with ``cache_pos`` ``[b, s]`` (each row's positions). Attention reads
        entries
        ``[0, length)``; ``mask`` is ``[b, 1, s, length]`` bool (True = attend) or ``None`` for all of them.
        ``rope_pos`` ``[b, s]``: the rotary positions. Returns ``[b, V_r]`` (the last position; ``[b, s, V_r]``
        with ``last_only=False``). Collectives: ``1 + 2 * num_layers`` all-reduces of ``[b, s, h]``.
        """
        b, s = ids.shape
        seg = Segment(b, s, mask, length, start=start, blocks=blocks, cache_pos=cache_pos)
        return self.forward_segments(ids.reshape(b * s), rope_pos.reshape(b * s), [seg], last_only=last_only)

    @torch.no_grad()
    def forward_segments(self, ids: torch.Tensor, rope_pos: torch.Tensor, segments: list[Segment], *,
                         last_only: bool = True) -> torch.Tensor:
        """One forward of several batches of rows (*segments*, e.g. a serving step's decode rows and its new
        prompts): the matmuls, norms and all-reduces run once over all their tokens, attention per segment.

        ``ids``, ``rope_pos`` ``[T]``: the segments' tokens and rotary positions one after the other, each
        segment's ``[b, s]`` flattened row by row (``T = sum(b * s)``). On a pipeline stage after the first
        (``model.tensorpar_stage``, :mod:`tensorpar.pipeline.inference`) ``ids`` is the residual stream ``[T, h]``
        the stage before returned; a stage before the last returns its residual stream ``[T, h]`` (after its
        layers, before the final norm) instead of logits. A segment's cache writes and reads are those
        of :meth:`forward` with its fields. Returns the logits of each row's last position, ``[sum(b), V_r]`` in
        segment order (``last_only=False``, one segment: ``[b, s, V_r]``). Why one forward: a step's prefill
        rows as a forward of their own cost a second pass over every weight and the framework's per-layer calls
        again (one new prompt next to 31 decode rows of SmolLM2 at tp=2, fp32: +41.6 ms on an 85 ms step as its
        own forward, +15.2 ms in the same forward; bench/results/serve_step.md); the row step's rows (decode rows,
        prompts one row per token) go apart (:meth:`~tensorpar.decode.row_step.RowStep.run_split`). Collectives:
        ``1 + 2 * num_layers`` all-reduces of ``[T, h]`` per part. Raises ValueError when the tokens do not add to T.

        Deterministic mode (``deterministic=True``, :attr:`tile` set): a token's logits and the K/V it writes do not
        depend on the other tokens of the step (batch invariance). The token-wise work (norms, projections,
        rotary, activation, residual adds, the all-reduces, the LM head) runs tile by tile on
        ``[DETERMINISTIC_TILE, ...]`` tensors, the last tile padded with zero rows, so every kernel sees the same
        shapes whatever ``T`` (a matmul's blocking and reduction order depend on its row count; a row's result
        does not depend on its place in a tile of fixed size, checked in tests/decode/test_deterministic.py);
        attention runs per token over its row's positions ``[0, p]`` (:meth:`LeanKVCache.attention`), and the
        all-reduces add in rank order (:func:`ordered_all_reduce`). Collectives: ``1 + 2 * num_layers *
        ceil(T / DETERMINISTIC_TILE)`` all-reduces of ``[DETERMINISTIC_TILE, h]`` (the first of ``[T, h]``).
        """
        tp = self.tp
        T = ids.shape[0]
        if sum(g.b * g.s for g in segments) != T or rope_pos.shape[0] != T:
            raise ValueError(f"segments of {[(g.b, g.s) for g in segments]} rows x tokens do not add up to the "
                             f"{T} ids / {rope_pos.shape[0]} positions given")
        out = (self.row_step.run_split(ids, rope_pos, segments, self.forward_segments)
               if self.row_step is not None and last_only else None)
        if out is not None:
            return out
        R = self.tile
        if R is not None and not last_only:
            raise ValueError("the deterministic mode returns the last position's logits only (last_only=True)")
        if self.first:
            x = self.embed(ids.view(1, T))                                             # [1, T, h], all-reduced
        else:           # a later pipeline stage: the residual stream the stage before sent, [T, h]
            x = ids.view(1, T, ids.shape[-1])
        h = x.shape[-1]
        last = None
        if self.rope_switch is not None:  # longrope: each row the factors of its own length (tensorpar/decode/rope.py)
            last = torch.cat([rope_pos[o:o + g.b * g.s].view(g.b, g.s)[:, -1:].expand(g.b, g.s).reshape(-1)
                              for g, o in zip(segments, offsets(segments))])
        # deterministic: the residual stream padded with zero rows to whole tiles, Tp tokens ([Tp, h] everywhere)
        Tp = T if R is None else -(-T // R) * R
        tiles = [(0, T)] if R is None else [(a, a + R) for a in range(0, Tp, R)]
        if Tp > T:
            pad = Tp - T
            x = torch.cat([x, x.new_zeros(1, pad, h)], 1)
            rope_pos = torch.cat([rope_pos, rope_pos.new_zeros(pad)])
            last = None if last is None else torch.cat([last, last.new_zeros(pad)])
        tables = {key: [self._rotary(rotary, x[:, a:b], rope_pos[a:b], None if last is None else last[a:b])
                        for a, b in tiles] for key, rotary in self.rotary.items()}
        cache = self.cache
        if R is not None:
            all_reduce = ordered_all_reduce if tp.compression != "int8" else comm.reduce_partial
        else:
            all_reduce = comm.reduce_partial if tp.compression == "int8" else comm.all_reduce   # --tp-comm
        views = [cache.views(g) for g in segments]
        # sliding-window layers read the segments with their masks narrowed to the window (block.windowed)
        segs = {None: segments} | {w: windowed(segments, w, x.device) for w in self.windows}
        per_token = None if R is None else [token_positions(g) for g in segments]
        x = x.reshape(Tp, h).clone()                                                   # the residual stream, in place
        for i, L in enumerate(self.layers):
            parts = [self._attn_in(L, x[a:b], *tables[L.rope][j]) for j, (a, b) in enumerate(tiles)]
            qk = parts[0][0] if len(parts) == 1 else torch.cat([p[0] for p in parts])   # [Tp, q_local + kv_local, d]
            v = parts[0][1] if len(parts) == 1 else torch.cat([p[1] for p in parts])    # [Tp, kv_local, d]
            o = cache.attention(i, L, qk[:T], v[:T], segs[L.window], views, self.n_q,
                                per_token=per_token)                                   # [T, q_local * d]
            if Tp > T:
                o = torch.cat([o, o.new_zeros(Tp - T, o.shape[1])])
            for a, b in tiles:
                self._attn_out(L, x[a:b], o[a:b], all_reduce)
        if not self.last:           # a pipeline stage before the last: the residual stream goes on, [T, h]
            return x
        if len(segments) == 1 and R is None:
            g = segments[0]
            x = x.view(g.b, g.s, h)
            if last_only:
                x = x[:, -1:]
            logits = self._head(x)
            return logits[:, -1] if last_only else logits
        if not last_only:
            raise ValueError("last_only=False takes one segment")
        rows, t0 = [], 0
        for g in segments:          # the last position of each row
            rows.extend(range(t0 + g.s - 1, t0 + g.b * g.s, g.s))
            t0 += g.b * g.s
        x = x.index_select(0, torch.tensor(rows, device=x.device)).unsqueeze(1)           # [sum(b), 1, h]
        if R is None:
            return self._head(x)[:, -1]
        n = x.shape[0]
        if n % R:
            x = torch.cat([x, x.new_zeros(R - n % R, 1, h)])
        return torch.cat([self._head(x[a:a + R]) for a in range(0, x.shape[0], R)])[:n, -1]

    def _rotary(self, rotary, x: torch.Tensor, pos: torch.Tensor, last: torch.Tensor | None):
        """The rotary tables ``(cos, sin_sign)`` ``[n, 1, rd]`` of ``n`` tokens at rotary positions ``pos`` ``[n]``
        (``x`` ``[1, n, h]`` gives the dtype and device; ``last``: longrope's per-token row lengths)."""
        n = pos.shape[0]
        if last is None:
            cos, sin = rotary(x, pos.view(1, n))                                           # [1, n, rd]
        else:
            cos, sin = row_rotary(rotary, x, pos.view(1, n), last.view(1, n), self.rope_switch)
        return cos.view(n, 1, -1), (sin * self.sign).view(n, 1, -1)

    def _attn_in(self, L: Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Token-wise first half of layer ``L``: ``x`` ``[n, h]`` -> rotated q and k heads ``[n, q_local + kv_local,
        d]`` and the values ``[n, kv_local, d]``. Collectives: OLMo 2's q/k norm all-reduce."""
        n, nq, nkv, d = x.shape[0], self.n_q, self.n_kv, self.head_dim
        qkv = self.lin(x if L.ln1 is None else L.ln1(x), L.wqkv, L.bqkv).view(n, nq + 2 * nkv, d)   # [n, heads, d]
        if L.interleaved:           # [n, (head, q/k/v), d] -> [n, (q/k/v, head), d]
            qkv = qkv.view(n, nq, 3, d).transpose(1, 2).reshape(n, 3 * nq, d)
        if L.qk_norm is None:
            qk = qkv[:, :nq + nkv]
        else:
            qk = torch.cat(L.qk_norm(qkv[:, :nq], qkv[:, nq:nq + nkv]), 1)
        # rotary on the q and k heads together: q*cos + rotate_half(q)*sin, the family's formula
        return rotate(qk, cos, sin, self.perm), qkv[:, nq + nkv:]

    def _attn_out(self, L: Layer, x: torch.Tensor, o: torch.Tensor, all_reduce) -> None:
        """Token-wise second half of layer ``L``, in place on the residual stream ``x`` ``[n, h]`` (a view is
        written through): the output projection of attention's ``o`` ``[n, q_local * d]``, the MLP (or the
        mixture-of-experts block), the residual adds. Collectives: two all-reduces of ``[n, h]``
        (``all_reduce``), or the expert block's own."""
        tp, lin, n, h = self.tp, self.lin, x.shape[0], x.shape[1]
        o = all_reduce(lin(o, L.wo, None), tp)
        if L.bo is not None:
            o = o + L.bo
        if L.post_attn is not None:
            o = L.post_attn(o)
        if L.parallel:              # GPT-NeoX: the MLP reads the layer's input, x + attn + mlp
            h2, x_attn = L.ln2(x), o
        else:
            x.add_(o)
            h2 = x if L.ln2 is None else L.ln2(x)
        if L.moe is not None:        # a mixture-of-experts block: routed, combined and all-reduced by itself
            o = L.moe(h2.view(1, n, h)).view(n, h)
            x.add_(o if L.post_ff is None else L.post_ff(o))
            return
        gu = lin(h2, L.wgu, L.bgu)                                                      # [n, 2 f] (gated) or [n, f]
        if L.gated:
            g_, u = gu[:, :L.f], gu[:, L.f:]
            a = (F.silu(g_, inplace=True) if L.silu else L.act(g_)).mul_(u)
        else:
            a = F.silu(gu, inplace=True) if L.silu else L.act(gu)
        o = all_reduce(lin(a, L.wd, None), tp)
        if L.bd is not None:
            o = o + L.bd
        if L.post_ff is not None:
            o = L.post_ff(o)
        if L.parallel:
            o = o + x_attn          # transformers' order: mlp + attn + x
        x.add_(o)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head of ``x`` ``[n, s, h]``: vocab-sharded logits ``[n, s, V_r]`` (soft-capped as
        ``cap * tanh(logits / cap)`` when the family does: element-wise, so the same on each shard)."""
        logits = self.linear(self.norm(x), self.lm_w, self.lm_b)
        if self.final_cap is not None:
            logits = torch.tanh(logits / self.final_cap) * self.final_cap
        return logits

    # ---------------------------------------- verify's use (generate and serve step the Engine): rows 0..b-1

    def prefill(self, ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Prompt ``ids`` ``[b, s]`` (left-padded, ``attention_mask`` ``[b, s]``) into cache positions ``0..s-1``;
        returns the last position's logits ``[b, V_r]``. The padded keys stay masked for the later steps."""
        b, s = ids.shape
        self.valid.fill_(True)
        self.valid[:b, :s] = attention_mask.bool()
        self.padded = not bool(attention_mask.bool().all())
        causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
        # a padded query attends to itself only (its output is never read; this keeps it finite)
        mask = (causal & self.valid[:b, None, None, :s]) | torch.eye(s, dtype=torch.bool, device=ids.device)
        return self.forward(ids, position_ids, mask, length=s, start=0)

    def decode(self, ids: torch.Tensor, position_ids: torch.Tensor, t: int) -> torch.Tensor:
        """One token per row, ``ids`` ``[b, 1]``, written at cache position ``t``; returns ``[b, V_r]``."""
        b = ids.shape[0]
        mask = self.valid[:b, None, None, :t + 1] if self.padded else None
        return self.forward(ids, position_ids, mask, length=t + 1, start=t)
