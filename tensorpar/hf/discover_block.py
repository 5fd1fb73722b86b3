"""What one child of a decoder block is, found from its shapes (:func:`tensorpar.hf.discover.discover_plan` walks the
model and asks here): attention (:func:`_attention`: projections of ``heads x head_dim`` rows, or one fused
projection, and an output projection back to the hidden size), an MLP (:func:`_mlp`: ``h -> f -> h``; an MLP
written into the block itself: :func:`_block_mlp`), a per-hidden module (:func:`_small`: norms, scales) or a sparse
mixture-of-experts block (:func:`_discover_moe`: router, stacked experts, shared experts). Each returns the plan
entry (a style name with its arguments, as in a plan file), None when the child is not of its kind, or raises
:class:`DiscoveryError` naming the module when it is of its kind but a style cannot take it.
"""
from __future__ import annotations

import sys
from typing import NamedTuple

import torch
import torch.nn as nn

OUT = "give the plan yourself with --plan-file (docs/plans.md)"

class DiscoveryError(ValueError):
    """Discovery could not place a module (the message names it and points to ``--plan-file``)."""


def _fail(what: str) -> DiscoveryError:
    return DiscoveryError(f"--discover-plan: {what}; {OUT}")


def _heads(config) -> tuple[int, int, int]:
    nh = getattr(config, "num_attention_heads", None)
    if not nh:
        raise _fail(f"{config.model_type}: the config has no num_attention_heads")
    nkv = getattr(config, "num_key_value_heads", None) or nh
    hd = getattr(config, "head_dim", None) or config.hidden_size // nh
    return int(nh), int(nkv), int(hd)


