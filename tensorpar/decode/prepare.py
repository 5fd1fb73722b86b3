"""What the lean decode path needs of a sharded model: whether it can run it (:func:`lean_unsupported`, the one
decision of which path runs, read by the engine, ``verify`` and ``--quantize``) and its fused q/k/v and gate/up
projections (:func:`fuse_projections`). Shared by :mod:`tensorpar.decode.lean` and :mod:`tensorpar.decode.quantize`.
"""
from __future__ import annotations

from tensorpar.hf.families import why_not
from tensorpar.hf.modules import (TPAttention, TPExperts, TPGatedMLP, TPGPTNeoXAttention, TPMLP,
                                  TPSharedExpertMoE)
from tensorpar.layers.fused import fuse_linears, fused_weight


def lean_unsupported(model) -> str | None:
    """Why ``model`` (sharded by :func:`tensorpar.hf.apply.parallelize`) cannot run
    :class:`~tensorpar.decode.lean.LeanDecoder`, or ``None`` if it can."""
    why = why_not("fast_decode", model.config)   # the family's record and the config's window: the parent's rule
    if why is not None:
        return why
    parts = decoder_parts(model)
    if parts is None:
        return ("not a decoder with model.embed_tokens / layers / norm / rotary_emb (or gpt_neox.embed_in / layers / "
                "final_layer_norm / rotary_emb)")
    if getattr(model.tensorpar_plan, "sequence_parallel", False):
        return "sequence parallelism"
    stage = getattr(model, "tensorpar_stage", None)     # a pipeline stage holds only its layers
    for layer in (parts[1] if stage is None else [parts[1][i] for i in stage.layers]):
        if isinstance(getattr(layer, "attention", None), TPGPTNeoXAttention):
            if type(layer.mlp) is not TPMLP:
                return f"layer {layer.attention.layer_idx}'s MLP is not a TPMLP"
            continue
        a, m = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        moe = type(m) is TPSharedExpertMoE or isinstance(getattr(m, "experts", None), TPExperts)
        if not isinstance(a, TPAttention) or not (type(m) in (TPGatedMLP, TPMLP) or moe):
            return f"layer {getattr(a, 'layer_idx', '?')} is not TPAttention + TPGatedMLP / TPMLP / tp experts"
        if not (hasattr(layer, "input_layernorm") or hasattr(layer, "post_feedforward_layernorm")):
            return f"layer {a.layer_idx} has neither input_layernorm nor post_feedforward_layernorm"
        for mod in (a.output_dropout, getattr(m, "output_dropout", None)):
            if mod is not None and mod.training and getattr(mod, "p", 1.0) > 0:
                return "output dropout in training mode"
        if a._rope is None:
            return "no apply_rotary_pos_emb in the family module"
        if a.sinks is not None:
            return "attention sinks"
    return None


def decoder_parts(model):
    """``(embed, layers, final_norm, rotary_emb)`` of a ``*ForCausalLM`` laid out as Llama's ``model.*`` or
    GPT-NeoX's ``gpt_neox.*`` (``embed_in``, ``final_layer_norm``), or ``None`` for another layout."""
    for base, names in (("model", ("embed_tokens", "layers", "norm", "rotary_emb")),
                        ("gpt_neox", ("embed_in", "layers", "final_layer_norm", "rotary_emb"))):
        b = getattr(model, base, None)
        if b is not None and all(hasattr(b, n) for n in names):
            return tuple(getattr(b, n) for n in names)
    return None


def fuse_projections(model) -> None:
    """Fuse, on this rank, each :class:`TPAttention`'s q/k/v weights into one ``[q_local*d + 2*kv_local*d, h]``
    tensor and each :class:`TPGatedMLP`'s gate/up weights into one ``[2*f_r, h]`` tensor.

    The original parameters become views of the fused tensors (same names, same values, no extra memory); the
    modules' forwards use the fused tensor when gradients are off. Idempotent; re-fuses after a ``.to(dtype)``.
    No collectives.
    """
    for mod in model.modules():
        if isinstance(mod, TPAttention) and not mod.fused:
            names = ("q_proj", "k_proj", "v_proj")
        elif type(mod) is TPGatedMLP and not mod.fused:
            names = ("gate_proj", "up_proj")
        else:
            continue
        if fused_weight(mod, names) is None:
            fuse_linears(mod, names)
