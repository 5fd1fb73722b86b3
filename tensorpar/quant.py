"""int8 weight-only quantization for the lean decode path (``--quantize int8``).

Every Linear of the decoder (the fused q/k/v and gate/up projections, o_proj, down_proj) and the LM head is stored
as ``int8`` with one scale per output channel (symmetric absmax, round to nearest: ``s = max|W[o, :]| / 127``,
``q = round(W / s)`` clamped to [-127, 127]; the scheme of gpt-fast's ``WeightOnlyInt8QuantHandler`` and of
LLM.int8()'s weight side). Activations stay in the model's dtype; the matmul dequantizes on the fly.

Sharding invariance: a scale covers a whole row of the *full* (unsharded) weight. Column-parallel layers and the
vocabulary-parallel LM head hold whole rows, so their local absmax is the full row's. Row-parallel layers
(o_proj, down_proj) hold a slice of every row: their absmax is all-reduced with ``op="max"`` over the
tensor-parallel group, which gives the scale of the full row. ``q`` is elementwise given ``s``, so each rank
holds exactly the slice of the full quantized weight, and a row-parallel partial sum ``x_r q_r^T`` times the
common ``s`` sums to ``(x q^T) s``: the quantized model at any tp equals the quantized model at tp=1 up to
floating-point summation order (tests/test_quant.py: greedy tokens equal at tp 1/2/3). No group scales are
used, so no shard boundary can cut a group.

Compute (:func:`int8_linear`): ``torch._weight_int8pack_mm(x, q, s)`` (gpt-fast's CPU int8 kernel) for bfloat16
activations on CPU when ``in_features % 16 == 0`` (torch 2.13 segfaults otherwise); for float32 that kernel is
slower than the fp32 matmul itself (bench/results/decode_int8.md), so float32 (and every other case, CUDA
included) runs ``F.linear(x, q.to(x.dtype)) * s``, dequantizing at most 2M weights at a time. That path is
correct but slower than fp32 decode on this CPU (the int8 -> fp32 conversion dominates; docs/quantize.md):
int8 pays off with ``--dtype bfloat16``.

Memory: the floating-point weights of every quantized Linear are freed (:func:`quantize_int8`): each such module
loses its ``weight`` parameter and becomes :class:`Int8ColumnParallelLinear` / :class:`Int8RowParallelLinear`, whose
``weight`` is a property that dequantizes ``q * s`` on access (the module path, ``path="hf"``, and
:mod:`tensorpar.verify` compute with exactly the values the fake-quantized model had, one matrix at a time); the
lean path's fused q/k/v and gate/up fp buffers are replaced by their int8 tensors (the per-projection modules hold
row views of them). A tied embedding (SmolLM2) holds the LM head's dequantized values, so it becomes
:class:`Int8VocabParallelEmbedding`, which looks up and dequantizes rows of the LM head's int8 tensor (bit-equal
to the fake-quantized table); an untied embedding stays in its dtype, unquantized. Resident weights per rank:
one byte per quantized weight, plus the scales, norms, biases and an untied embedding
(:func:`resident_weight_bytes`; bench/results/decode_int8.md has the measured bytes and RSS).
Not supported on a quantized model: training, ``.to(dtype/device)`` (quantize after it), saving a checkpoint (the
quantized Linears have no ``weight`` parameter in ``state_dict``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from tensorpar import comm
from tensorpar.comm import Group
from tensorpar.layers.embedding import VocabParallelEmbedding
from tensorpar.layers.linear import ColumnParallelLinear, RowParallelLinear

#: weights dequantized per call of the float32 path (8 MB of fp32): a chunk stays in the allocator's reuse range
_CHUNK_ELEMS = 2 ** 21

#: values of ``--quantize``
QUANTIZE_CHOICES = ("none", "int8")


class Int8Weight(NamedTuple):
    """``q`` ``[out_local, in_local]`` int8 and ``scale`` ``[out_local]`` in the compute dtype;
    ``W ≈ q * scale[:, None]``. ``dtype``, ``device`` and ``shape`` are those of the weight it stands for."""
    q: torch.Tensor
    scale: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.scale.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """``q * s`` ``[out_local, in_local]`` in the compute dtype (a new tensor): the values
        :func:`_quantize` wrote into the fp weight, bit for bit."""
        return (self.q.float() * self.scale.float()[:, None]).to(self.scale.dtype)


def int8_linear(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (q * s)^T + bias`` for ``x`` ``[..., in]``; returns ``[..., out]`` in ``x``'s dtype. No collectives."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.shape[-1] % 16 == 0:
        # torch 2.13's CPU kernel crashes (SIGSEGV, no error) unless in_features is a multiple of 16
        y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), w.q, w.scale).view(*x.shape[:-1], -1)
    else:
        # dequantize at most _CHUNK_ELEMS weights at a time: a whole LM head (SmolLM2: 28M) dequantized at once
        # is a fresh 113 MB buffer per call, page-faulted in every time (12x slower than fp32, measured)
        step = max(1, _CHUNK_ELEMS // w.q.shape[1])
        n = w.q.shape[0]
        if n <= step:
            y = F.linear(x, w.q.to(x.dtype))
        else:
            y = torch.cat([F.linear(x, w.q[c:c + step].to(x.dtype)) for c in range(0, n, step)], dim=-1)
        y = y * w.scale
    return y if bias is None else y + bias


def _quantize(w: torch.Tensor, tp: Group | None, *, write: bool = True) -> Int8Weight:
    """Quantize ``w`` ``[out, in_local]``; ``tp``: all-reduce the row absmax (row-parallel: the input dim is
    sharded), ``None``: the rows are whole. ``write``: overwrite ``w`` in place with ``q * s``. Works on blocks of
    at most ``_CHUNK_ELEMS`` weights, so its temporaries stay small (a whole fp32 LM head would need three
    transient copies); the result is the same elementwise."""
    rows = range(0, w.shape[0], max(1, _CHUNK_ELEMS // max(1, w.shape[1])))
    step = rows.step
    wd = w.detach()
    amax = torch.cat([wd[r:r + step].float().abs().amax(dim=1) for r in rows])
    if tp is not None:
        amax = comm.all_reduce(amax, tp, op="max")
    scale = (amax.clamp_min(1e-12) / 127).to(w.dtype)        # the stored scale, in the compute dtype
    sf = scale.float()[:, None]
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    for r in rows:
        q[r:r + step] = torch.round(wd[r:r + step].float() / sf[r:r + step]).clamp_(-127, 127)
    out = Int8Weight(q, scale.contiguous())
    if write:
        with torch.no_grad():
            for r in rows:
                w[r:r + step] = Int8Weight(q[r:r + step], out.scale[r:r + step]).dequantize()
    return out


def _release_freed_memory(device: torch.device) -> None:
    """Give the freed fp weights back to the system: glibc keeps freed heap memory in its arenas (the process's
    RSS does not drop; bench/results/decode_int8.md measured 955 MB before and 506 MB after for SmolLM2 int8 at
    tp=1), ``malloc_trim(0)`` returns it; on CUDA the caching allocator's free blocks are released."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        import ctypes
        import ctypes.util
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name) if name else None
            if libc is not None and hasattr(libc, "malloc_trim"):      # glibc only
                libc.malloc_trim(0)
        except OSError:
            pass


