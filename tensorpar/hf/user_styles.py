"""The style builders of a user plan (``--plan-file``, :mod:`tensorpar.hf.user_plan`): :data:`STYLES` maps each
style name of a plan entry to the function that checks the entry against the first module it matches and builds the
:class:`~tensorpar.hf.styles.Style` (``heads x head_dim`` against the projections' rows, sizes against the module,
argument names), each failure a ValueError naming the entry (``plan entry 'P'``). The arguments each style takes
are documented in docs/plans.md.
"""
from __future__ import annotations

import torch.nn as nn

from tensorpar.hf.plan import _get
from tensorpar.hf.styles import (MLP, Attention, ColumnLinear, Conv1DAttention, Conv1DMLP, EncoderAttention,
                                 FullWidthQKNormAttention, GatedMLP, LMHead, MoEExperts, NeoXAttention, Replicated,
                                 RowLinear, SharedExpertMoE, VocabEmbedding)
from tensorpar.layers.attention import HeadLayout
from tensorpar.shard import Partition


def _out(model_mod: nn.Module, name: str, what: str, entry: str) -> nn.Linear:
    m = getattr(model_mod, name, None)
    if m is None or not hasattr(m, "weight"):
        kids = ", ".join(n for n, _ in model_mod.named_children()) or "none"
        raise ValueError(f"plan entry {entry!r}: {type(model_mod).__name__} has no {what} {name!r} "
                         f"(its submodules: {kids})")
    return m


def _looks_like_attention(m: nn.Module) -> bool:
    return "Attention" in type(m).__name__ or any(hasattr(m, a) for a in ("q_proj", "qkv_proj", "c_attn", "query"))


def _count(entry, args, key):
    """An entry's ``heads`` / ``kv_heads`` / ``head_dim``: a positive integer, or None when left out."""
    v = args.pop(key, None)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(f"plan entry {entry!r}: \"{key}\" must be a positive integer (or left out: the config's "
                         f"value), got {v!r}")
    return v


