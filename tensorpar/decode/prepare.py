"""What the lean decode path needs of a sharded model: whether it can run it (:func:`lean_unsupported`, the one
decision of which path runs, read by the engine, ``verify`` and ``--quantize``) and its fused q/k/v and gate/up
projections (:func:`fuse_projections`). Shared by :mod:`tensorpar.decode.lean` and :mod:`tensorpar.decode.quantize`.
"""
from __future__ import annotations

from tensorpar.hf.families import why_not
from tensorpar.hf.modules import TPAttention, TPGatedMLP
from tensorpar.layers.fused import fuse_linears, fused_weight


def lean_unsupported(model) -> str | None:
    """Why ``model`` (sharded by :func:`tensorpar.hf.apply.parallelize`) cannot run
    :class:`~tensorpar.decode.lean.LeanDecoder`, or ``None`` if it can."""
    why = why_not("fast_decode", model.config)   # the family's record and the config's window: the parent's rule
    if why is not None:
        return why
    base = getattr(model, "model", None)
    if base is None or not all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "not a decoder with model.embed_tokens / layers / norm / rotary_emb"
    if getattr(model.tensorpar_plan, "sequence_parallel", False):
        return "sequence parallelism"
    stage = getattr(model, "tensorpar_stage", None)     # a pipeline stage holds only its layers
    for layer in (base.layers if stage is None else [base.layers[i] for i in stage.layers]):
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


def fuse_projections(model) -> None:
    """Fuse, on this rank, each :class:`TPAttention`'s q/k/v weights into one ``[q_local*d + 2*kv_local*d, h]``
    tensor and each :class:`TPGatedMLP`'s gate/up weights into one ``[2*f_r, h]`` tensor.

    The original parameters become views of the fused tensors (same names, same values, no extra memory); the
    modules' forwards use the fused tensor when gradients are off. Idempotent; re-fuses after a ``.to(dtype)``.
    No collectives.
    """
    for mod in model.modules():
        if type(mod) is TPAttention and not mod.fused:
            names = ("q_proj", "k_proj", "v_proj")
        elif type(mod) is TPGatedMLP and not mod.fused:
            names = ("gate_proj", "up_proj")
        else:
            continue
        if fused_weight(mod, names) is None:
            fuse_linears(mod, names)