def _tensors(m: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(m.named_parameters(remove_duplicate=False)) + list(m.named_buffers(remove_duplicate=False))


class _Conv1DShape(NamedTuple):
    """A GPT-2 ``Conv1D`` child (``y = x @ W + b``, weight ``[in, out]``) seen with a linear's shape names."""

    in_features: int
    out_features: int


def _linears(m: nn.Module) -> list[tuple[str, nn.Linear | _Conv1DShape]]:
    """The children of ``m`` that are linear maps: ``nn.Linear``, and transformers' ``Conv1D`` (its ``[in, out]``
    weight read as ``in -> out``; the styles shard it as GPT-2's table does)."""
    from transformers.pytorch_utils import Conv1D

    return [(n, c if isinstance(c, nn.Linear) else _Conv1DShape(*c.weight.shape))
            for n, c in m.named_children() if isinstance(c, (nn.Linear, Conv1D))]


def _kv_heads(config, ins: list, nh: int, hd: int) -> int:
    """The KV heads: the config's ``num_key_value_heads``; a config that states none (GPT-BigCode's and Falcon's
    ``multi_query``) gets them from the shapes: a fused projection of ``(heads + 2 kv) x head_dim`` rows, or key
    rows ``kv x head_dim`` beside the ``heads x head_dim`` query rows; else ``heads``."""
    if getattr(config, "num_key_value_heads", None):
        return int(config.num_key_value_heads)
    rows = sorted({l.out_features for _, l in ins})
    if len(rows) == 1 and rows[0] > nh * hd and (rows[0] // hd - nh) % 2 == 0 and rows[0] % hd == 0:
        kv = (rows[0] // hd - nh) // 2
        return kv if kv and nh % kv == 0 else nh
    kv = [r // hd for r in rows if r != nh * hd and r % hd == 0 and r // hd and nh % (r // hd) == 0]
    return kv[0] if len(kv) == 1 else nh


def _attention(name: str, m: nn.Module, config, h: int) -> dict | None:
    """The ``attention`` entry of module ``m`` when its projections have the head shapes, else None."""
    nh, nkv, hd = _heads(config)
    lin = _linears(m)
    outs = [n for n, l in lin if l.in_features == nh * hd and l.out_features == h]
    o_name = outs[-1] if outs else None
    ins = [(n, l) for n, l in lin if l.in_features == h and n != o_name]
    nkv = _kv_heads(config, ins, nh, hd)
    q_rows = [n for n, l in ins if l.out_features == nh * hd]
    fused = [n for n, l in ins if l.out_features == (nh + 2 * nkv) * hd]
    if o_name is None or not (q_rows or fused):
        if any("attention" in type(x).__name__.lower() for x in m.modules()) and ins:
            rows = ", ".join(f"{n} [{l.out_features}, {l.in_features}]" for n, l in lin)
            raise _fail(f"{name} ({type(m).__name__}) looks like attention but its projections ({rows}) match "
                        f"neither heads x head_dim = {nh}x{hd} query rows (or (heads + 2 kv_heads) x head_dim = "
                        f"{(nh + 2 * nkv) * hd} fused rows) with an output projection {nh * hd} -> {h} (linear "
                        f"attention, or head counts the config does not state)")
        return None
    args: dict = {"heads": nh, "kv_heads": nkv, "head_dim": hd}
    if fused:
        args["fused"] = fused[0]
        proj = {fused[0]}
    else:
        kv = [n for n, l in ins if l.out_features == nkv * hd and n not in q_rows[:1]]
        names = [q_rows[0]] + kv[:2]
        if nkv == nh and sorted(q_rows) == ["k_proj", "q_proj", "v_proj"]:
            names = ["q_proj", "k_proj", "v_proj"]      # one KV head per query head: the three have the same rows
        elif len(kv) < 2 or names != ["q_proj", "k_proj", "v_proj"]:
            raise _fail(f"{name} ({type(m).__name__}): query/key/value projections {', '.join(names)} (rows "
                        f"{nh}x{hd}, {nkv}x{hd}) are not named q_proj, k_proj, v_proj as the attention style needs")
        proj = set(names)
    if o_name != "o_proj":
        args["o_name"] = o_name
    for attr in ("scaling", "layer_idx"):
        if not hasattr(m, attr):
            raise _fail(f"{name} ({type(m).__name__}) has no {attr!r}: its forward is not the standard "
                        f"rotary-decoder attention the attention style runs")
    if not hasattr(sys.modules[type(m).__module__], "eager_attention_forward"):
        raise _fail(f"{name} ({type(m).__name__}): its module defines no eager_attention_forward")
    full = {"q_norm": nh * hd, "k_norm": nkv * hd}           # a norm over the whole projection (OLMo 2)
    for n, t in _tensors(m):
        top = n.split(".")[0]
        if top in proj or top == o_name:
            continue
        if top in ("q_norm", "k_norm") and t.numel() == hd:
            continue                                         # per head: [head_dim], replicated
        if top in full and n == f"{top}.weight" and t.numel() == full[top] and not fused and o_name == "o_proj":
            args["qk_norm"] = "full"                         # sharded with its heads, sum of squares all-reduced
            continue
        if n == "sinks" and tuple(t.shape) == (nh,):
            continue                                         # per head: sharded with the query heads
        raise _fail(f"{name}.{n} {list(t.shape)} ({type(m).__name__}) is neither a projection nor a per-head "
                    f"parameter ([head_dim]={hd} norms, [heads]={nh} sinks, q/k norms over the whole projection "
                    f"[{nh * hd}], [{nkv * hd}])")
    return {"style": "attention", **args}


def _mlp(name: str, m: nn.Module, h: int) -> dict | None:
    """The ``gated_mlp`` / ``mlp`` entry of ``m`` when its linears go ``h -> f -> h``, else None."""
    lin = _linears(m)
    downs = [(n, l) for n, l in lin if l.out_features == h and l.in_features != h]
    if len(downs) != 1 or len(lin) > 3:
        return None
    down, f = downs[0][0], downs[0][1].in_features
    ups = [n for n, l in lin if l.in_features == h and l.out_features == f]
    fused = [n for n, l in lin if l.in_features == h and l.out_features == 2 * f]
    if len(ups) == 2 or fused:
        gate = sorted(ups) if ups else []
        if (ups and gate != ["gate_proj", "up_proj"]) or down != "down_proj":
            raise _fail(f"{name} ({type(m).__name__}) is a gated MLP whose projections "
                        f"{', '.join(ups or fused)} -> {down} are not named gate_proj, up_proj -> down_proj as "
                        f"the gated_mlp style needs")
        style = {"style": "gated_mlp", **({"fused": fused[0]} if fused else {})}
    elif len(ups) == 1 and len(lin) == 2:
        if not any(hasattr(m, a) for a in ("act_fn", "activation_fn", "act")):
            raise _fail(f"{name} ({type(m).__name__}) has no act_fn / activation_fn / act the mlp style calls")
        style = {"style": "mlp", "up": ups[0], "down": down}
    else:
        return None
    proj = {down, *ups, *fused}
    extra = [f"{n} {list(t.shape)}" for n, t in _tensors(m) if n.split(".")[0] not in proj]
    if extra:
        raise _fail(f"{name} ({type(m).__name__}) holds {', '.join(extra[:4])} besides its projections (a "
                    f"parametrised activation?): the {style['style']} style would lose them")
    return style


def _num_experts(config) -> int | None:
    """The routed experts per MoE layer the config states (the field's name varies by family)."""
    for k in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"):
        v = getattr(config, k, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _router(m: nn.Module, e: int, h: int) -> bool:
    """A router: one ``[E, h]`` weight (a linear to the expert logits), maybe ``[E]`` biases / score corrections."""
    ts = [t for _, t in _tensors(m)]
    return sum(tuple(t.shape) == (e, h) for t in ts) == 1 and \
        all(tuple(t.shape) == (e, h) or t.numel() == e for t in ts)


def _experts(where: str, m: nn.Module, e: int, h: int) -> dict | None:
    """The ``moe_experts`` entry of stacked experts (``gate_up_proj [E, 2f, h]``, ``down_proj [E, h, f]``), None
    when ``m`` holds no ``[E, ...]`` 3-D tensor or list of ``E`` modules; a layout the style cannot split fails."""
    from tensorpar.hf.user_styles import _stacked_experts

    ts = _tensors(m)
    if isinstance(m, nn.ModuleList) and len(m) == e:
        raise _fail(f"{where} ({type(m).__name__}) is a list of {e} expert modules: the moe_experts style splits "
                    f"stacked experts (gate_up_proj [E, 2f, h], down_proj [E, h, f])")
    if not any(t.dim() == 3 and t.shape[0] == e for _, t in ts):
        return None
    try:
        ne, f = _stacked_experts(where, m)
    except ValueError as err:
        raise _fail(f"{where} ({type(m).__name__}): {str(err).split(': ', 1)[1]}") from None
    extra = [f"{n} {list(t.shape)}" for n, t in ts if n not in ("gate_up_proj", "down_proj")]
    if ne != e or extra or tuple(m.gate_up_proj.shape[2:]) != (h,):
        raise _fail(f"{where} ({type(m).__name__}) holds {', '.join(extra) or f'{ne} experts of width {h}'} "
                    f"besides {e} stacked experts gate_up_proj [E, 2f, {h}], down_proj [E, {h}, f]")
    return {"style": "moe_experts"}


def _discover_moe(where: str, m: nn.Module, config, h: int) -> dict[str, dict] | None:
    """The entries of a sparse mixture-of-experts block ``m`` (``{"": style}`` for the whole block, or
    ``{".child": style}``), None when ``m`` holds no experts. Found by shape: the router (one ``[E, h]`` weight,
    ``E`` the config's expert count: replicated, so every rank routes every token alike), the stacked experts
    (``moe_experts``: every expert split over its intermediate size, one all-reduce after the combine), shared
    experts (an MLP ``h -> f -> h``: ``gated_mlp`` / ``mlp``) and a shared-expert gate (``[1, h]``: replicated).
    A block of exactly router ``gate``, ``experts``, a gated ``shared_expert`` and ``shared_expert_gate``
    (Qwen2-MoE) is one ``moe_block`` entry, as in the table: routed and shared experts reduced together.
    Anything else in the block fails, naming it."""
    e = _num_experts(config)
    kids = [(n, c) for n, c in m.named_children() if _tensors(c)]
    if e is None or not any(_experts(f"{where}.{n}", c, e, h) for n, c in kids):
        return None
    jitter = getattr(config, "router_jitter_noise", 0.0) or 0.0
    if jitter:
        raise _fail(f"{where}: router_jitter_noise={jitter}: the router's training-time jitter is not the same on "
                    f"every rank (tokens would be routed differently); set router_jitter_noise=0.0")
    own = [f"{n} {list(t.shape)}" for n, t in m.named_parameters(recurse=False)]
    own += [f"{n} {list(t.shape)}" for n, t in m.named_buffers(recurse=False)]
    if own:
        raise _fail(f"{where} ({type(m).__name__}) holds {', '.join(own[:4])} besides its router and experts")
    out: dict[str, dict] = {}
    for n, c in kids:
        sub = f"{where}.{n}"
        if _router(c, e, h):
            out[f".{n}"] = {"style": "replicated", "why": "router: every rank routes every token"}
        elif tuple(getattr(c, "weight", torch.empty(0)).shape) == (1, h) and _router(c, 1, h):
            out[f".{n}"] = {"style": "replicated", "why": "shared-expert gate"}
        else:
            style = _experts(sub, c, e, h) or _mlp(sub, c, h)
            if style is None:
                shapes = ", ".join(f"{k} {list(t.shape)}" for k, t in _tensors(c)[:4])
                raise _fail(f"cannot place {sub} ({type(c).__name__}: {shapes}) in a mixture-of-experts block as "
                            f"a router ([{e}, {h}]), stacked experts, a shared expert MLP or a [1, {h}] gate")
            out[f".{n}"] = style
    styles = {k: v["style"] for k, v in out.items()}
    routers = [k for k, v in out.items() if v.get("why", "").startswith("router")]
    if len(routers) != 1 or list(styles.values()).count("moe_experts") != 1:
        raise _fail(f"{where} ({type(m).__name__}) holds {len(routers)} routers ([{e}, {h}] weights) and "
                    f"{list(styles.values()).count('moe_experts')} stacked experts; a sparse block has one of each")
    if styles == {".gate": "replicated", ".experts": "moe_experts", ".shared_expert": "gated_mlp",
                  ".shared_expert_gate": "replicated"} and routers == [".gate"] and \
            "fused" not in out[".shared_expert"]:
        return {"": {"style": "moe_block"}}
    return out


def _block_mlp(bname: str, block: nn.Module, h: int) -> dict:
    """An MLP written into the block itself (OPT, BioGPT: ``fc1`` h -> f and ``fc2`` f -> h are children of the
    block, the activation its attribute): ``column`` and ``row`` entries on the two linears, the block's forward
    kept. Empty when the block holds no such pair."""
    lin = [(n, l) for n, l in block.named_children() if isinstance(l, nn.Linear)]
    ups = [(n, l) for n, l in lin if l.in_features == h and l.out_features != h]
    downs = [(n, l) for n, l in lin if l.out_features == h and l.in_features != h]
    if len(lin) != 2 or len(ups) != 1 or len(downs) != 1 or ups[0][1].out_features != downs[0][1].in_features:
        return {}
    if not any(hasattr(block, a) for a in ("act_fn", "activation_fn", "act")):
        raise _fail(f"{bname}.0 ({type(block).__name__}) holds {ups[0][0]} and {downs[0][0]} itself but no "
                    f"act_fn / activation_fn / act between them")
    return {f"{bname}.*.{ups[0][0]}": {"style": "column"}, f"{bname}.*.{downs[0][0]}": {"style": "row"}}


def _small(m: nn.Module, h: int) -> bool:
    return all(t.dim() <= 1 and t.numel() <= h for _, t in _tensors(m))
