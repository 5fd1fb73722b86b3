"""The lean decode path: the per-token forward of a sharded Llama-family decoder without the framework around it.

Small-batch decode is memory-bound: a step should cost about the time to read the rank's weights once (Pope et
al. 2022, "Efficiently Scaling Transformer Inference", sec. 3.1). The Hugging Face forward adds, per step and per
layer, a cache object, mask construction, output dataclasses and three separate q/k/v (and two gate/up) matmuls;
at 135M parameters that Python and allocation work is as large as the matmuls. :class:`LeanDecoder` runs the same
math directly on the rank's tensors:

* one fused QKV matmul and one fused gate-up matmul per layer (:func:`fuse_projections`: the rank's q/k/v rows,
  and its gate/up rows, concatenated once; the original parameters become views of the fused tensor, so no
  second copy is kept and parameter names / ``state_dict`` keys are unchanged);
* a static KV cache allocated once, ``[max_batch, kv_local, max_len, d]`` per layer, holding only this rank's KV
  heads; a step writes its new K/V in place and attends to a view of the first ``length`` entries;
* the rotary tables computed once per step for all layers; the decode mask is a view of a preallocated
  ``[max_batch, max_len]`` key-validity buffer (``None`` when no row is padded);
* collectives: one all-reduce for the embedding (vocabulary-parallel), two per layer (attention and MLP outputs,
  after the row-parallel projections), exactly those of the module path, through :func:`tensorpar.comm.all_reduce`
  (the shared-memory path when it is on).

The math is the module path's: the same RMSNorm modules and rotary embedding, the rotary formula of the families'
``apply_rotary_pos_emb`` (applied to the q and k heads in one go), ``scaled_dot_product_attention`` with the layer's scaling; only the order of operations inside a
matmul may differ, so greedy tokens equal transformers' (tests/test_lean.py, tests/test_smollm2.py).

Families: those whose blocks are ``x + attn(norm(x))``, ``x + gated_mlp(norm(x))`` with RMSNorm and a rotary
:class:`~tensorpar.hf.modules.TPAttention` (llama, mistral, qwen2; :data:`LEAN_FAMILIES`), without sliding windows,
q/k norms, soft-capping or sequence parallelism. Others run the module path (:func:`lean_unsupported` says why).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tensorpar import comm
from tensorpar.comm import Group

#: model types the lean path runs (the others use the Hugging Face module path)
LEAN_FAMILIES = ("llama", "mistral", "qwen2")


def lean_unsupported(model) -> str | None:
    """Why ``model`` (sharded by :func:`tensorpar.hf.apply.parallelize`) cannot run :class:`LeanDecoder`, or
    ``None`` if it can."""
    from tensorpar.hf.modules import TPAttention, TPGatedMLP

    cfg = model.config
    mt = getattr(cfg, "model_type", None)
    if mt not in LEAN_FAMILIES:
        return f"model_type={mt!r} is not one of {LEAN_FAMILIES}"
    base = getattr(model, "model", None)
    if base is None or not all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "not a decoder with model.embed_tokens / layers / norm / rotary_emb"
    if getattr(model.tensorpar_plan, "sequence_parallel", False):
        return "sequence parallelism"
    # Mistral's / Qwen2's window lives in the config (applied through the mask), not on the attention module
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    if window is not None or any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())):
        return f"sliding_window={window}"
    for layer in base.layers:
        a, m = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if type(a) is not TPAttention or type(m) is not TPGatedMLP:
            return f"layer {getattr(a, 'layer_idx', '?')} is not TPAttention + TPGatedMLP"
        if a.fused or m.fused or a.q_norm is not None or a.softcap is not None:
            return "fused checkpoint projections, q/k norms or soft-capping"
        if a.sliding_window is not None:
            return f"sliding_window={a.sliding_window}"
        if a.output_dropout is not None or m.output_dropout is not None:
            return "output dropout"
        if a._rope is None:
            return "no apply_rotary_pos_emb in the family module"
    return None


def _fuse(mods, names) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate ``mods[i].weight`` (and biases) along dim 0 and make each a view of the result."""
    ws = [m.weight for m in mods]
    fused = torch.cat([w.detach() for w in ws])
    off = 0
    for w in ws:
        n = w.shape[0]
        w.data = fused[off:off + n]
        off += n
    biases = [m.bias for m in mods]
    fb = None
    if all(b is not None for b in biases):
        fb = torch.cat([b.detach() for b in biases])
        off = 0
        for b in biases:
            b.data = fb[off:off + b.shape[0]]
            off += b.shape[0]
    elif any(b is not None for b in biases):
        fb = torch.cat([b.detach() if b is not None else w.new_zeros(w.shape[0]) for b, w in zip(biases, ws)])
    return fused, fb