class _Int8Weighted:
    """Mixin of a Linear whose fp ``weight`` parameter was freed by :func:`quantize_int8`: ``weight`` dequantizes
    ``_int8_weight`` (an :class:`Int8Weight`) on each access, so the module's own forward computes the quantized
    model with a transient fp copy of this one matrix. Inference only (the dequantized tensor has no gradient)."""

    @property
    def weight(self) -> torch.Tensor:
        return self.__dict__["_int8_weight"].dequantize()


class Int8ColumnParallelLinear(_Int8Weighted, ColumnParallelLinear):
    """A :class:`~tensorpar.layers.linear.ColumnParallelLinear` quantized by :func:`quantize_int8` (shapes and
    collectives unchanged; ``weight`` ``[n_r, in]`` is dequantized on access, see :class:`_Int8Weighted`)."""


class Int8RowParallelLinear(_Int8Weighted, RowParallelLinear):
    """A :class:`~tensorpar.layers.linear.RowParallelLinear` quantized by :func:`quantize_int8` (shapes and
    collectives unchanged; ``weight`` ``[out, k_r]`` is dequantized on access, see :class:`_Int8Weighted`)."""


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
        out = (w.q[local].float() * w.scale.float()[local].unsqueeze(-1)).to(w.scale.dtype)     # [*, h]
        if outside is not None:
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.embed_scale is not None:
            out = out * self.embed_scale.to(out.dtype)
        return comm.reduce_from_tp_region(out, self.tp)


