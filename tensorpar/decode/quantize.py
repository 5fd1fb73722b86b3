"""The weight storage formats of the lean decode path (``--quantize``): int8 (:func:`quantize_int8` on every rank, the
plain-PyTorch reference :func:`quantize_reference_int8`), bf16 weights computing in fp32 (:func:`store_bf16`,
:mod:`tensorpar.decode.bf16_weights`; llama.cpp's BF16) and the ``--quantize`` flag. The int8 format, its matmul
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

import itertools

import torch

from tensorpar.comm import Group
from tensorpar.decode.bf16_weights import Bf16Weight, to_bf16
from tensorpar.decode.int8 import Int8Weight, block_misfit, fake_quantize_input, free_weight, quantize_weight
from tensorpar.decode.packed import unpack_weights
from tensorpar.decode.prepare import fuse_projections, lean_unsupported
from tensorpar.hf.families import why_not
from tensorpar.layers.fused import FUSED_KEY, fused_weight

#: values of ``--quantize``
QUANTIZE_CHOICES = ("none", "int8", "bf16")


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


def _quantize_fused(owner, names: tuple[str, ...], convert) -> Int8Weight | Bf16Weight:
    """Convert the lean path's fused fp weight of ``owner``'s projections ``names`` (whole rows: no collective;
    ``convert(w, cuts)``: :func:`~tensorpar.decode.int8.quantize_weight` or
    :func:`~tensorpar.decode.bf16_weights.to_bf16`, ``cuts`` the rows where the projections' views start after the
    first),
    then free it: each projection module reads its row view of the new tensors, and ``owner``'s fused entry
    (:func:`tensorpar.layers.fused.fused_weight`) becomes ``(stored weight, fused fp bias or None)``."""
    fw, fb = fused_weight(owner, names)
    sizes = [getattr(owner, n)._parameters["weight"].shape[0] for n in names]
    w8 = convert(fw, tuple(itertools.accumulate(sizes[:-1])))      # where the row views start
    del fw
    off = 0
    for n in names:
        mod = getattr(owner, n)
        rows = mod._parameters["weight"].shape[0]
        free_weight(mod, w8.narrow(off, rows))
        off += rows
    owner.__dict__[FUSED_KEY] = (w8, fb)
    return w8


def _quantize_linear(mod, convert) -> Int8Weight | Bf16Weight:
    """Convert ``mod.weight`` (``convert`` as in :func:`_quantize_fused`) and free it."""
    w8 = convert(mod._parameters["weight"], ())
    free_weight(mod, w8)
    return w8


def _int8(w: torch.Tensor, cuts: tuple[int, ...] = ()) -> Int8Weight:
    return quantize_weight(w, write=False)


def _store(model, fmt: str) -> None:
    """Convert the decoder's Linears and the LM head of ``model`` to format ``fmt`` (``int8``, ``bf16``) in place
    and free their fp weights (see :func:`quantize_int8`, :func:`store_bf16`)."""
    why = lean_unsupported(model)
    if why is not None:
        raise ValueError(f"--quantize {fmt} runs on the lean decode path, which cannot run this model: {why}; "
                         f"use --quantize none")
    why = why_not("int8", model.config)     # the launching process's rule (check_quantize)
    if why is not None:
        raise ValueError(f"{why.replace('--quantize int8', f'--quantize {fmt}')}; use --quantize none")
    if model.__dict__.get("_tensorpar_int8") is not None:
        raise ValueError("the model is already quantized (--quantize applied twice)")
    unpack_weights(model)       # a decoder packed or blocked them (a model marked inference_only keeps them so)
    head, embed = model.lm_head, model.model.embed_tokens
    if fmt == "bf16":
        why = bf16_misfit(head.weight.dtype)
        if why is not None:
            raise ValueError(why)
    else:
        a0, m0 = model.model.layers[0].self_attn, model.model.layers[0].mlp
        why = block_misfit({"the hidden size": [model.lm_head.in_features], "o_proj": list(a0.o_proj.partition.sizes),
                            "down_proj": list(m0.down_proj.partition.sizes)})
        if why is not None:
            raise ValueError(why)
    convert = _int8 if fmt == "int8" else to_bf16
    fuse_projections(model)
    tied = head._parameters.get("weight") is embed._parameters.get("weight")
    q = {"dtype": head.weight.dtype, "format": fmt}
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        q[id(a)] = {"qkv": _quantize_fused(a, ("q_proj", "k_proj", "v_proj"), convert),
                    "o": _quantize_linear(a.o_proj, convert)}
        q[id(m)] = {"gu": _quantize_fused(m, ("gate_proj", "up_proj"), convert),
                    "down": _quantize_linear(m.down_proj, convert)}
    q["lm_head"] = _quantize_linear(head, convert)
    if tied:      # the shared table held the LM head's values: the embedding now reads the head's stored rows
        free_weight(embed, q["lm_head"])
    model.__dict__["_tensorpar_int8"] = q
    _release_freed_memory(q["lm_head"].device)


def quantize_int8(model, tp: Group) -> None:
    """Quantize the decoder's Linears and the LM head of ``model`` (sharded by
    :func:`tensorpar.hf.apply.parallelize`, a family the lean path runs) to int8 with a scale per block of 32
    inputs, in place, and free their floating-point weights (see the module docstring): the int8 tensors are read by
    :class:`tensorpar.decode.lean.LeanDecoder`, and the modules' own forwards dequantize one matrix at a time.

    Per-rank resident weights afterwards (``h`` hidden, ``V_r`` this rank's vocabulary rows): one byte per
    quantized weight, one fp16 scale per 32 of them, the norms and biases in the compute dtype, and an untied
    embedding ``[V_r, h]`` in the compute dtype (a tied one reads the LM head's int8 rows).

    Collectives: none. Raises ValueError if the model cannot run the lean path, is already quantized, or a
    rank's share of a Linear's input features is not a whole number of blocks of 32 (:func:`block_misfit`).
    """
    _store(model, "int8")


def bf16_misfit(dtype) -> str | None:
    """``--quantize bf16`` stores the weights of a model that computes in fp32: ``None`` for float32 (``dtype``: a
    torch dtype or its name), else the line saying so. The launching process (:func:`check_quantize`, from
    ``--dtype``) and the ranks (:func:`store_bf16`, from the model) apply it."""
    if dtype in (torch.float32, "float32"):
        return None
    name = str(dtype).replace("torch.", "")
    return f"--quantize bf16 with --dtype {name}: the weights are not fp32 (use --dtype float32, or --quantize none)"


def store_bf16(model, tp: Group) -> None:
    """Store the decoder's Linears and the LM head of the fp32 ``model`` (sharded, a family ``--quantize int8``
    runs) in bfloat16, in place, and free their fp32 weights (llama.cpp's BF16 file type): the model keeps
    computing in fp32 (norms, activations, KV cache); the lean path reads the bf16 tensors
    (:class:`~tensorpar.decode.bf16_weights.Bf16Weight`, the row step included), the modules' ``weight`` converts
    to fp32 on access and their local product is :func:`~tensorpar.decode.bf16_weights.bf16_linear`; a tied
    embedding looks up the head's bf16 rows. Per-rank resident weights: 2 bytes per stored weight, the norms,
    biases and an untied embedding in fp32. Collectives: none. Raises ValueError if the model cannot run the lean
    path, is already quantized, or does not compute in fp32 (:func:`bf16_misfit`)."""
    _store(model, "bf16")


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


def quantize_reference(model, quantize: str) -> None:
    """The reference side of ``verify --quantize``: :func:`quantize_reference_int8` or
    :func:`~tensorpar.decode.bf16_weights.quantize_reference_bf16` on an unsharded model (nothing for ``none``)."""
    if quantize == "int8":
        quantize_reference_int8(model)
    elif quantize == "bf16":
        from tensorpar.decode.bf16_weights import quantize_reference_bf16
        quantize_reference_bf16(model)


# ---------------------------------------------------------------- the --quantize flag (generate, serve, verify)

def add_quantize_argument(p, choices: tuple[str, ...] = QUANTIZE_CHOICES) -> None:
    """``--quantize {none,int8,bf16}`` (generate, serve, verify)."""
    p.add_argument("--quantize", choices=choices, default="none",
                   help="the weight storage format of every decoder Linear and the LM head (lean decode path; "
                        "tensorpar/decode/quantize.py): int8: int8 weights with a scale per block of 32 inputs "
                        "(llama.cpp's Q8_0), activations quantized the same way per matmul; bf16 (an fp32 model, "
                        "--dtype float32): bf16 weights, computing in fp32 (llama.cpp's BF16)")


def check_quantize(quantize: str, config, plan, dtype: str = "float32") -> None:
    """In the launching process: ValueError if ``--quantize`` ``quantize`` cannot run this model (lean path only)
    or, for ``bf16``, with ``--dtype`` ``dtype`` (:func:`bf16_misfit`): the rules the ranks apply."""
    if quantize == "none":
        return
    why = why_not("fast_decode", config)   # the rule the ranks apply (tensorpar.decode.prepare.lean_unsupported)
    if why is not None:
        raise ValueError(f"--quantize {quantize} runs on the lean decode path, which cannot run this model: {why}; "
                         f"use --quantize none")
    why = why_not("int8", config)          # the layout quantize_int8 / store_bf16 read: the same rule on the ranks
    if why is not None:
        raise ValueError(f"{why.replace('--quantize int8', f'--quantize {quantize}')}; use --quantize none")
    if getattr(plan, "sequence_parallel", False):
        raise ValueError(f"--quantize {quantize} cannot run with sequence parallelism (the lean path does not); "
                         f"use a plan without it or --quantize none")
    if quantize == "bf16":
        why = bf16_misfit(dtype)
        if why is not None:
            raise ValueError(why)
        return
    heads = getattr(plan, "heads", None)
    if heads is not None:       # the rule quantize_int8 applies on the ranks, from the plan's splits
        why = block_misfit({"the hidden size": [config.hidden_size],
                            "o_proj": [heads.local_heads(r) * heads.head_dim for r in range(plan.tp_size)],
                            "down_proj": list(plan.intermediate.sizes)})
        if why is not None:
            raise ValueError(why)


def apply_quantize(model, tp: Group, quantize: str) -> None:
    """On every rank, after loading: convert ``model``'s weights in place (:func:`quantize_int8`,
    :func:`store_bf16`)."""
    if quantize == "int8":
        quantize_int8(model, tp)
    elif quantize == "bf16":
        store_bf16(model, tp)
