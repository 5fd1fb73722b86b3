"""Sharding plans for unmodified Hugging Face models: a printable map from module-name pattern to style object.

A :class:`ShardingPlan` is made from a model config alone (no process group, no weights), so it can be printed,
tested and validated before anything is loaded; every user error is a ValueError raised here, at plan time.
The plan is the code that runs: :func:`tensorpar.hf.apply.parallelize` walks ``model.named_modules()`` and calls
the style of the first entry whose pattern matches (:mod:`tensorpar.hf.styles`). The same plan drives

* module replacement (each style builds its parallel module),
* weight slicing at load (the ``tp_dim`` / ``tp_partition`` each sharded parameter carries), and
* checkpoint resharding (which reads the same per-parameter layouts).

A plan is exhaustive: every parameter and buffer of the original model is claimed by an entry (sharded,
replicated or tied), or :meth:`ShardingPlan.check` raises a ValueError listing the unclaimed names; an entry
whose pattern matches no module is an error too. Each architecture's table lives in
:mod:`tensorpar.hf.families` (one file per family).

Patterns are dotted module names in which ``*`` stands for any run of characters inside one name segment
(``model.layers.*.mlp`` matches every block's MLP, ``model.rotary_emb*`` both of Gemma 3's rotary tables).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch.nn as nn

from tensorpar.hf.styles import Entry, Style
from tensorpar.layers.attention import HeadLayout
from tensorpar.shard import Partition


def pattern_regex(pattern: str) -> re.Pattern:
    """``model.layers.*.mlp`` -> a regex where ``*`` matches inside one dotted segment."""
    return re.compile("^" + re.escape(pattern).replace(r"\*", r"[^.]*") + "$")


@dataclass
class ShardingPlan:
    """How one architecture is split over ``tp_size`` ranks.

    Attributes:
        model_type: the Hugging Face ``config.model_type``.
        tp_size: tensor-parallel degree.
        sequence_parallel: whether activations between blocks are split along the sequence.
        heads: the :class:`HeadLayout` of every attention layer.
        vocab: :class:`Partition` of the vocabulary (embedding rows and LM-head rows).
        intermediate: :class:`Partition` of the MLP intermediate dim.
        tie_word_embeddings: the LM head shares the embedding's parameter.
        num_layers: decoder blocks.
        blocks: pattern of the decoder blocks (``model.layers.*``): training finds blocks through it
            (recomputation, dropout), never through a hard-coded attribute path.
        entries: the rows, in the order they are matched.
        implicit_replicated: tensors no entry claims that a user plan replicates because they are small
            (:mod:`tensorpar.hf.user_plan`); built-in tables leave it empty.
    """

    model_type: str
    tp_size: int
    sequence_parallel: bool
    heads: HeadLayout
    vocab: Partition
    intermediate: Partition
    tie_word_embeddings: bool
    num_layers: int
    blocks: str
    entries: list[Entry] = field(default_factory=list)
    implicit_replicated: tuple[str, ...] = ()

    def __str__(self) -> str:
        rows = []
        for e in self.entries:
            rows.append((e.pattern, e.style.name, e.style.detail()))
            rows += [(f"{e.pattern}.{suffix}", label, detail) for suffix, label, detail in e.style.rows()]
        w = max(len(r[0]) for r in rows)
        s = max(len(r[1]) for r in rows)
        head = (f"ShardingPlan({self.model_type}, tp_size={self.tp_size}, sequence_parallel={self.sequence_parallel}, "
                f"layers={self.num_layers})")
        lines = [head] + [f"  {p:<{w}}  {st:<{s}}  {d}".rstrip() for p, st, d in rows]
        if self.implicit_replicated:
            lines.append(f"  (replicated, in no entry: {len(self.implicit_replicated)} small tensors, e.g. "
                         f"{', '.join(self.implicit_replicated[:3])})")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"model_type": self.model_type, "tp_size": self.tp_size, "sequence_parallel": self.sequence_parallel,
                "entries": [{"module": e.pattern, "style": e.style.name, "detail": e.style.detail()}
                            for e in self.entries]}

    def match(self, name: str) -> Entry | None:
        """The first entry whose pattern matches module ``name``, or None."""
        for e in self.entries:
            if pattern_regex(e.pattern).match(name):
                return e
        return None

    def modules(self, model: nn.Module, style: type[Style] | str) -> list[tuple[str, nn.Module]]:
        """``(name, module)`` of ``model`` planned with a style of this class (or ``Style.name``), in order."""
        out = []
        for name, m in model.named_modules():
            e = self.match(name)
            if e is not None and (e.style.name == style if isinstance(style, str) else isinstance(e.style, style)):
                out.append((name, m))
        return out

    def block_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The decoder blocks, matched by :attr:`blocks`."""
        rx = pattern_regex(self.blocks)
        return [(n, m) for n, m in model.named_modules() if rx.match(n)]

    def check(self, model: nn.Module) -> None:
        """Refuse a plan that does not claim every parameter and buffer of ``model`` (the unsharded model), or
        whose styles would drop some of them.

        A module matched by an entry claims everything below it; a style that builds a new module carries over
        only the tensors it names (:meth:`~tensorpar.hf.styles.Style.keeps`). Raises ValueError naming:
        tensors a style does not
        know (they would vanish from the sharded model); the unclaimed names (at most 8); or the entries whose
        pattern matches no module. PEFT LoRA layers on linear projections are sharded with their base layer
        (:mod:`tensorpar.layers.lora`); other PEFT tuners (DoRA, LoRA on embeddings or GPT-2's Conv1D, several
        adapters) are refused, naming the module.
        """
        _refuse_unsupported_adapters(model, self.model_type)
        matched: list[str] = []
        used: set[str] = set()
        for name, module in model.named_modules():
            if any(name == m or name.startswith(m + ".") for m in matched):
                continue
            e = self.match(name)
            if e is not None:
                used.add(e.pattern)
                if e.style.claims:
                    matched.append(name)
                    _refuse_dropped(e, name, module)
        unused = [e.pattern for e in self.entries if e.pattern not in used]
        if unused:
            raise ValueError(f"{self.model_type} plan: entries match no module of the model: {', '.join(unused)}")
        names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        names += [n for n, _ in model.named_buffers(remove_duplicate=False)]
        unclaimed = [n for n in names if not any(n.startswith(m + ".") for m in matched)
                     and n not in self.implicit_replicated]
        if unclaimed:
            more = f" (and {len(unclaimed) - 8} more)" if len(unclaimed) > 8 else ""
            raise ValueError(f"{self.model_type} plan leaves {len(unclaimed)} parameters/buffers unclaimed: "
                             f"{', '.join(unclaimed[:8])}{more}; every tensor must be sharded, replicated or tied "
                             f"by a plan entry")


