"""User sharding plans: a plan file (JSON or YAML) or a dict that overrides or extends the built-in table.

A user plan maps module-name patterns (``*`` = one dotted name segment, as in :mod:`tensorpar.hf.plan`) to a
style name with arguments::

    {"model.layers.*.self_attn": {"style": "attention"},
     "model.layers.*.mlp": {"style": "gated_mlp"},
     "model.layers.0.mlp": "replicated"}

or, to set plan-wide options, ``{"entries": {...}, "blocks": "model.layers.*", "replicate_threshold": 1000000}``.
A bare string is a style with no arguments. See docs/plans.md for every style and its arguments.

Merging with the built-in table of the architecture (when it has one): an entry whose pattern equals a
built-in pattern replaces that entry's style in place; every other user entry goes before the built-in entries
(user entries win, in file order). Built-in entries that no longer match any module (the user's entries cover
them all) are dropped. Without a built-in table the user plan is the whole plan.

Checks, all at plan time on the meta-device model, each a ValueError naming the entry (``plan entry 'P'``):

* a pattern that matches no module of the model (with the closest module names);
* a style name that does not exist (listing those that do), or an argument the style does not take;
* a split that would cut a head: ``heads x head_dim`` that does not match the projections' rows, a tp larger
  than the head count, or an MLP / replicated-only style given an attention module;
* sizes that do not match the module (an MLP ``size`` other than its projection's rows, a vocabulary other
  than the embedding's rows).

Tensors no entry claims are replicated when they are small (at most ``replicate_threshold`` elements, default
1,000,000: norms, biases, rotary tables); a larger one left unclaimed is an error naming it: shard it, or
declare it ``"replicated"`` explicitly. With ``sequence_parallel`` every tensor must be claimed explicitly (a
norm between blocks needs ``{"style": "replicated", "sequence_parallel": true}``).
"""
from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch.nn as nn

from tensorpar.hf.plan import ShardingPlan, _get, pattern_regex
from tensorpar.hf.styles import (MLP, Attention, ColumnLinear, Conv1DAttention, Conv1DMLP, EncoderAttention, Entry,
                                 FullWidthQKNormAttention, GatedMLP, LMHead, MoEExperts, NeoXAttention, Replicated,
                                 RowLinear, SharedExpertMoE, Style, VocabEmbedding)
from tensorpar.layers.attention import HeadLayout
from tensorpar.shard import Partition

DEFAULT_REPLICATE_THRESHOLD = 1_000_000


@dataclass
class UserEntry:
    """One user row: ``pattern`` -> ``style`` name with keyword ``args``."""

    pattern: str
    style: str
    args: dict = field(default_factory=dict)


@dataclass
class UserPlan:
    """A parsed user plan: entries in order, the block pattern (optional) and the replication threshold."""

    entries: list[UserEntry]
    blocks: str | None = None
    replicate_threshold: int = DEFAULT_REPLICATE_THRESHOLD
    source: str = "user plan"


def load_user_plan(spec) -> UserPlan:
    """Parse a user plan from a dict, a :class:`UserPlan`, or a ``.json`` / ``.yaml`` / ``.yml`` file path.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: another file suffix, a file that does not parse (with the parser's message), an entry
            whose value is neither a style name nor a mapping with ``"style"``, or unknown top-level keys.
    """
    if isinstance(spec, UserPlan):
        return spec
    source = "user plan"
    if isinstance(spec, (str, os.PathLike)):
        path = Path(spec)
        source = f"plan file {str(path)!r}"
        if not path.is_file():
            raise FileNotFoundError(f"--plan-file {str(path)!r}: no such file")
        text = path.read_text()
        suffix = path.suffix.lower()
        try:
            if suffix == ".json":
                spec = json.loads(text)
            elif suffix in (".yaml", ".yml"):
                try:
                    import yaml
                except ImportError as e:
                    raise ValueError(f"{source}: reading YAML needs PyYAML (pip install pyyaml), or write the "
                                     f"plan as .json") from e
                spec = yaml.safe_load(text)
            else:
                raise ValueError(f"{source}: unknown suffix {suffix!r}; use .json, .yaml or .yml")
        except (json.JSONDecodeError, Exception) as e:
            if isinstance(e, ValueError) and str(e).startswith(source):
                raise
            raise ValueError(f"{source} does not parse: {str(e).splitlines()[0]}") from e
    if not isinstance(spec, dict) or not spec:
        raise ValueError(f"{source} must be a non-empty mapping of module patterns to styles, got {type(spec).__name__}")
    blocks, threshold = None, DEFAULT_REPLICATE_THRESHOLD
    if "entries" in spec:
        extra = set(spec) - {"entries", "blocks", "replicate_threshold"}
        if extra:
            raise ValueError(f"{source}: unknown top-level keys {sorted(extra)}; a structured plan takes 'entries', "
                             f"'blocks' and 'replicate_threshold'")
        blocks = spec.get("blocks")
        threshold = spec.get("replicate_threshold", threshold)
        if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0:
            raise ValueError(f"{source}: replicate_threshold must be a non-negative number of elements, "
                             f"got {threshold!r}")
        spec = spec["entries"]
        if not isinstance(spec, dict) or not spec:
            raise ValueError(f"{source}: 'entries' must be a non-empty mapping of module patterns to styles")
    entries = []
    for pattern, value in spec.items():
        if isinstance(value, str):
            value = {"style": value}
        if not isinstance(pattern, str) or not pattern or not isinstance(value, dict) or "style" not in value:
            raise ValueError(f"plan entry {pattern!r}: expected a style name or a mapping with 'style' "
                             f"(e.g. {{\"style\": \"gated_mlp\"}}), got {value!r}")
        args = {k: v for k, v in value.items() if k != "style"}
        entries.append(UserEntry(pattern, str(value["style"]), args))
    return UserPlan(entries, blocks, threshold, source)


