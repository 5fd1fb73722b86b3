"""Sharding plans for unmodified Hugging Face decoders: a printable map from module name to style.

A :class:`ShardingPlan` is made from a model config alone (no process group, no weights), so
it can be printed, tested and validated before anything is loaded; every user error is a
ValueError raised here, at plan time. The same plan then drives

* module replacement (:func:`tensorpar.hf.apply.parallelize`),
* weight slicing at load (the shard layout it attaches to each parameter), and
* checkpoint resharding (which reads the same per-parameter layouts).

Styles:

=====================  ========================================================================
``vocab_embedding``    :class:`~tensorpar.layers.VocabParallelEmbedding` (rows = vocabulary)
``attention``          :class:`~tensorpar.hf.modules.TPAttention` (heads split per HeadLayout)
``column(heads)``      q projection, rows split by whole query heads
``column(kv heads)``   k/v projections, the KV heads the rank's query heads read (may duplicate)
``row(heads)``         output projection, columns split by whole query heads
``gated_mlp``          :class:`~tensorpar.hf.modules.TPGatedMLP`
``column`` / ``row``   gate/up and down projections
``lm_head``            column-parallel over the vocabulary, vocab-parallel cross-entropy
``replicated``         norms (under sequence parallelism their gradients are summed over tp)
``sp_entry``           the first block splits the sequence (sequence parallelism only)
=====================  ========================================================================
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tensorpar.layers.attention import HeadLayout
from tensorpar.shard import Partition

LLAMA_LIKE = ("llama", "mistral", "qwen2")
SUPPORTED = LLAMA_LIKE + ("gpt2",)


@dataclass(frozen=True)
class PlanEntry:
    """One row of a plan: module-name pattern (``*`` = any layer index), style, and what it splits."""

    pattern: str
    style: str
    detail: str = ""


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
        entries: the rows shown by ``print(plan)``.
    """

    model_type: str
    tp_size: int
    sequence_parallel: bool
    heads: HeadLayout
    vocab: Partition
    intermediate: Partition
    tie_word_embeddings: bool
    num_layers: int
    entries: list[PlanEntry] = field(default_factory=list)

    def __str__(self) -> str:
        w = max(len(e.pattern) for e in self.entries)
        s = max(len(e.style) for e in self.entries)
        head = (f"ShardingPlan({self.model_type}, tp_size={self.tp_size}, sequence_parallel={self.sequence_parallel}, "
                f"layers={self.num_layers})")
        lines = [head] + [f"  {e.pattern:<{w}}  {e.style:<{s}}  {e.detail}".rstrip() for e in self.entries]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"model_type": self.model_type, "tp_size": self.tp_size, "sequence_parallel": self.sequence_parallel,
                "entries": [{"module": e.pattern, "style": e.style, "detail": e.detail} for e in self.entries]}


def _get(config, *names, default=None):
    for n in names:
        v = getattr(config, n, None)
        if v is not None:
            return v
    return default