def _heads(entry, config, tp_size, args, weights, encoder=False) -> HeadLayout:
    given = {k: _count(entry, args, k) for k in ("heads", "kv_heads", "head_dim")}
    nh = given["heads"] or _get(config, "num_attention_heads")
    if nh is None:
        raise ValueError(f"plan entry {entry!r}: the config has no num_attention_heads; give \"heads\"")
    nkv = given["kv_heads"] or (nh if encoder else _get(config, "num_key_value_heads", default=nh))
    hd = given["head_dim"] or _get(config, "head_dim", default=config.hidden_size // nh)
    try:
        return HeadLayout.make(int(nh), int(nkv), int(hd), tp_size, split_weights=weights)
    except ValueError as e:
        cfg_nh = _get(config, "num_attention_heads")
        hint = (f" (the config's: heads={cfg_nh}, kv_heads={_get(config, 'num_key_value_heads', default=cfg_nh)})"
                if any(given[k] is not None for k in ("heads", "kv_heads")) and cfg_nh else "")
        raise ValueError(f"plan entry {entry!r}: {e}{hint}") from None


def _rows_check(entry, mod, proj, want, what, lay):
    got = proj.weight.shape[0]
    if got != want:
        raise ValueError(f"plan entry {entry!r}: {what} = {want} rows but {type(mod).__name__} has {got}; a split "
                         f"by these sizes would cut a head (heads={lay.num_heads}, kv_heads={lay.num_kv_heads}, "
                         f"head_dim={lay.head_dim}): give the heads, kv_heads and head_dim of this module")


def _head_check(entry, mod, lay, o_name, ctx):
    """The head structure a rank will compute with, checked on the meta model: row counts can match with other
    heads and head_dim (8 heads of 4 rows for 4 of 8) and pass :func:`_rows_check`, then fail on a rank. The ranks'
    rules: the output projection's row-parallel split is ``heads x head_dim`` of its input features
    (:class:`~tensorpar.layers.RowParallelLinear` refuses another), and the heads are as wide as the module's own
    ``head_dim`` (``head_size``: GPT-NeoX, ``attention_head_size``: ViT), the width its rotary tables, scaling
    and per-head norms are built for (another width fails in the rotary kernel). One line naming the plan file,
    the entry, the value and the heads that fit."""
    where = f"plan entry {entry!r} ({ctx['source']})"
    o = _out(mod, o_name, "output projection", entry)
    o_in = getattr(o, "in_features", None) or o.weight.shape[0]          # nn.Linear, else Conv1D [in, out]
    if o_in != lay.num_heads * lay.head_dim:
        raise ValueError(f"{where}: heads x head_dim = {lay.num_heads}x{lay.head_dim} = "
                         f"{lay.num_heads * lay.head_dim} but {type(mod).__name__}.{o_name} takes {o_in} input "
                         f"features (heads={lay.num_heads}, kv_heads={lay.num_kv_heads}, head_dim={lay.head_dim}): "
                         f"give the heads, kv_heads and head_dim of this module")
    hd = next((v for a in ("head_dim", "head_size", "attention_head_size")
               if isinstance(v := getattr(mod, a, None), int) and not isinstance(v, bool) and v > 0), None)
    if hd is None or hd == lay.head_dim:
        return
    fit = ""
    if (lay.num_heads * lay.head_dim) % hd == 0 and (lay.num_kv_heads * lay.head_dim) % hd == 0:
        fit = (f": give heads={lay.num_heads * lay.head_dim // hd}, kv_heads={lay.num_kv_heads * lay.head_dim // hd}, "
               f"head_dim={hd}")
    raise ValueError(f"{where}: head_dim={lay.head_dim} (heads={lay.num_heads}, kv_heads={lay.num_kv_heads}) but "
                     f"{type(mod).__name__}'s heads are {hd} wide (its head_dim: its rotary tables, scaling and "
                     f"per-head norms are built for it); the rows match, the heads do not{fit}")


def _conv1d(m) -> bool:
    """A transformers ``Conv1D`` (GPT-2's projections: weight ``[in, out]``)."""
    from transformers.pytorch_utils import Conv1D
    return isinstance(m, Conv1D)


def _conv1d_names(entry, mod, got: tuple, want: tuple):
    if got != want:
        raise ValueError(f"plan entry {entry!r}: {type(mod).__name__} projects with GPT-2's Conv1D; the Conv1D "
                         f"style takes projections named {', '.join(want)}, got {', '.join(map(str, got))}")


def _attention(entry, mod, config, tp_size, args, ctx):
    fused, o_name = args.pop("fused", None), args.pop("o_name", "o_proj")
    lay = _heads(entry, config, tp_size, args, ctx["head_split_weights"])
    if fused and _conv1d(_out(mod, fused, "fused projection", entry)):   # GPT-2: c_attn [h, 3h], c_proj
        _conv1d_names(entry, mod, (fused, o_name), ("c_attn", "c_proj"))
        if lay.num_kv_heads != lay.num_heads or mod.c_attn.weight.shape[1] != 3 * lay.num_heads * lay.head_dim:
            raise ValueError(f"plan entry {entry!r}: the Conv1D attention style takes c_attn [h, 3 x heads x "
                             f"head_dim] with one KV head per query head; got {tuple(mod.c_attn.weight.shape)}, "
                             f"kv_heads={lay.num_kv_heads}")
        _head_check(entry, mod, lay, o_name, ctx)
        return Conv1DAttention(lay)
    layout = args.pop("fused_layout", "qkv")
    if layout not in ("qkv", "per_head") or (layout == "per_head" and (
            (fused, o_name) != ("query_key_value", "dense") or lay.num_kv_heads != lay.num_heads)):
        raise ValueError(f"plan entry {entry!r}: fused_layout={layout!r}; 'qkv' (rows [q heads | k heads | v heads]) "
                         f"or 'per_head' (rows [h0: q, k, v | h1: ...], GPT-NeoX's: fused 'query_key_value', o_name "
                         f"'dense', one KV head per query head)")
    if layout == "per_head":
        _rows_check(entry, mod, _out(mod, fused, "fused projection", entry), 3 * lay.num_heads * lay.head_dim,
                    "3 x heads x head_dim", lay)
        _head_check(entry, mod, lay, o_name, ctx)
        return NeoXAttention(lay, sequence_parallel=args.pop("sequence_parallel", ctx["sequence_parallel"]))
    if fused:
        _rows_check(entry, mod, _out(mod, fused, "fused projection", entry),
                    (lay.num_heads + 2 * lay.num_kv_heads) * lay.head_dim, "(heads + 2 kv_heads) x head_dim", lay)
    else:
        _rows_check(entry, mod, _out(mod, "q_proj", "projection", entry), lay.num_heads * lay.head_dim,
                    "heads x head_dim", lay)
        for p in ("k_proj", "v_proj"):
            _rows_check(entry, mod, _out(mod, p, "projection", entry), lay.num_kv_heads * lay.head_dim,
                        "kv_heads x head_dim", lay)
    _head_check(entry, mod, lay, o_name, ctx)
    sp = args.pop("sequence_parallel", ctx["sequence_parallel"])
    qk_norm = args.pop("qk_norm", "head")
    if qk_norm == "full":       # OLMo 2's q/k RMSNorms over the whole projection: sharded with the heads
        if fused or o_name != "o_proj":
            raise ValueError(f"plan entry {entry!r}: qk_norm='full' takes separate q_proj, k_proj, v_proj and "
                             f"o_proj (fused={fused!r}, o_name={o_name!r})")
        for norm, rows in (("q_norm", lay.num_heads), ("k_norm", lay.num_kv_heads)):
            w = getattr(getattr(mod, norm, None), "weight", None)
            if w is None or w.numel() != rows * lay.head_dim:
                raise ValueError(f"plan entry {entry!r}: qk_norm='full' needs {norm}.weight of {rows}x"
                                 f"{lay.head_dim} = {rows * lay.head_dim} elements; {type(mod).__name__} has "
                                 f"{None if w is None else w.numel()}")
        return FullWidthQKNormAttention(lay, sequence_parallel=sp)
    if qk_norm != "head":
        raise ValueError(f"plan entry {entry!r}: qk_norm={qk_norm!r}; one of 'head' (per-head q/k norms, "
                         f"replicated) or 'full' (norms over the whole projection, sharded with the heads)")
    return Attention(lay, sequence_parallel=sp, fused=fused, o_name=o_name)


def _encoder_attention(entry, mod, config, tp_size, args, ctx):
    o_name = args.pop("o_name", "o_proj")
    lay = _heads(entry, config, tp_size, args, ctx["head_split_weights"], encoder=True)
    for p in ("q_proj", "k_proj", "v_proj"):
        _rows_check(entry, mod, _out(mod, p, "projection", entry), lay.num_heads * lay.head_dim,
                    "heads x head_dim", lay)
    _head_check(entry, mod, lay, o_name, ctx)
    return EncoderAttention(lay, o_name=o_name)


def _not_attention(entry, mod, style):
    if _looks_like_attention(mod):
        raise ValueError(f"plan entry {entry!r}: style {style!r} on the attention module {type(mod).__name__} "
                         f"would split its projections without regard to heads; use 'attention' (or "
                         f"'encoder_attention') or 'replicated'")


def _mlp_partition(entry, args, rows, ctx):
    size = args.pop("size", None) or rows
    if size != rows:
        raise ValueError(f"plan entry {entry!r}: size={size} but the module's projection has {rows} rows")
    try:
        return Partition.make(int(size), ctx["tp_size"], weights=ctx["split_weights"], name=f"{entry} size")
    except ValueError as e:
        raise ValueError(f"plan entry {entry!r}: {e}") from None


def _gated_mlp(entry, mod, config, tp_size, args, ctx):
    _not_attention(entry, mod, "gated_mlp")
    fused = args.pop("fused", None)
    rows = _out(mod, fused, "fused projection", entry).weight.shape[0] // 2 if fused else \
        _out(mod, "gate_proj", "projection", entry).weight.shape[0]
    if not fused:
        _out(mod, "up_proj", "projection", entry), _out(mod, "down_proj", "projection", entry)
    return GatedMLP(_mlp_partition(entry, args, rows, ctx), sequence_parallel=args.pop(
        "sequence_parallel", ctx["sequence_parallel"]), fused=fused)


def _mlp(entry, mod, config, tp_size, args, ctx):
    _not_attention(entry, mod, "mlp")
    up, down = args.pop("up", "c_fc"), args.pop("down", "c_proj")
    up_mod = _out(mod, up, "up projection", entry)
    _out(mod, down, "down projection", entry)
    if _conv1d(up_mod):                                       # GPT-2: Conv1D c_fc [h, f], c_proj [f, h]
        _conv1d_names(entry, mod, (up, down), ("c_fc", "c_proj"))
        if args.pop("sequence_parallel", False):
            raise ValueError(f"plan entry {entry!r}: the Conv1D MLP style has no sequence_parallel")
        return Conv1DMLP(_mlp_partition(entry, args, up_mod.weight.shape[1], ctx))
    rows = up_mod.weight.shape[0]
    return MLP(_mlp_partition(entry, args, rows, ctx), up=up, down=down,
               sequence_parallel=args.pop("sequence_parallel", ctx["sequence_parallel"]))


def _stacked_experts(entry, mod) -> tuple[int, int]:
    """``(E, f)`` of a stacked-experts module (``gate_up_proj [E, 2f, h]``, ``down_proj [E, h, f]``), or a
    ValueError naming what does not fit (a tensor missing or of another shape, a layout the sharded experts do not
    take: biases, transposed or interleaved weights, ungated experts)."""
    from tensorpar.hf.modules.experts import _check_expert_layout

    try:
        _check_expert_layout(mod)
    except ValueError as e:
        raise ValueError(f"plan entry {entry!r}: {e}") from None
    gu, dn = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
    if gu is None or dn is None or gu.dim() != 3 or dn.dim() != 3 or gu.shape[1] % 2 or \
            tuple(dn.shape) != (gu.shape[0], gu.shape[2], gu.shape[1] // 2):
        shapes = ", ".join(f"{n} {list(t.shape)}" for n, t in mod.named_parameters()) or "no parameters"
        raise ValueError(f"plan entry {entry!r}: style 'moe_experts' needs stacked experts gate_up_proj [E, 2f, h] "
                         f"and down_proj [E, h, f]; {type(mod).__name__} has {shapes}")
    return gu.shape[0], gu.shape[1] // 2


def _moe_experts(entry, mod, config, tp_size, args, ctx):
    e, f = _stacked_experts(entry, mod)
    return MoEExperts(_mlp_partition(entry, args, f, ctx), e)


def _moe_block(entry, mod, config, tp_size, args, ctx):
    kids = dict(mod.named_children())
    need = ("gate", "experts", "shared_expert", "shared_expert_gate")
    if any(k not in kids for k in need):
        raise ValueError(f"plan entry {entry!r}: style 'moe_block' needs a sparse block with {', '.join(need)} "
                         f"(Qwen2-MoE's); {type(mod).__name__} has {', '.join(kids) or 'none'}")
    e, f = _stacked_experts(f"{entry}.experts", kids["experts"])
    se = kids["shared_expert"]
    for p in ("gate_proj", "up_proj", "down_proj"):
        _out(se, p, "projection", f"{entry}.shared_expert")
    return SharedExpertMoE(_mlp_partition(entry, args, f, ctx),
                           _mlp_partition(f"{entry}.shared_expert", {"size": args.pop("shared_size", None)},
                                          se.gate_proj.weight.shape[0], ctx), e)


def _linear(entry, mod, what):
    if not isinstance(mod, nn.Linear):
        raise ValueError(f"plan entry {entry!r}: style {what!r} needs an nn.Linear, got {type(mod).__name__}")


def _column(entry, mod, config, tp_size, args, ctx):
    _linear(entry, mod, "column")
    return ColumnLinear(_mlp_partition(entry, args, mod.out_features, ctx))


def _row(entry, mod, config, tp_size, args, ctx):
    _linear(entry, mod, "row")
    return RowLinear(_mlp_partition(entry, args, mod.in_features, ctx))


def _vocab(entry, args, rows, ctx):
    size = args.pop("size", None) or rows
    if size != rows:
        raise ValueError(f"plan entry {entry!r}: size={size} but the module has {rows} vocabulary rows")
    return Partition.make(int(size), ctx["tp_size"], weights=ctx["split_weights"], name="vocab_size")


def _vocab_embedding(entry, mod, config, tp_size, args, ctx):
    if not isinstance(mod, nn.Embedding):
        raise ValueError(f"plan entry {entry!r}: style 'vocab_embedding' needs an nn.Embedding, "
                         f"got {type(mod).__name__}")
    return VocabEmbedding(_vocab(entry, args, mod.num_embeddings, ctx))


def _lm_head(entry, mod, config, tp_size, args, ctx):
    if not isinstance(mod, nn.Linear):
        raise ValueError(f"plan entry {entry!r}: style 'lm_head' needs an nn.Linear, got {type(mod).__name__}")
    tied = args.pop("tied_to", None)
    if tied is None:   # tied weights are found on the model, not guessed from the config
        tied = next((n for n, m in ctx["model"].named_modules()
                     if isinstance(m, nn.Embedding) and m.weight is mod.weight), None)
    return LMHead(_vocab(entry, args, mod.out_features, ctx), tied_to=tied,
                  sequence_parallel=args.pop("sequence_parallel", ctx["sequence_parallel"]))


def _replicated(entry, mod, config, tp_size, args, ctx):
    return Replicated(sequence_parallel=args.pop("sequence_parallel", False), why=args.pop("why", "user plan"))


#: style name -> builder ``(entry, first matched module, config, tp_size, args, ctx) -> Style``; the arguments
#: each takes are documented in docs/plans.md.
STYLES = {
    "replicated": _replicated,
    "vocab_embedding": _vocab_embedding,
    "lm_head": _lm_head,
    "attention": _attention,
    "encoder_attention": _encoder_attention,
    "gated_mlp": _gated_mlp,
    "mlp": _mlp,
    "moe_experts": _moe_experts,
    "moe_block": _moe_block,
    "column": _column,
    "row": _row,
}