def _keeps_regex(pattern: str) -> re.Pattern:
    """A :meth:`Style.keeps` name: ``*`` one segment, ``**`` any rest (``q_norm.**``)."""
    return re.compile("^" + re.escape(pattern).replace(r"\*\*", ".+").replace(r"\*", r"[^.]*") + "$")


def _refuse_dropped(entry: Entry, name: str, module: nn.Module) -> None:
    """ValueError if ``entry``'s style would build a module without some parameter or buffer of ``module``."""
    keeps = entry.style.keeps()
    if keeps is None:
        return
    rx = [_keeps_regex(k) for k in keeps]
    tensors = [n for n, _ in module.named_parameters(remove_duplicate=False)]
    tensors += [n for n, _ in module.named_buffers(remove_duplicate=False)]
    dropped = [n for n in tensors if not any(r.match(n) for r in rx)]
    if dropped and type(module).__module__.startswith("peft.") and any(n.startswith("lora_") for n in dropped):
        raise ValueError(f"LoRA on {name}: its plan style {entry.style.name!r} takes no adapters (tensorpar splits "
                         f"adapters with column- and row-parallel linears only); leave "
                         f"{name.rsplit('.', 1)[-1]} out of --lora-target-modules / target_modules")
    if dropped:
        more = f" (and {len(dropped) - 6} more)" if len(dropped) > 6 else ""
        raise ValueError(f"plan entry {entry.pattern!r}: style {entry.style.name!r} does not know "
                         f"{', '.join(f'{name}.{n}' for n in dropped[:6])}{more} ({type(module).__name__}); the "
                         f"sharded module would lose them: give this module a style that shards them, or "
                         f"'replicated'")


def _refuse_unsupported_adapters(model: nn.Module, model_type: str) -> None:
    """ValueError (one line) naming the first PEFT tuner layer that :mod:`tensorpar.layers.lora` cannot shard."""
    from tensorpar.layers.lora import lora_problem

    for name, m in model.named_modules():
        if type(m).__module__.startswith("peft.") and isinstance(getattr(m, "base_layer", None), nn.Module):
            why = lora_problem(m)
            if why is not None:
                raise ValueError(f"{model_type} model: PEFT layer {name} holds {why}; tensorpar shards plain LoRA "
                                 f"(one adapter, on nn.Linear projections such as q_proj, v_proj): target those, or "
                                 f"merge the adapter into the weights first (model.merge_and_unload())")


def _get(config, *names, default=None):
    for n in names:
        v = getattr(config, n, None)
        if v is not None:
            return v
    return default


def supported() -> tuple[str, ...]:
    """The ``model_type`` values with a built-in table."""
    from tensorpar.hf.families import FAMILIES
    return tuple(FAMILIES)


