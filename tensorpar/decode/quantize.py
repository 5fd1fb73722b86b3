"""int8 quantization for the lean decode path (``--quantize int8``): :func:`quantize_int8` on every rank, the
plain-PyTorch reference (:func:`quantize_reference_int8`) and the ``--quantize`` flag. The int8 format, its matmul
and the modules that read it: :mod:`tensorpar.decode.int8`.

Every Linear of the decoder (the fused q/k/v and gate/up projections, o_proj, down_proj) and the LM head is stored
as ``int8`` with one fp16 scale per block of 32 consecutive input features of each output row (llama.cpp's Q8_0:
symmetric absmax, ``s = max|W_block| / 127``, ``q = round(W / s)`` clamped to [-127, 127]). Each matmul quantizes
its input activations the same way per row and block of 32 (fp32 scales) and multiplies int8 by int8
(:func:`tensorpar.decode.int8.int8_linear`).

Sharding invariance: a block never spans two ranks. Column-parallel layers and the vocabulary-parallel LM head hold
whole rows; row-parallel layers (o_proj, down_proj) hold a slice of every row, and each rank's slice must be a
whole number of blocks (:func:`tensorpar.decode.int8.block_misfit`: refused in the launching process by
:func:`check_quantize` and on the ranks by :func:`quantize_int8`, one line). Then each rank holds exactly its slice
of the full quantized weight and quantizes exactly its slice of the full activation row, so the quantized model at
any tp equals the one at tp=1 up to floating-point summation order (tests/decode/test_quant.py: greedy tokens equal
at tp 1/2/3); quantizing needs no collective.

Memory: the floating-point weights of every quantized Linear are freed (:func:`quantize_int8`): each such module
loses its ``weight`` parameter and becomes :class:`~tensorpar.decode.int8.Int8ColumnParallelLinear` /
:class:`~tensorpar.decode.int8.Int8RowParallelLinear`, whose local product is ``int8_linear`` (the module path,
``path="hf"``, and :mod:`tensorpar.verify` compute what the lean path computes) and whose ``weight`` is a property
that dequantizes ``q * s`` on access; the lean path's fused q/k/v and gate/up fp buffers are replaced by their int8
tensors (the per-projection modules hold row views of them). A tied embedding (SmolLM2) holds the LM head's
dequantized values, so it becomes :class:`~tensorpar.decode.int8.Int8VocabParallelEmbedding`, which looks up and
dequantizes rows of the LM head's int8 tensor; an untied embedding stays in its dtype, unquantized. Resident
weights per rank: one byte per quantized weight plus 2 bytes per 32 (the scales), the norms, biases and an untied
embedding (:func:`resident_weight_bytes`; bench/results/decode_int8.md has the measured bytes and RSS).
Not supported on a quantized model: training, ``.to(dtype/device)`` (quantize after it), saving a checkpoint (the
quantized Linears have no ``weight`` parameter in ``state_dict``).
"""
from __future__ import annotations

import torch

from tensorpar.comm import Group
from tensorpar.decode.int8 import Int8Weight, block_misfit, fake_quantize_input, free_weight, quantize_weight
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
    w8 = quantize_weight(fw, write=False)
    del fw
    off = 0
    for n in names:
        mod = getattr(owner, n)
        rows = mod._parameters["weight"].shape[0]
        free_weight(mod, Int8Weight(w8.q[off:off + rows], w8.scale[off:off + rows], w8.dtype))
        off += rows
    owner.__dict__[FUSED_KEY] = (w8, fb)
    return w8


def _quantize_linear(mod) -> Int8Weight:
    """Quantize ``mod.weight`` (:func:`~tensorpar.decode.int8.quantize_weight`) and free it."""
    w8 = quantize_weight(mod._parameters["weight"], write=False)
    free_weight(mod, w8)
    return w8