# ---------------------------------------------------------------- style builders

def _first(model: nn.Module, pattern: str) -> tuple[str, nn.Module]:
    rx = pattern_regex(pattern)
    return next((n, m) for n, m in model.named_modules() if rx.match(n))


def _out(model_mod: nn.Module, name: str, what: str, entry: str) -> nn.Linear:
    m = getattr(model_mod, name, None)
    if m is None or not hasattr(m, "weight"):
        kids = ", ".join(n for n, _ in model_mod.named_children()) or "none"
        raise ValueError(f"plan entry {entry!r}: {type(model_mod).__name__} has no {what} {name!r} "
                         f"(its submodules: {kids})")
    return m


def _looks_like_attention(m: nn.Module) -> bool:
    return "Attention" in type(m).__name__ or any(hasattr(m, a) for a in ("q_proj", "qkv_proj", "c_attn", "query"))


def _heads(entry, config, tp_size, args, weights, encoder=False) -> HeadLayout:
    nh = args.pop("heads", None) or _get(config, "num_attention_heads")
    if nh is None:
        raise ValueError(f"plan entry {entry!r}: the config has no num_attention_heads; give \"heads\"")
    nkv = args.pop("kv_heads", None) or (nh if encoder else _get(config, "num_key_value_heads", default=nh))
    hd = args.pop("head_dim", None) or _get(config, "head_dim", default=config.hidden_size // nh)
    try:
        return HeadLayout.make(int(nh), int(nkv), int(hd), tp_size, split_weights=weights)
    except ValueError as e:
        raise ValueError(f"plan entry {entry!r}: {e}") from None


def _rows_check(entry, mod, proj, want, what, lay):
    got = proj.weight.shape[0]
    if got != want:
        raise ValueError(f"plan entry {entry!r}: {what} = {want} rows but {type(mod).__name__} has {got}; a split "
                         f"by these sizes would cut a head (heads={lay.num_heads}, kv_heads={lay.num_kv_heads}, "
                         f"head_dim={lay.head_dim}): give the heads, kv_heads and head_dim of this module")


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
    _out(mod, o_name, "output projection", entry)
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
    _out(mod, o_name, "output projection", entry)
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


# ---------------------------------------------------------------- merging

def _suggest(model: nn.Module, pattern: str) -> str:
    names = sorted({re.sub(r"\.\d+(?=\.|$)", ".*", n) for n, _ in model.named_modules() if n})
    close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.6)
    return f"; closest module names: {', '.join(close)}" if close else ""


def _used_patterns(plan: ShardingPlan, model: nn.Module) -> set[str]:
    """Patterns that :meth:`ShardingPlan.check` would find matching a module (top-down, first match wins)."""
    matched, used = [], set()
    for name, _ in model.named_modules():
        if any(name == m or name.startswith(m + ".") for m in matched):
            continue
        e = plan.match(name)
        if e is not None:
            used.add(e.pattern)
            if e.style.claims:
                matched.append(name)
    return used