def make_plan(config, tp_size: int, *, sequence_parallel: bool = False, head_split_weights=None,
              split_weights=None, check: bool = True, user_plan=None, tp_weights=None,
              discover: bool = False) -> ShardingPlan:
    """Build and validate the plan of a Hugging Face causal-LM ``config`` for ``tp_size`` ranks.

    Args:
        config: a ``transformers.PretrainedConfig`` (or anything with the same attributes).
        tp_size: tensor-parallel degree, >= 1.
        sequence_parallel: split activations along the sequence between blocks.
        head_split_weights: relative speeds per rank for the query-head split (default even).
        split_weights: relative speeds per rank for the MLP and vocabulary splits (default even).
        tp_weights: relative speed of each rank for every sharded dimension at once (query heads, MLP and expert
            columns, vocabulary): sets both of the above (:mod:`tensorpar.capacity`); not ``"auto"``, which
            :func:`~tensorpar.parallel.init_parallel` resolves to numbers (``ctx.tp_weights``).
        check: build the model on the meta device (no memory) and check that the plan claims every
            parameter and buffer (:meth:`ShardingPlan.check`).
        user_plan: a dict, a :class:`~tensorpar.hf.user_plan.UserPlan` or a .json/.yaml path that overrides or
            extends the built-in table (or is the whole plan of an architecture without one):
            :mod:`tensorpar.hf.user_plan`; always checked against the meta-device model.
        discover: the plan found from the meta-device model's graph and shapes
            (:func:`tensorpar.hf.discover.discover_plan`, table or not), as a user plan; it is not proven here:
            ``--discover-plan`` proves it first (:func:`tensorpar.verify.prove.prove_plan`).

    Raises:
        ValueError: unsupported architecture (listing the supported ones); ``tp_size`` < 1 or
            larger than the number of query heads (naming both); head counts that are not
            multiples; split weights of the wrong length; a plan that leaves tensors unclaimed.
    """
    from tensorpar.hf.families import FAMILIES

    mt = getattr(config, "model_type", None)
    if discover:
        if user_plan is not None:
            raise ValueError("give either a plan file (user_plan / --plan-file) or discover=True "
                             "(--discover-plan), not both")
        from tensorpar.hf.discover import discover_plan
        from tensorpar.hf.user_plan import merge_user_plan
        model = meta_model(config)
        return merge_user_plan(None, discover_plan(config, model), config, model, tp_size,
                               sequence_parallel=sequence_parallel, head_split_weights=head_split_weights,
                               split_weights=split_weights)
    if mt not in FAMILIES and user_plan is None:
        raise ValueError(f"unsupported architecture model_type={mt!r}; tensorpar has plans for: "
                         f"{', '.join(sorted(FAMILIES))}; for another architecture give a plan file "
                         f"(generate, serve, verify: --plan-file; Python: make_plan(..., user_plan=...)): see "
                         f"docs/plans.md; or let tensorpar find and prove one: --discover-plan (docs/discover.md)")
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive integer, got {tp_size!r}")
    if tp_weights is not None:
        from tensorpar.shard import AUTO, check_tp_weights
        tp_weights = check_tp_weights(tp_weights, tp_size)
        if tp_weights == AUTO:
            raise ValueError("tp_weights='auto' must be measured first: pass ParallelConfig(tp_weights='auto') to "
                             "init_parallel and make the plan with tp_weights=ctx.tp_weights")
        head_split_weights = tp_weights if head_split_weights is None else head_split_weights
        split_weights = tp_weights if split_weights is None else split_weights
    if user_plan is not None:
        from tensorpar.hf.user_plan import load_user_plan, merge_user_plan
        user = load_user_plan(user_plan)
        base = None if mt not in FAMILIES else FAMILIES[mt](
            config, tp_size, sequence_parallel=sequence_parallel, head_split_weights=head_split_weights,
            split_weights=split_weights)
        return merge_user_plan(base, user, config, meta_model(config), tp_size, sequence_parallel=sequence_parallel,
                               head_split_weights=head_split_weights, split_weights=split_weights)
    plan = FAMILIES[mt](config, tp_size, sequence_parallel=sequence_parallel, head_split_weights=head_split_weights,
                        split_weights=split_weights)
    if check:
        plan.check(meta_model(config))
    return plan


def meta_model(config) -> nn.Module:
    """The model of ``config`` on the meta device (shapes and names only, no memory): the ``*ForCausalLM``, or the
    auto class its family names in :data:`tensorpar.hf.families.MODEL_CLASSES` (``*ForImageClassification``)."""
    import copy

    import torch
    import transformers

    from tensorpar.hf.families import MODEL_CLASSES

    auto = getattr(transformers, MODEL_CLASSES.get(getattr(config, "model_type", None), "AutoModelForCausalLM"))
    with torch.device("meta"):  # eager: every family builds with it (names and shapes do not depend on it)
        return auto.from_config(copy.deepcopy(config), attn_implementation="eager")


def head_layout(config, tp_size: int, weights=None) -> HeadLayout:
    """The :class:`HeadLayout` of a decoder config (``head_dim`` may differ from ``hidden / heads``)."""
    nh = config.num_attention_heads
    nkv = _get(config, "num_key_value_heads", default=nh)
    hd = _get(config, "head_dim", default=config.hidden_size // nh)
    return HeadLayout.make(nh, nkv, hd, tp_size, split_weights=weights)