def fused_weight(owner, names: tuple[str, ...]):
    """The fused ``(weight, bias)`` of ``owner``'s projections ``names`` (built on first use by
    :func:`fuse_projections`), or ``None`` when they are stale (the parameters were replaced, e.g. by ``.to``)."""
    f = owner.__dict__.get("_lean_fused")
    if f is None:
        return None
    w = f[0]
    if not isinstance(w, torch.Tensor):     # int8 (tensorpar.quant.quantize_int8): the fp weights were freed
        return f
    first = getattr(owner, names[0]).weight
    if first.data_ptr() != w.data_ptr() or first.dtype != w.dtype or first.device != w.device:
        return None
    return f


def fuse_projections(model) -> None:
    """Fuse, on this rank, each :class:`TPAttention`'s q/k/v weights into one ``[q_local*d + 2*kv_local*d, h]``
    tensor and each :class:`TPGatedMLP`'s gate/up weights into one ``[2*f_r, h]`` tensor.

    The original parameters become views of the fused tensors (same names, same values, no extra memory); the
    modules' forwards use the fused tensor when gradients are off. Idempotent; re-fuses after a ``.to(dtype)``.
    No collectives.
    """
    from tensorpar.hf.modules import TPAttention, TPGatedMLP

    for mod in model.modules():
        if type(mod) is TPAttention and not mod.fused:
            names = ("q_proj", "k_proj", "v_proj")
        elif type(mod) is TPGatedMLP and not mod.fused:
            names = ("gate_proj", "up_proj")
        else:
            continue
        if fused_weight(mod, names) is None:
            mod.__dict__["_lean_fused"] = _fuse([getattr(mod, n) for n in names], names)


class _Layer:
    __slots__ = ("ln1", "wqkv", "bqkv", "split", "wo", "bo", "ln2", "wgu", "bgu", "f", "wd", "bd", "act",
                 "kv_idx", "gqa", "scaling")


