"""The lean decode path: the per-token forward of a sharded Llama-family decoder without the framework around it.

Small-batch decode is memory-bound: a step should cost about the time to read the rank's weights once (Pope et
al. 2022, "Efficiently Scaling Transformer Inference", sec. 3.1). The Hugging Face forward adds, per step and per
layer, a cache object, mask construction, output dataclasses and three separate q/k/v (and two gate/up) matmuls;
at 135M parameters that Python and allocation work is as large as the matmuls. :class:`LeanDecoder` runs the same
math directly on the rank's tensors:

* one fused QKV matmul and one fused gate-up matmul per layer (:func:`fuse_projections`: the rank's q/k/v rows,
  and its gate/up rows, concatenated once; the original parameters become views of the fused tensor, so no
  second copy is kept and parameter names / ``state_dict`` keys are unchanged);
* a static KV cache allocated once, ``[num_layers, max_batch, kv_local, max_len, d]``, holding only this rank's
  KV heads; a step takes the write and read views of all layers in one call each, writes its new K/V in place
  and attends to a view of the first ``length`` entries;
* the rotary tables computed once per step for all layers; the decode mask is a view of a preallocated
  ``[max_batch, max_len]`` key-validity buffer (``None`` when no row is padded);
* as few framework calls per layer as the math allows (the per-token cost every rank pays, which caps the
  tensor-parallel speed-up): RMSNorm in five calls, the matmuls as ``torch.mm`` on ``[in, out]``
  views of the weights (``F.linear``'s own kernel call), the residual adds and the SiLU in place;
* bf16 on a CPU (oneDNN with bf16 kernels): the matmuls run on weights reordered once into oneDNN's blocked
  layout (:func:`pack`, kept on the modules until a weight changes); ``F.linear`` calls the same oneDNN matmul
  but reorders the weight on every call, which made bf16 GEMV 1.5x slower than it needs to be (same bits);
* a model quantized by :func:`tensorpar.decode.quantize.quantize_int8` (its fp weights freed) runs every matmul as
  :func:`tensorpar.decode.int8.int8_linear` (Q8_0 x Q8_0: the input quantized per block of 32, int8 x int8) on the
  int8 ``[out, in]`` weights: no ``[in, out]`` views, no prepacking;
* collectives: one all-reduce for the embedding (vocabulary-parallel), two per layer (attention and MLP outputs,
  after the row-parallel projections), exactly those of the module path, through :func:`tensorpar.comm.all_reduce`
  (the shared-memory path when it is on); with ``tp.compression == "int8"`` (``--tp-comm int8``) the per-layer
  ones go through :func:`tensorpar.comm.reduce_partial` (blockwise int8, :mod:`tensorpar.comm.compress`), as the
  module path's row-parallel layers and embedding do.

The math is the module path's, rounding for rounding except inside a matmul: RMSNorm by fewer calls only where
a probe at construction shows it bitwise equal to the family's module (else the module runs), the rotary
embedding module and the families' ``apply_rotary_pos_emb`` formula ``q*cos + rotate_half(q)*sin`` (applied to
the q and k heads in one go, ``rotate_half(q)*sin`` computed exactly as ``q[..., perm] * (sign*sin)``),
``scaled_dot_product_attention`` with the layer's scaling; only the order of operations inside a matmul may
differ, so greedy tokens equal transformers' (tests/decode/test_lean.py, tests/decode/test_generate.py, tests/decode/test_smollm2.py).

Families: those whose blocks are ``x + attn(norm(x))``, ``x + gated_mlp(norm(x))`` with RMSNorm and a rotary
:class:`~tensorpar.hf.modules.TPAttention` (the families whose record sets ``fast_decode``,
:func:`tensorpar.hf.families.why_not`), without sliding windows,
q/k norms, soft-capping or sequence parallelism. Others run the module path (:func:`lean_unsupported` says why).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tensorpar import comm
from tensorpar.comm import Group
from tensorpar.decode.block import Layer, build_layer
from tensorpar.decode.int8 import int8_linear, int8_weights, lean_weight
from tensorpar.decode.kernels import can_pack, mm, pack, packed_linear, rms_norm_fn
from tensorpar.decode.kv_cache import LeanKVCache, Segment, offsets
from tensorpar.decode.prepare import fuse_projections, lean_unsupported
from tensorpar.decode.rope import rope_switch_length, row_rotary
from tensorpar.layers.fused import fused_weight

__all__ = ["LeanDecoder", "Segment"]


class LeanDecoder:
    """Static-cache forward of a sharded Llama-family causal LM for prefill and decode (see the module docstring).

    Args:
        model: the sharded ``*ForCausalLM`` (:func:`lean_unsupported` must return ``None``).
        tp: its tensor-parallel group.
        max_batch: rows (or serving slots) the cache holds.
        max_len: positions per row (prompt + new tokens).
        prepack: run the matmuls on weights reordered once into oneDNN's blocked layout. bf16: bitwise the
            results of ``F.linear``, which on a bf16 CPU weight reorders it on every call (1.5x slower GEMV,
            measured in bench/results/decode.md). fp32: oneDNN's kernels instead of MKL's ``torch.mm``, within a
            few units in the last place of it and faster (:meth:`_use_packed`). ``None``: for CPU weights in
            fp32, or bf16 where oneDNN runs bf16. Never for a model quantized by
            :func:`tensorpar.decode.quantize.quantize_int8` (its matmuls read the int8 weights).

    Memory: ``2 * num_layers * max_batch * kv_local * max_len * head_dim`` elements of the weights' dtype,
    allocated here once; with ``prepack`` a second copy of the rank's matmul weights (kept on the modules and
    reused by the next decoder until a weight changes). Raises ValueError if the model cannot run this path.
    """

    def __init__(self, model, tp: Group, *, max_batch: int, max_len: int, prepack: bool | None = None):
        why = lean_unsupported(model)
        if why is not None:
            raise ValueError(f"the lean decode path cannot run this model: {why}")
        q8 = int8_weights(model)        # tensorpar.decode.quantize.quantize_int8 ran: its fp weights were freed
        if q8 is not None and q8["dtype"] != model.model.norm.weight.dtype:
            raise ValueError(f"the model was quantized in {q8['dtype']} and is now {model.model.norm.weight.dtype}; "
                             f"quantize after the .to(dtype)")
        int8 = q8 is not None
        fuse_projections(model)
        base = model.model
        self.model, self.tp = model, tp
        self.embed, self.rotary = base.embed_tokens, base.rotary_emb
        self.rope_switch = rope_switch_length(base.rotary_emb)
        self.norm = rms_norm_fn(base.norm)
        self.lm_w, self.lm_b = lean_weight(model.lm_head), getattr(model.lm_head, "bias", None)
        self.max_batch, self.max_len = max_batch, max_len
        a0 = base.layers[0].self_attn
        self.rope = a0._rope
        w0 = self.lm_w
        dev = w0.device
        self.layers: list[Layer] = [build_layer(layer, tp, int8=int8, probe_w=w0) for layer in base.layers]
        n_q, n_kv, d = a0.layout.local_heads(tp.rank), a0.layout.local_kv_heads(tp.rank), a0.head_dim
        self.n_q, self.n_kv, self.head_dim = n_q, n_kv, d
        self.cache = LeanKVCache(len(self.layers), max_batch, n_kv, max_len, d, dtype=w0.dtype, device=dev)
        # rotate_half(x) * sin == x[..., perm] * sin_sign (the halves swapped, the sign moved onto sin: exact)
        half = d // 2
        self.perm = torch.cat([torch.arange(half, d), torch.arange(0, half)]).to(dev)
        self.sign = torch.cat([-torch.ones(half), torch.ones(d - half)]).to(dev, w0.dtype)
        # the matmuls: self.lin for the layers (2-D input), self.linear for the LM head
        if int8:        # the int8 weights (lean_weight / fused_weight gave them above), int8 x int8 per block
            self.lin = self.linear = int8_linear
        else:
            self.lin, self.linear = mm, F.linear
        self.packed = (not int8 and (prepack if prepack is not None else can_pack(w0))
                       and w0.device.type == "cpu" and torch.backends.mkldnn.is_available())
        if self.packed:
            self._use_packed(model)
        #: key validity per row and position (False: left padding); decode masks are views of it
        self.valid = torch.ones(max_batch, max_len, dtype=torch.bool, device=dev)
        self.padded = False

    def _use_packed(self, model) -> None:
        """Read oneDNN-prepacked copies of the matmul weights (:func:`pack`). bf16: only if a probe shows them
        bitwise equal to ``F.linear`` on this machine (else keep the plain weights). fp32: oneDNN's kernels
        differ from ``torch.mm``'s (MKL) in the order of their sums, a few units in the last place (the probe
        checks 1e-5 relative), and run 1.4x (one row) to 1.8x (32 rows) faster at the decode shapes of SmolLM2
        (bench/results/matmul_pack.md)."""
        base = model.model
        a0 = base.layers[0].self_attn
        w = fused_weight(a0, ("q_proj", "k_proj", "v_proj"))[0]
        probe = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)
        got = packed_linear(probe, pack(a0, "qkv", w, (a0.q_proj.weight, a0.k_proj.weight, a0.v_proj.weight)),
                             None)
        want = F.linear(probe, w)
        same = (torch.equal(got, want) if w.dtype != torch.float32
                else torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())))
        if not same:
            self.packed = False
            return
        for layer, L in zip(base.layers, self.layers):
            a, m = layer.self_attn, layer.mlp
            L.wqkv = pack(a, "qkv", fused_weight(a, ("q_proj", "k_proj", "v_proj"))[0],
                           (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight))
            L.wo = pack(a, "o", a.o_proj.weight)
            L.wgu = pack(m, "gu", fused_weight(m, ("gate_proj", "up_proj"))[0], (m.gate_proj.weight, m.up_proj.weight))
            L.wd = pack(m, "down", m.down_proj.weight)
        self.lm_w = pack(model.lm_head, "w", self.lm_w)
        self.lin = self.linear = packed_linear

    def nbytes(self) -> int:
        """Bytes held by the KV cache."""
        return self.cache.nbytes()

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, rope_pos: torch.Tensor, mask: torch.Tensor | None, *, length: int,
                start: int | None = None, slots: torch.Tensor | None = None, cache_pos: torch.Tensor | None = None,
                last_only: bool = True) -> torch.Tensor:
        """Run ``ids`` ``[b, s]`` through the model, writing their K/V into the cache; return vocab-sharded logits.

        Where the K/V go: either ``start`` (rows ``0..b-1``, positions ``start .. start+s-1``) or ``slots``
        ``[b]`` with ``cache_pos`` ``[b, s]`` (each row its own slot and positions). Attention reads cache entries
        ``[0, length)``; ``mask`` is ``[b, 1, s, length]`` bool (True = attend) or ``None`` for all of them.
        ``rope_pos`` ``[b, s]``: the rotary positions. Returns ``[b, V_r]`` (the last position; ``[b, s, V_r]``
        with ``last_only=False``). Collectives: ``1 + 2 * num_layers`` all-reduces of ``[b, s, h]``.
        """
        b, s = ids.shape
        seg = Segment(b, s, mask, length, start=start, slots=slots, cache_pos=cache_pos)
        return self.forward_segments(ids.reshape(b * s), rope_pos.reshape(b * s), [seg], last_only=last_only)

    @torch.no_grad()
    def forward_segments(self, ids: torch.Tensor, rope_pos: torch.Tensor, segments: list[Segment], *,
                         last_only: bool = True) -> torch.Tensor:
        """One forward of several batches of rows (*segments*, e.g. a serving step's decode rows and its new
        prompts): the matmuls, norms and all-reduces run once over all their tokens, attention per segment.

        ``ids``, ``rope_pos`` ``[T]``: the segments' tokens and rotary positions one after the other, each
        segment's ``[b, s]`` flattened row by row (``T = sum(b * s)``). A segment's cache writes and reads are those
        of :meth:`forward` with its fields. Returns the logits of each row's last position, ``[sum(b), V_r]`` in
        segment order (``last_only=False``, one segment: ``[b, s, V_r]``). Why one forward: a step's prefill
        rows as a forward of their own cost a second pass over every weight and the framework's per-layer calls
        again (one new prompt next to 31 decode rows of SmolLM2 at tp=2, fp32: +41.6 ms on an 85 ms step as its
        own forward, +15.2 ms in the same forward; bench/results/serve_step.md). Collectives: ``1 + 2 * num_layers`` all-reduces of
        ``[T, h]``. Raises ValueError when the segments' tokens do not add up to ``T``.
        """
        tp = self.tp
        T = ids.shape[0]
        if sum(g.b * g.s for g in segments) != T or rope_pos.shape[0] != T:
            raise ValueError(f"segments of {[(g.b, g.s) for g in segments]} rows x tokens do not add up to the "
                             f"{T} ids / {rope_pos.shape[0]} positions given")
        x = self.embed(ids.view(1, T))                                                 # [1, T, h], all-reduced
        h = x.shape[-1]
        if self.rope_switch is None:
            cos, sin = self.rotary(x, rope_pos.view(1, T))                             # [1, T, d]
        else:       # longrope: each row the factors of its own length (tensorpar/decode/rope.py)
            last = torch.cat([rope_pos[o:o + g.b * g.s].view(g.b, g.s)[:, -1:].expand(g.b, g.s).reshape(-1)
                              for g, o in zip(segments, offsets(segments))])
            cos, sin = row_rotary(self.rotary, x, rope_pos.view(1, T), last.view(1, T), self.rope_switch)
        d, nq, nkv = self.head_dim, self.n_q, self.n_kv
        cos = cos.view(T, 1, d)
        sin = (sin * self.sign).view(T, 1, d)
        perm, lin, cache = self.perm, self.lin, self.cache
        all_reduce = comm.reduce_partial if tp.compression == "int8" else comm.all_reduce   # --tp-comm
        views = [cache.views(g) for g in segments]
        x = x.reshape(T, h).clone()                                                    # the residual stream, in place
        for i, L in enumerate(self.layers):
            qkv = lin(L.ln1(x), L.wqkv, L.bqkv).view(T, nq + 2 * nkv, d)                # [T, heads, d]
            # rotary on the q and k heads together: q*cos + rotate_half(q)*sin, the family's formula
            qk = qkv[:, :nq + nkv]
            rot = qk.index_select(-1, perm).mul_(sin)
            qk = torch.mul(qk, cos).add_(rot)                                          # [T, q_local + kv_local, d]
            o = cache.attention(i, L, qk, qkv[:, nq + nkv:], segments, views, nq)     # [T, q_local * d]
            o = all_reduce(lin(o, L.wo, None), tp)
            if L.bo is not None:
                o = o + L.bo
            x.add_(o)
            gu = lin(L.ln2(x), L.wgu, L.bgu)                                           # [T, 2 f]
            g_, u = gu[:, :L.f], gu[:, L.f:]
            a = F.silu(g_, inplace=True) if L.silu else L.act(g_)
            o = all_reduce(lin(a.mul_(u), L.wd, None), tp)
            if L.bd is not None:
                o = o + L.bd
            x.add_(o)
        if len(segments) == 1:
            g = segments[0]
            x = x.view(g.b, g.s, h)
            if last_only:
                x = x[:, -1:]
            logits = self.linear(self.norm(x), self.lm_w, self.lm_b)
            return logits[:, -1] if last_only else logits
        if not last_only:
            raise ValueError("last_only=False takes one segment")
        last, t0 = [], 0
        for g in segments:          # the last position of each row
            last.extend(range(t0 + g.s - 1, t0 + g.b * g.s, g.s))
            t0 += g.b * g.s
        x = x.index_select(0, torch.tensor(last, device=x.device)).unsqueeze(1)           # [sum(b), 1, h]
        return self.linear(self.norm(x), self.lm_w, self.lm_b)[:, -1]

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