_INT8_CLASSES = ((ColumnParallelLinear, Int8ColumnParallelLinear), (RowParallelLinear, Int8RowParallelLinear),
                 (VocabParallelEmbedding, Int8VocabParallelEmbedding))


def _free_weight(mod: torch.nn.Module, w8: Int8Weight) -> None:
    """Drop ``mod``'s fp ``weight`` parameter (its storage is freed once nothing else holds it) and make ``mod``
    the Int8 class of its type, reading ``w8``."""
    cls = next((q for fp, q in _INT8_CLASSES if type(mod) is fp), None)
    if cls is None:
        raise ValueError(f"--quantize int8 cannot free the weight of a {type(mod).__name__} (it quantizes "
                         f"{', '.join(fp.__name__ for fp, _ in _INT8_CLASSES)}); use --quantize none")
    del mod._parameters["weight"]
    mod.__class__ = cls
    mod.__dict__["_int8_weight"] = w8


def _quantize_fused(owner, names: tuple[str, ...]) -> Int8Weight:
    """Quantize the lean path's fused fp weight of ``owner``'s projections ``names`` (whole rows: no collective),
    then free it: each projection module reads its row view of the int8 tensor, and ``owner``'s fused entry
    (:func:`tensorpar.lean.fused_weight`) becomes ``(Int8Weight, fused fp bias or None)``."""
    from tensorpar.lean import fused_weight

    fw, fb = fused_weight(owner, names)
    w8 = _quantize(fw, None, write=False)
    del fw
    off = 0
    for n in names:
        mod = getattr(owner, n)
        rows = mod._parameters["weight"].shape[0]
        _free_weight(mod, Int8Weight(w8.q[off:off + rows], w8.scale[off:off + rows]))
        off += rows
    owner.__dict__["_lean_fused"] = (w8, fb)
    return w8


def _quantize_linear(mod, tp: Group | None) -> Int8Weight:
    """Quantize ``mod.weight`` (``tp``: row-parallel, see :func:`_quantize`) and free it."""
    w8 = _quantize(mod._parameters["weight"], tp, write=False)
    _free_weight(mod, w8)
    return w8


def quantize_int8(model, tp: Group) -> None:
    """Quantize the decoder's Linears and the LM head of ``model`` (sharded by
    :func:`tensorpar.hf.apply.parallelize`, a family the lean path runs) to int8 with per-output-channel scales,
    in place, and free their floating-point weights (see the module docstring): the int8 tensors are read by
    :class:`tensorpar.lean.LeanDecoder`, and the modules' own forwards dequantize one matrix at a time.

    Per-rank resident weights afterwards (``h`` hidden, ``V_r`` this rank's vocabulary rows): one byte per
    quantized weight, one scale (compute dtype) per local output row (row-parallel layers: per global output
    row), the norms and biases in the compute dtype, and an untied embedding ``[V_r, h]`` in the compute dtype (a
    tied one reads the LM head's int8 rows).

    Collectives: one all-reduce (max) of ``[h]`` per row-parallel layer (2 per decoder layer), in layer order on
    every rank. Raises ValueError if the model cannot run the lean path or is already quantized.
    """
    from tensorpar.lean import fuse_projections, lean_unsupported

    why = lean_unsupported(model)
    if why is not None:
        raise ValueError(f"--quantize int8 runs on the lean decode path, which cannot run this model: {why}; "
                         f"use --quantize none")
    if model.__dict__.get("_tensorpar_int8") is not None:
        raise ValueError("the model is already quantized (quantize_int8 was called twice)")
    fuse_projections(model)
    head, embed = model.lm_head, model.model.embed_tokens
    tied = head._parameters.get("weight") is embed._parameters.get("weight")
    q = {"dtype": head.weight.dtype}
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        q[id(a)] = {"qkv": _quantize_fused(a, ("q_proj", "k_proj", "v_proj")), "o": _quantize_linear(a.o_proj, tp)}
        q[id(m)] = {"gu": _quantize_fused(m, ("gate_proj", "up_proj")), "down": _quantize_linear(m.down_proj, tp)}
    q["lm_head"] = _quantize_linear(head, None)
    if tied:      # the shared table held the LM head's values: the embedding now reads the head's int8 rows
        _free_weight(embed, q["lm_head"])
    model.__dict__["_tensorpar_int8"] = q
    _release_freed_memory(q["lm_head"].device)