def make_plan(config, tp_size: int, *, sequence_parallel: bool = False, head_split_weights=None,
              split_weights=None) -> ShardingPlan:
    """Build and validate the plan of a Hugging Face causal-LM ``config`` for ``tp_size`` ranks.

    Args:
        config: a ``transformers.PretrainedConfig`` (or anything with the same attributes).
        tp_size: tensor-parallel degree, >= 1.
        sequence_parallel: split activations along the sequence between blocks.
        head_split_weights: relative speeds per rank for the query-head split (default even).
        split_weights: relative speeds per rank for the MLP and vocabulary splits (default even).

    Raises:
        ValueError: unsupported architecture (listing the supported ones); ``tp_size`` < 1 or
            larger than the number of query heads (naming both); head counts that are not
            multiples; split weights of the wrong length.
    """
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED:
        raise ValueError(f"unsupported architecture model_type={mt!r}; tensorpar supports: {', '.join(SUPPORTED)}")
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive integer, got {tp_size!r}")
    if mt == "gpt2":
        return _gpt2_plan(config, tp_size, sequence_parallel, head_split_weights, split_weights)
    nh = config.num_attention_heads
    nkv = _get(config, "num_key_value_heads", default=nh)
    hd = _get(config, "head_dim", default=config.hidden_size // nh)
    heads = HeadLayout.make(nh, nkv, hd, tp_size, split_weights=head_split_weights)
    vocab = Partition.make(config.vocab_size, tp_size, weights=split_weights, name="vocab_size")
    inter = Partition.make(config.intermediate_size, tp_size, weights=split_weights, name="intermediate_size")
    tie = bool(_get(config, "tie_word_embeddings", default=False))
    L = config.num_hidden_layers
    kv_desc = " ".join(f"r{r}:{list(u)}" for r, u in enumerate(heads.kv_heads.units))
    e = [
        PlanEntry("model.embed_tokens", "vocab_embedding", f"vocab {config.vocab_size} -> {list(vocab.sizes)}"),
        PlanEntry("model.layers.*.self_attn", "attention",
                  f"{nh} q heads -> {list(heads.q_heads.sizes)}, {nkv} kv heads -> {kv_desc}"),
        PlanEntry("model.layers.*.self_attn.q_proj", "column(heads)", f"rows {nh}x{hd} by head"),
        PlanEntry("model.layers.*.self_attn.k_proj", "column(kv heads)", f"rows {nkv}x{hd}, kv heads per rank"),
        PlanEntry("model.layers.*.self_attn.v_proj", "column(kv heads)", f"rows {nkv}x{hd}, kv heads per rank"),
        PlanEntry("model.layers.*.self_attn.o_proj", "row(heads)",
                  "reduce-scatter over sequence" if sequence_parallel else "all-reduce"),
        PlanEntry("model.layers.*.mlp", "gated_mlp", f"intermediate {config.intermediate_size} -> {list(inter.sizes)}"),
        PlanEntry("model.layers.*.mlp.gate_proj", "column", ""),
        PlanEntry("model.layers.*.mlp.up_proj", "column", ""),
        PlanEntry("model.layers.*.mlp.down_proj", "row",
                  "reduce-scatter over sequence" if sequence_parallel else "all-reduce"),
        PlanEntry("model.layers.*.input_layernorm", "replicated",
                  "sequence-parallel: grads summed over tp" if sequence_parallel else ""),
        PlanEntry("model.layers.*.post_attention_layernorm", "replicated",
                  "sequence-parallel: grads summed over tp" if sequence_parallel else ""),
        PlanEntry("model.norm", "replicated", "sequence-parallel: grads summed over tp" if sequence_parallel else ""),
        PlanEntry("lm_head", "lm_head", f"vocab {config.vocab_size} -> {list(vocab.sizes)}"
                  + (", tied to model.embed_tokens" if tie else "")),
    ]
    if sequence_parallel:
        e.insert(1, PlanEntry("model.layers.0", "sp_entry", "split sequence before the first block"))
    return ShardingPlan(mt, tp_size, sequence_parallel, heads, vocab, inter, tie, L, e)


def _gpt2_plan(config, tp_size, sequence_parallel, head_split_weights, split_weights) -> ShardingPlan:
    if sequence_parallel:
        raise ValueError("sequence_parallel=True is supported for llama, mistral and qwen2, not gpt2; "
                         "run gpt2 with sequence_parallel=False")
    nh, h = config.n_head, config.n_embd
    if h % nh:
        raise ValueError(f"n_embd ({h}) must be a multiple of n_head ({nh})")
    heads = HeadLayout.make(nh, nh, h // nh, tp_size, split_weights=head_split_weights)
    vocab = Partition.make(config.vocab_size, tp_size, weights=split_weights, name="vocab_size")
    inner = config.n_inner or 4 * h
    inter = Partition.make(inner, tp_size, weights=split_weights, name="n_inner")
    tie = bool(_get(config, "tie_word_embeddings", default=True))
    e = [
        PlanEntry("transformer.wte", "vocab_embedding", f"vocab {config.vocab_size} -> {list(vocab.sizes)}"),
        PlanEntry("transformer.wpe", "replicated", "position embeddings"),
        PlanEntry("transformer.h.*.attn", "attention", f"{nh} heads -> {list(heads.q_heads.sizes)}"),
        PlanEntry("transformer.h.*.attn.c_attn", "column(q|k|v heads)", "fused Conv1D [h, 3h]: each rank's q, k, v heads"),
        PlanEntry("transformer.h.*.attn.c_proj", "row(heads)", "Conv1D, all-reduce"),
        PlanEntry("transformer.h.*.mlp.c_fc", "column", f"Conv1D, {inner} -> {list(inter.sizes)}"),
        PlanEntry("transformer.h.*.mlp.c_proj", "row", "Conv1D, all-reduce"),
        PlanEntry("transformer.h.*.ln_1 / ln_2, transformer.ln_f", "replicated", ""),
        PlanEntry("lm_head", "lm_head", f"vocab {config.vocab_size} -> {list(vocab.sizes)}"
                  + (", tied to transformer.wte" if tie else "")),
    ]
    return ShardingPlan("gpt2", tp_size, False, heads, vocab, inter, tie, config.n_layer, e)