def quantize_int8(model, tp: Group) -> None:
    """Quantize the decoder's Linears and the LM head of ``model`` (sharded by
    :func:`tensorpar.hf.apply.parallelize`, a family the lean path runs) to int8 with a scale per block of 32
    inputs, in place, and free their floating-point weights (see the module docstring): the int8 tensors are read by
    :class:`tensorpar.decode.lean.LeanDecoder`, and the modules' own forwards dequantize one matrix at a time.

    Per-rank resident weights afterwards (``h`` hidden, ``V_r`` this rank's vocabulary rows): one byte per
    quantized weight, one fp16 scale per 32 of them, the norms and biases in the compute dtype, and an untied embedding ``[V_r, h]`` in the compute dtype (a
    tied one reads the LM head's int8 rows).

    Collectives: none. Raises ValueError if the model cannot run the lean path, is already quantized, or a
    rank's share of a Linear's input features is not a whole number of blocks of 32 (:func:`block_misfit`).
    """
    why = lean_unsupported(model)
    if why is not None:
        raise ValueError(f"--quantize int8 runs on the lean decode path, which cannot run this model: {why}; "
                         f"use --quantize none")
    why = why_not("int8", model.config)     # the launching process's rule (check_quantize)
    if why is not None:
        raise ValueError(f"{why}; use --quantize none")
    if model.__dict__.get("_tensorpar_int8") is not None:
        raise ValueError("the model is already quantized (quantize_int8 was called twice)")
    a0, m0 = model.model.layers[0].self_attn, model.model.layers[0].mlp
    why = block_misfit({"the hidden size": [model.lm_head.in_features],
                        "o_proj": list(a0.o_proj.partition.sizes), "down_proj": list(m0.down_proj.partition.sizes)})
    if why is not None:
        raise ValueError(why)
    fuse_projections(model)
    head, embed = model.lm_head, model.model.embed_tokens
    tied = head._parameters.get("weight") is embed._parameters.get("weight")
    q = {"dtype": head.weight.dtype}
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        q[id(a)] = {"qkv": _quantize_fused(a, ("q_proj", "k_proj", "v_proj")), "o": _quantize_linear(a.o_proj)}
        q[id(m)] = {"gu": _quantize_fused(m, ("gate_proj", "up_proj")), "down": _quantize_linear(m.down_proj)}
    q["lm_head"] = _quantize_linear(head)
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
    ``s = max|W_block| / 127`` (fp16) per block of 32 inputs, in place, and a forward pre-hook that replaces their
    input by its per-block quantized values (:func:`~tensorpar.decode.int8.fake_quantize_input`). No int8 tensors
    are kept; no collectives."""
    linears = [m for layer in model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    for m in linears + [model.lm_head]:
        quantize_weight(m.weight)
        m.register_forward_pre_hook(lambda mod, args: (fake_quantize_input(args[0]),) + tuple(args[1:]))


# ---------------------------------------------------------------- the --quantize flag (generate, serve, verify)

def add_quantize_argument(p) -> None:
    """``--quantize {none,int8}`` (generate, serve, verify)."""
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="none",
                   help="int8: int8 weights with a scale per block of 32 inputs (llama.cpp's Q8_0) for every decoder "
                        "Linear and the LM head, activations quantized the same way per matmul (lean decode path; "
                        "tensorpar/decode/quantize.py)")


def check_quantize(quantize: str, config, plan) -> None:
    """In the launching process: ValueError if ``--quantize int8`` cannot run this model (lean path only)."""
    if quantize == "none":
        return
    why = why_not("fast_decode", config)   # the rule the ranks apply (tensorpar.decode.prepare.lean_unsupported)
    if why is not None:
        raise ValueError(f"--quantize {quantize} runs on the lean decode path, which cannot run this model: {why}; "
                         f"use --quantize none")
    why = why_not("int8", config)          # the layout quantize_int8 reads: the same rule on the ranks
    if why is not None:
        raise ValueError(f"{why}; use --quantize none")
    if getattr(plan, "sequence_parallel", False):
        raise ValueError(f"--quantize {quantize} cannot run with sequence parallelism (the lean path does not); "
                         f"use a plan without it or --quantize none")
    heads = getattr(plan, "heads", None)
    if heads is not None:       # the rule quantize_int8 applies on the ranks, from the plan's splits
        why = block_misfit({"the hidden size": [config.hidden_size],
                            "o_proj": [heads.local_heads(r) * heads.head_dim for r in range(plan.tp_size)],
                            "down_proj": list(plan.intermediate.sizes)})
        if why is not None:
            raise ValueError(why)


def apply_quantize(model, tp: Group, quantize: str) -> None:
    """On every rank, after loading: quantize ``model`` in place (:func:`tensorpar.decode.quantize.quantize_int8`)."""
    if quantize == "int8":
        quantize_int8(model, tp)