def lean_weight(mod):
    """What :class:`tensorpar.lean.LeanDecoder` multiplies by for the Linear ``mod``: its :class:`Int8Weight` when
    :func:`quantize_int8` freed its fp weight, else ``mod.weight``."""
    w8 = mod.__dict__.get("_int8_weight")
    return mod.weight if w8 is None else w8


def resident_weight_bytes(model) -> int:
    """Bytes of the distinct storages behind ``model``'s tensors on this rank: parameters, buffers, and every
    tensor a module holds outside them (the lean path's fused weights, the int8 weights and scales); a storage
    shared by several tensors (views, tied weights) counts once, at its full size. No collectives."""
    sizes: dict[int, int] = {}

    def add(x, depth=0):
        if isinstance(x, torch.Tensor):
            try:
                st = x.untyped_storage()
            except (RuntimeError, NotImplementedError):      # no storage (meta, wrapper subclasses)
                return
            sizes[st.data_ptr()] = max(sizes.get(st.data_ptr(), 0), st.nbytes())
        elif depth < 4 and isinstance(x, (tuple, list)):
            for v in x:
                add(v, depth + 1)
        elif depth < 4 and isinstance(x, dict):
            for v in x.values():
                add(v, depth + 1)

    for mod in model.modules():
        add(mod.__dict__)
    return sum(sizes.values())


def quantize_reference_int8(model) -> None:
    """The same quantization on an unsharded ``*ForCausalLM`` (the reference of :mod:`tensorpar.verify`), in plain
    PyTorch: every ``nn.Linear`` under ``model.model.layers`` and the LM head get ``round(W / s) * s`` with
    ``s = max|W[o, :]| / 127`` per output row, in place. No int8 tensors are kept; no collectives."""
    linears = [m for layer in model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    for m in linears + [model.lm_head]:
        _quantize(m.weight, None)


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
            if isinstance(w, Int8Weight):
                n += w.q.numel() + w.scale.numel() * w.scale.element_size()
    return n


# ---------------------------------------------------------------- the --quantize flag (generate, serve, verify)

def add_quantize_argument(p) -> None:
    """``--quantize {none,int8}`` (generate, serve, verify)."""
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="none",
                   help="int8: weight-only int8 with per-output-channel scales for every decoder Linear and the "
                        "LM head (lean decode path; tensorpar/quant.py)")


def check_quantize(quantize: str, config, plan) -> None:
    """In the launching process: ValueError if ``--quantize int8`` cannot run this model (lean path only)."""
    from tensorpar.hf.families import why_not
    if quantize == "none":
        return
    why = why_not("fast_decode", config)   # the rule the ranks apply (tensorpar.lean.lean_unsupported)
    if why is not None:
        raise ValueError(f"--quantize {quantize} runs on the lean decode path, which cannot run this model: {why}; "
                         f"use --quantize none")
    if getattr(plan, "sequence_parallel", False):
        raise ValueError(f"--quantize {quantize} cannot run with sequence parallelism (the lean path does not); "
                         f"use a plan without it or --quantize none")


def apply_quantize(model, tp: Group, quantize: str) -> None:
    """On every rank, after loading: quantize ``model`` in place (:func:`tensorpar.quant.quantize_int8`)."""
    if quantize == "int8":
        quantize_int8(model, tp)
