"""int8 weight-only quantization for the lean decode path (``--quantize int8``): :func:`quantize_int8` on every
rank, the plain-PyTorch reference (:func:`quantize_reference_int8`) and the ``--quantize`` flag. The int8 format,
its matmul and the modules that read it: :mod:`tensorpar.decode.int8`.

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
floating-point summation order (tests/decode/test_quant.py: greedy tokens equal at tp 1/2/3). No group scales are
used, so no shard boundary can cut a group.

Memory: the floating-point weights of every quantized Linear are freed (:func:`quantize_int8`): each such module
loses its ``weight`` parameter and becomes :class:`~tensorpar.decode.int8.Int8ColumnParallelLinear` /
:class:`~tensorpar.decode.int8.Int8RowParallelLinear`, whose ``weight`` is a property that dequantizes ``q * s``
on access (the module path, ``path="hf"``, and :mod:`tensorpar.verify` compute with exactly the values the
fake-quantized model had, one matrix at a time); the lean path's fused q/k/v and gate/up fp buffers are replaced by
their int8 tensors (the per-projection modules hold row views of them). A tied embedding (SmolLM2) holds the LM
head's dequantized values, so it becomes :class:`~tensorpar.decode.int8.Int8VocabParallelEmbedding`, which looks
up and dequantizes rows of the LM head's int8 tensor (bit-equal to the fake-quantized table); an untied embedding stays in its dtype, unquantized. Resident weights per rank:
one byte per quantized weight, plus the scales, norms, biases and an untied embedding
(:func:`resident_weight_bytes`; bench/results/decode_int8.md has the measured bytes and RSS).
Not supported on a quantized model: training, ``.to(dtype/device)`` (quantize after it), saving a checkpoint (the
quantized Linears have no ``weight`` parameter in ``state_dict``).
"""
from __future__ import annotations

import torch

from tensorpar.comm import Group
from tensorpar.decode.int8 import Int8Weight, free_weight, quantize_rows
from tensorpar.decode.prepare import fuse_projections, lean_unsupported
from tensorpar.hf.families import why_not
from tensorpar.layers.fused import FUSED_KEY, fused_weight

#: values of ``--quantize``
QUANTIZE_CHOICES = ("none", "int8")


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


def _quantize_fused(owner, names: tuple[str, ...]) -> Int8Weight:
    """Quantize the lean path's fused fp weight of ``owner``'s projections ``names`` (whole rows: no collective),
    then free it: each projection module reads its row view of the int8 tensor, and ``owner``'s fused entry
    (:func:`tensorpar.layers.fused.fused_weight`) becomes ``(Int8Weight, fused fp bias or None)``."""
    fw, fb = fused_weight(owner, names)
    w8 = quantize_rows(fw, None, write=False)
    del fw
    off = 0
    for n in names:
        mod = getattr(owner, n)
        rows = mod._parameters["weight"].shape[0]
        free_weight(mod, Int8Weight(w8.q[off:off + rows], w8.scale[off:off + rows]))
        off += rows
    owner.__dict__[FUSED_KEY] = (w8, fb)
    return w8


def _quantize_linear(mod, tp: Group | None) -> Int8Weight:
    """Quantize ``mod.weight`` (``tp``: row-parallel, see :func:`quantize_rows`) and free it."""
    w8 = quantize_rows(mod._parameters["weight"], tp, write=False)
    free_weight(mod, w8)
    return w8


def quantize_int8(model, tp: Group) -> None:
    """Quantize the decoder's Linears and the LM head of ``model`` (sharded by
    :func:`tensorpar.hf.apply.parallelize`, a family the lean path runs) to int8 with per-output-channel scales,
    in place, and free their floating-point weights (see the module docstring): the int8 tensors are read by
    :class:`tensorpar.decode.lean.LeanDecoder`, and the modules' own forwards dequantize one matrix at a time.

    Per-rank resident weights afterwards (``h`` hidden, ``V_r`` this rank's vocabulary rows): one byte per
    quantized weight, one scale (compute dtype) per local output row (row-parallel layers: per global output
    row), the norms and biases in the compute dtype, and an untied embedding ``[V_r, h]`` in the compute dtype (a
    tied one reads the LM head's int8 rows).

    Collectives: one all-reduce (max) of ``[h]`` per row-parallel layer (2 per decoder layer), in layer order on
    every rank. Raises ValueError if the model cannot run the lean path or is already quantized.
    """
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
        free_weight(embed, q["lm_head"])
    model.__dict__["_tensorpar_int8"] = q
    _release_freed_memory(q["lm_head"].device)


def resident_weight_bytes(model) -> int:
    """Bytes of the distinct storages behind ``model``'s tensors on this rank: parameters, buffers, and every
    tensor a module holds outside them (the lean path's fused weights, the int8 weights and scales, the
    oneDNN-packed weights at ``numel * element_size``); a storage shared by several tensors (views, tied weights)
    counts once, at its full size. No collectives."""
    sizes: dict[int, int] = {}

    def add(x, depth=0):
        if isinstance(x, torch.Tensor) and x.is_mkldnn:     # oneDNN-packed (tensorpar.decode.packed): no storage
            sizes[id(x)] = x.numel() * x.element_size()
        elif isinstance(x, torch.Tensor):
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
        quantize_rows(m.weight, None)


# ---------------------------------------------------------------- the --quantize flag (generate, serve, verify)

def add_quantize_argument(p) -> None:
    """``--quantize {none,int8}`` (generate, serve, verify)."""
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="none",
                   help="int8: weight-only int8 with per-output-channel scales for every decoder Linear and the "
                        "LM head (lean decode path; tensorpar/decode/quantize.py)")


def check_quantize(quantize: str, config, plan) -> None:
    """In the launching process: ValueError if ``--quantize int8`` cannot run this model (lean path only)."""
    if quantize == "none":
        return
    why = why_not("fast_decode", config)   # the rule the ranks apply (tensorpar.decode.prepare.lean_unsupported)
    if why is not None:
        raise ValueError(f"--quantize {quantize} runs on the lean decode path, which cannot run this model: {why}; "
                         f"use --quantize none")
    if getattr(plan, "sequence_parallel", False):
        raise ValueError(f"--quantize {quantize} cannot run with sequence parallelism (the lean path does not); "
                         f"use a plan without it or --quantize none")


def apply_quantize(model, tp: Group, quantize: str) -> None:
    """On every rank, after loading: quantize ``model`` in place (:func:`tensorpar.decode.quantize.quantize_int8`)."""
    if quantize == "int8":
        quantize_int8(model, tp)
