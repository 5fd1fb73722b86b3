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

Checks, all at plan time on the meta-device model, each a ValueError naming the entry (``plan entry 'P'``; the
style builders that make them are :mod:`tensorpar.hf.user_styles`):

* a pattern that matches no module of the model (with the closest module names);
* a style name that does not exist (listing those that do), or an argument the style does not take;
* a split that would cut a head: ``heads x head_dim`` that does not match the projections' rows, a tp larger
  than the head count, or an MLP / replicated-only style given an attention module;
* heads that are not the module's: a ``head_dim`` other than its own (rows that match with other heads), or
  ``heads x head_dim`` other than the output projection's input features (the rules the ranks would fail on);
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

from tensorpar.hf.plan import ShardingPlan, pattern_regex
from tensorpar.hf.styles import (MLP, Attention, ColumnLinear, Conv1DAttention, Conv1DMLP, EncoderAttention, Entry,
                                 GatedMLP, LMHead, MoEExperts, NeoXAttention, SharedExpertMoE, Style, VocabEmbedding)
from tensorpar.hf.user_styles import STYLES

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
        if path.is_dir():
            raise ValueError(f"--plan-file {str(path)!r}: a folder, not a plan file; give a .json or .yaml file")
        if not path.is_file():
            raise FileNotFoundError(f"--plan-file {str(path)!r}: no such file")
        suffix = path.suffix.lower()
        try:
            text = path.read_text(encoding="utf-8")   # UnicodeDecodeError: a ValueError, named below
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
        if blocks is not None and (not isinstance(blocks, str) or not blocks.strip()):
            raise ValueError(f"{source}: 'blocks' must be the pattern of the transformer blocks (e.g. "
                             f"\"model.layers.*\"), got {blocks!r}")
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


# ---------------------------------------------------------------- merging

def _first(model: nn.Module, pattern: str) -> tuple[str, nn.Module]:
    rx = pattern_regex(pattern)
    return next((n, m) for n, m in model.named_modules() if rx.match(n))


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
               split_weights=split_weights, model=model, source=user.source)
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