def merge_user_plan(base: ShardingPlan | None, user: UserPlan, config, model: nn.Module, tp_size: int, *,
                    sequence_parallel: bool = False, head_split_weights=None, split_weights=None) -> ShardingPlan:
    """Merge ``user`` into ``base`` (the built-in plan, or None) for the meta-device ``model``; see the module doc.

    Returns a new :class:`ShardingPlan` (``base`` is not modified) whose ``implicit_replicated`` lists the small
    tensors no entry claims. Raises ValueError naming the offending entry or tensor.
    """
    if base is None and sequence_parallel:
        raise ValueError(f"{config.model_type}: sequence_parallel=True needs a built-in table (it inserts the "
                         f"sequence split before the first block); run the user plan with sequence_parallel=False")
    ctx = dict(tp_size=tp_size, sequence_parallel=sequence_parallel, head_split_weights=head_split_weights,
               split_weights=split_weights, model=model)
    built: list[Entry] = []
    for u in user.entries:
        try:
            pattern_regex(u.pattern)
            name, mod = _first(model, u.pattern)
        except StopIteration:
            raise ValueError(f"plan entry {u.pattern!r} ({user.source}) matches no module of the "
                             f"{config.model_type} model{_suggest(model, u.pattern)}") from None
        if u.style not in STYLES:
            raise ValueError(f"plan entry {u.pattern!r}: style {u.style!r} does not exist; styles: "
                             f"{', '.join(sorted(STYLES))}")
        args = dict(u.args)
        style: Style = STYLES[u.style](u.pattern, mod, config, tp_size, args, ctx)
        if args:
            raise ValueError(f"plan entry {u.pattern!r}: style {u.style!r} takes no argument(s) "
                             f"{', '.join(sorted(args))}; see docs/plans.md")
        built.append(Entry(u.pattern, style, notes=[user.source]))
    by_pattern = {e.pattern: e for e in built}
    entries = [e for e in built if base is None or all(b.pattern != e.pattern for b in base.entries)]
    if base is not None:
        entries += [by_pattern.get(b.pattern, b) for b in base.entries]
    plan = _plan(base, entries, built, user, config, model, tp_size, sequence_parallel)
    used = _used_patterns(plan, model)
    user_patterns = {u.pattern for u in user.entries}
    for e in built:
        if e.pattern not in used:
            raise ValueError(f"plan entry {e.pattern!r} ({user.source}) matches no module the plan reaches: an "
                             f"earlier entry claims everything below it; remove one of the two")
    plan.entries = [e for e in plan.entries if e.pattern in used or e.pattern in user_patterns]
    _implicit(plan, model, user, sequence_parallel)
    plan.check(model)
    return plan


def _plan(base, entries, built, user, config, model, tp_size, sp) -> ShardingPlan:
    def first(kind):
        return next((e.style for e in built if isinstance(e.style, kind)), None)

    att = first((Attention, EncoderAttention, Conv1DAttention, NeoXAttention))
    heads = att.layout if att is not None else (base.heads if base else None)
    voc = first((VocabEmbedding, LMHead))
    vocab = voc.partition if voc is not None else (base.vocab if base else None)
    # the expert size where there are experts, as the MoE table
    mlp = first((MoEExperts, SharedExpertMoE)) or first((GatedMLP, MLP, Conv1DMLP, ColumnLinear))
    inter = mlp.partition if mlp is not None else (base.intermediate if base else None)
    blocks = user.blocks or (base.blocks if base else None)
    if blocks is None:   # the parent of the first attention pattern: model.layers.*.self_attn -> model.layers.*
        pat = next((e.pattern for e in built if isinstance(e.style, (Attention, EncoderAttention, Conv1DAttention,
                                                                          NeoXAttention))), None)
        if pat is None or "." not in pat:
            raise ValueError(f"{user.source}: give 'blocks' (the pattern of the transformer blocks, e.g. "
                             f"'model.layers.*'): it cannot be found from an attention entry")
        blocks = pat.rsplit(".", 1)[0]
    rx = pattern_regex(blocks)
    n_blocks = sum(1 for n, _ in model.named_modules() if rx.match(n))
    if n_blocks == 0:
        raise ValueError(f"{user.source}: blocks pattern {blocks!r} matches no module{_suggest(model, blocks)}")
    tie = base.tie_word_embeddings if base else any(isinstance(e.style, LMHead) and e.style.tied_to for e in built)
    return ShardingPlan(config.model_type, tp_size, sp, heads, vocab, inter, tie, n_blocks, blocks, entries)


def _implicit(plan: ShardingPlan, model: nn.Module, user: UserPlan, sp: bool) -> None:
    """Replicate the small unclaimed tensors (recorded on the plan); refuse a large one, naming it."""
    matched = []
    for name, _ in model.named_modules():
        if any(name == m or name.startswith(m + ".") for m in matched):
            continue
        e = plan.match(name)
        if e is not None and e.style.claims:
            matched.append(name)
    tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    left = [(n, t) for n, t in tensors if not any(n.startswith(m + ".") for m in matched)]
    big = [(n, t.numel()) for n, t in left if t.numel() > user.replicate_threshold]
    if big:
        n, k = big[0]
        more = f" (and {len(big) - 1} more: {', '.join(b for b, _ in big[1:4])})" if len(big) > 1 else ""
        raise ValueError(f"{user.source}: {n} ({k:,} elements) is claimed by no entry and is larger than "
                         f"replicate_threshold={user.replicate_threshold:,}{more}; shard it with a plan entry, or "
                         f"declare its module replicated: {{\"{n.rsplit('.', 1)[0]}\": \"replicated\"}}")
    if left and sp:
        raise ValueError(f"{user.source}: with sequence_parallel every tensor must be claimed by an entry; "
                         f"unclaimed: {', '.join(n for n, _ in left[:6])}")
    plan.implicit_replicated = tuple(n for n, _ in left)