class LeanDecoder:
    """Static-cache forward of a sharded Llama-family causal LM for prefill and decode (see the module docstring).

    Args:
        model: the sharded ``*ForCausalLM`` (:func:`lean_unsupported` must return ``None``).
        tp: its tensor-parallel group.
        max_batch: rows (or serving slots) the cache holds.
        max_len: positions per row (prompt + new tokens).

    Memory: ``2 * num_layers * max_batch * kv_local * max_len * head_dim`` elements of the weights' dtype,
    allocated here once. Raises ValueError if the model cannot run this path.
    """

    def __init__(self, model, tp: Group, *, max_batch: int, max_len: int):
        why = lean_unsupported(model)
        if why is not None:
            raise ValueError(f"the lean decode path cannot run this model: {why}")
        fuse_projections(model)
        from tensorpar.quant import lean_weight     # int8: the Int8Weight of a Linear whose fp weight was freed
        base = model.model
        self.model, self.tp = model, tp
        self.embed, self.rotary, self.norm = base.embed_tokens, base.rotary_emb, base.norm
        self.lm_w, self.lm_b = lean_weight(model.lm_head), getattr(model.lm_head, "bias", None)
        self.max_batch, self.max_len = max_batch, max_len
        self.layers: list[_Layer] = []
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        a0 = base.layers[0].self_attn
        self.rope = a0._rope
        w0 = self.lm_w
        for layer in base.layers:
            a, m = layer.self_attn, layer.mlp
            L = _Layer()
            L.ln1, L.ln2 = layer.input_layernorm, layer.post_attention_layernorm
            L.wqkv, L.bqkv = fused_weight(a, ("q_proj", "k_proj", "v_proj"))
            L.split = [a._n_q, a._n_kv, a._n_kv]
            L.wo, L.bo = lean_weight(a.o_proj), a.o_proj.bias
            L.wgu, L.bgu = fused_weight(m, ("gate_proj", "up_proj"))
            L.f = lean_weight(m.down_proj).shape[1]
            L.wd, L.bd = lean_weight(m.down_proj), m.down_proj.bias
            L.act = m.act_fn
            L.gqa = a._group is not None and a._group > 1
            idx = a.layout.kv_index(tp.rank)
            L.kv_idx = None if a._group is not None else torch.tensor(idx, device=w0.device)
            L.scaling = a.scaling
            self.layers.append(L)
            n_kv, d = a.layout.local_kv_heads(tp.rank), a.head_dim
            self.k.append(torch.zeros(max_batch, n_kv, max_len, d, dtype=w0.dtype, device=w0.device))
            self.v.append(torch.zeros(max_batch, n_kv, max_len, d, dtype=w0.dtype, device=w0.device))
        self.head_dim = a0.head_dim
        self.linear = F.linear
        self._use_int8(model)
        #: key validity per row and position (False: left padding); decode masks are views of it
        self.valid = torch.ones(max_batch, max_len, dtype=torch.bool, device=w0.device)
        self.padded = False

    def _use_int8(self, model) -> None:
        """Read the int8 weights of :func:`tensorpar.quant.quantize_int8` (if it ran) instead of the fp ones."""
        from tensorpar.quant import int8_linear, int8_weights

        q = int8_weights(model)
        if q is None:
            return
        if q["dtype"] != self.norm.weight.dtype:
            raise ValueError(f"the model was quantized in {q['dtype']} and is now {self.norm.weight.dtype}; "
                             f"quantize after the .to(dtype)")
        for layer, L in zip(model.model.layers, self.layers):
            qa, qm = q[id(layer.self_attn)], q[id(layer.mlp)]
            L.wqkv, L.wo, L.wgu, L.wd = qa["qkv"], qa["o"], qm["gu"], qm["down"]
        self.lm_w = q["lm_head"]
        self.linear = int8_linear

    def nbytes(self) -> int:
        """Bytes held by the KV cache."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

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
        tp = self.tp
        b, s = ids.shape
        x = self.embed(ids)                                                            # [b, s, h], all-reduced
        cos, sin = self.rotary(x, rope_pos)
        d = self.head_dim
        sdpa, linear = F.scaled_dot_product_attention, self.linear
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)                                # [b, 1, s, d]
        half = d // 2
        for i, L in enumerate(self.layers):
            r = L.ln1(x)
            nq, nkv = L.split[0], L.split[1]
            qkv = linear(r, L.wqkv, L.bqkv)                                          # [b, s, (q + 2 kv) * d]
            # rotary on the q and k heads together: q*cos + rotate_half(q)*sin, the family's formula
            qk = qkv[..., :nq + nkv].view(b, s, -1, d).transpose(1, 2)               # [b, q_local + kv_local, s, d]
            qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin
            nh = nq // d
            q, k = qk[:, :nh], qk[:, nh:]                                            # [b, q_local | kv_local, s, d]
            v = qkv[..., nq + nkv:].view(b, s, -1, d).transpose(1, 2)               # [b, kv_local, s, d]
            kc, vc = self.k[i], self.v[i]
            if slots is None:
                kc[:b, :, start:start + s] = k
                vc[:b, :, start:start + s] = v
                keys, vals = kc[:b, :, :length], vc[:b, :, :length]
            else:
                kc[slots[:, None], :, cache_pos] = k.transpose(1, 2)
                vc[slots[:, None], :, cache_pos] = v.transpose(1, 2)
                if b == 1:
                    j = int(slots[0])
                    keys, vals = kc[j:j + 1, :, :length], vc[j:j + 1, :, :length]
                else:
                    keys, vals = kc[:, :, :length].index_select(0, slots), vc[:, :, :length].index_select(0, slots)
            if L.kv_idx is not None:
                keys, vals = keys.index_select(1, L.kv_idx), vals.index_select(1, L.kv_idx)
            o = sdpa(q, keys, vals, attn_mask=mask, scale=L.scaling, enable_gqa=L.gqa)   # [b, q_local, s, d]
            o = linear(o.transpose(1, 2).reshape(b, s, -1), L.wo)
            o = comm.all_reduce(o, tp)
            if L.bo is not None:
                o = o + L.bo
            x = x + o
            g, u = linear(L.ln2(x), L.wgu, L.bgu).split(L.f, -1)
            o = comm.all_reduce(linear(L.act(g) * u, L.wd), tp)
            if L.bd is not None:
                o = o + L.bd
            x = x + o
        if last_only:
            x = x[:, -1:]
        logits = linear(self.norm(x), self.lm_w, self.lm_b)
        return logits[:, -1] if last_only else logits

    # -------------------------------------------------------------- generate's use: rows 0..b-1, common positions

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
