"""Built-in sharding tables, one module per family, and the one query of what each family supports.

Every family module exports ``RECORDS`` (one :class:`~tensorpar.hf.families.record.Family` per model type);
:data:`RECORDS` joins them, :data:`FAMILIES` maps ``config.model_type`` to its plan builder
(``f(config, tp_size, *, sequence_parallel, head_split_weights, split_weights) -> ShardingPlan``), and
:func:`why_not` answers "can this config use feature X" for the launching process and the ranks alike. No module
outside this package names a family or tests a sliding window itself.
"""
from __future__ import annotations

from tensorpar.hf.families import gemma, gpt2, gpt_neox, llama, moe, olmo2, phi3, starcoder2, vit
from tensorpar.hf.families.record import Family

#: model_type -> :class:`Family`
RECORDS: dict[str, Family] = {r.model_type: r for mod in (llama, gemma, phi3, gpt2, starcoder2, gpt_neox, olmo2,
                                                          moe, vit) for r in mod.RECORDS}

#: model_type -> plan builder
FAMILIES = {mt: r.plan for mt, r in RECORDS.items()}

#: The transformers auto class a family's plan is written for (names of its modules), where it is not
#: ``AutoModelForCausalLM``. :func:`tensorpar.hf.plan.meta_model` builds this class.
MODEL_CLASSES = {mt: r.model_class for mt, r in RECORDS.items() if not r.causal_lm}

#: the features :func:`why_not` answers for
FEATURES = ("causal_lm", "fast_decode", "int8", "pipeline", "sequence_parallel", "expert_parallel", "context_parallel")


def is_causal_lm(model_type: str) -> bool:
    """Whether the family's plan is for a ``*ForCausalLM`` (text generation and training), not a classifier
    (a model type without a record, e.g. one sharded by a user plan, counts as a causal LM)."""
    r = RECORDS.get(model_type)
    return r is None or r.causal_lm


def sliding_window(config) -> int | None:
    """The attention window the model applies to at least one layer, or ``None`` for full causal attention
    everywhere: ``config.sliding_window`` unless ``use_sliding_window`` is False or ``layer_types`` lists only
    ``full_attention`` layers (transformers' rule: Qwen2 windows only the layers from ``max_window_layers``;
    Mistral windows every layer when ``sliding_window`` is set)."""
    w = getattr(config, "sliding_window", None)
    if not w or getattr(config, "use_sliding_window", True) is False:
        return None
    types = getattr(config, "layer_types", None)
    if types and all(t == "full_attention" for t in types):
        return None
    return int(w)


def attention_windows(config) -> dict[str, int | None]:
    """The window of each kind of attention layer the model has, by transformers' ``layer_types`` name:
    ``{"full_attention": None}`` without windows; ``{"sliding_attention": w}`` when every layer is windowed
    (Mistral, StarCoder2, Phi-3 with ``sliding_window``: no ``layer_types``, or only sliding ones); both keys
    when ``layer_types`` mixes them (Gemma 2/3, Qwen2 from ``max_window_layers``). A layer of window ``w``
    lets the query at position ``p`` attend to positions ``(p - w, p]`` (transformers' sliding-window mask)."""
    w = sliding_window(config)
    if w is None:
        return {"full_attention": None}
    types = set(getattr(config, "layer_types", None) or ["sliding_attention"])
    return {t: (w if t == "sliding_attention" else None) for t in sorted(types)}


def _names(pred) -> str:
    return ", ".join(mt for mt, r in RECORDS.items() if pred(r))


def why_not(feature: str, config) -> str | None:
    """Why ``config`` cannot use ``feature``, as a clause for a one-line error, or ``None`` when it can.

    The same rule runs in the launching process (from the config alone) and in the ranks, so the parent refuses
    what a rank would. Features (:data:`FEATURES`):

    * ``causal_lm``: a text decoder, not an image classifier.
    * ``fast_decode``: the lean decode path (:mod:`tensorpar.decode.lean`) and everything built on it (``--quantize``):
      the family's record says so (sliding windows, soft-capping, q/k norms: :mod:`tensorpar.decode.block`).
    * ``int8``: ``--quantize int8`` (the lean path, and layers of the layout
      :func:`tensorpar.decode.quantize.quantize_int8` reads).
    * ``pipeline``: :class:`~tensorpar.pipeline.stages.DecoderStage` can cut it (full causal attention).
    * ``sequence_parallel``: the family's plan splits the sequence between blocks.
    * ``expert_parallel``: a mixture-of-experts family with experts in this config.
    * ``context_parallel``: the family's attention runs over a sequence split across cp ranks (full causal
      attention: no sliding window).

    Raises:
        ValueError: an unknown ``feature``.
    """
    if feature not in FEATURES:
        raise ValueError(f"unknown feature {feature!r}; one of {', '.join(FEATURES)}")
    mt = getattr(config, "model_type", None)
    r = RECORDS.get(mt)
    w = sliding_window(config)
    if feature == "causal_lm":
        return None if r is None or r.causal_lm else (f"model_type={mt!r} is an image classifier, not a causal "
                                                      f"language model")
    if feature == "fast_decode":
        if r is None or not r.fast_decode:
            return f"model_type={mt!r} has no fast decode path (families with one: {_names(lambda r: r.fast_decode)})"
        return None
    if feature == "int8":
        if r is None or not r.fast_decode:
            return f"model_type={mt!r} has no fast decode path (families with one: {_names(lambda r: r.fast_decode)})"
        if not r.int8:
            return f"--quantize int8 supports {_names(lambda r: r.int8)}, not {mt!r}"
        return None
    if feature == "pipeline":
        if r is None or not r.pipeline_stages:
            return f"pipeline parallelism supports {_names(lambda r: r.pipeline_stages)}, not {mt!r}"
        return None if w is None else f"this {mt} config has sliding_window={w}; pipeline stages need full causal attention"
    if feature == "sequence_parallel":
        return None if r is not None and r.sequence_parallel else (
            f"sequence parallelism supports {_names(lambda r: r.sequence_parallel)}, not {mt!r}")
    if feature == "context_parallel":
        if r is None or not r.context_parallel:
            return f"context parallelism supports {_names(lambda r: r.context_parallel)}, not {mt!r}"
        return None if w is None else f"this {mt} config has sliding_window={w}; context parallelism needs full " \
                                      f"causal attention"
    # expert_parallel
    if r is None or not r.expert_parallel:
        return (f"model_type={mt!r} has no mixture-of-experts layers; expert parallelism needs one of "
                f"{_names(lambda r: r.expert_parallel)}")
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
    return None if experts > 0 else f"this {mt} config has no experts (num_experts=0)"
