"""Llama-shaped decoders: llama, mistral, qwen2 (QKV bias), qwen3 (per-head q/k RMSNorm).

Each block: attention (q/k/v column-parallel by heads, o row-parallel), gated MLP (gate/up column, down row),
two RMSNorms replicated; embedding and LM head split by vocabulary. Qwen2's q/k/v biases follow the rows of
the heads a rank holds (the bias is sharded with its projection); Qwen3's q/k norms act per head on
``head_dim`` and are replicated inside the attention style.
"""
from __future__ import annotations

from tensorpar.hf.plan import ShardingPlan, _get, head_layout
from tensorpar.hf.styles import Attention, Entry, GatedMLP, LMHead, Replicated, VocabEmbedding
from tensorpar.shard import Partition


def decoder_plan(config, tp_size, *, sequence_parallel, head_split_weights, split_weights, norms,
                 attention_kw=None, mlp_kw=None, intermediate=None, extra=()) -> ShardingPlan:
    """The table shared by rotary decoders laid out as ``model.embed_tokens / model.layers.* / model.norm /
    lm_head``; ``norms`` names each block's norms, ``extra`` adds entries (e.g. Gemma's extra norms)."""
    sp = sequence_parallel
    heads = head_layout(config, tp_size, head_split_weights)
    vocab = Partition.make(config.vocab_size, tp_size, weights=split_weights, name="vocab_size")
    inter = Partition.make(intermediate or config.intermediate_size, tp_size, weights=split_weights,
                           name="intermediate_size")
    tie = bool(_get(config, "tie_word_embeddings", default=False))
    e = [Entry("model.embed_tokens", VocabEmbedding(vocab))]
    if sp:
        e.append(Entry("model.layers.0", SequenceParallelEntry()))
    e += [Entry("model.layers.*.self_attn", Attention(heads, sequence_parallel=sp, **(attention_kw or {}))),
          Entry("model.layers.*.mlp", GatedMLP(inter, sequence_parallel=sp, **(mlp_kw or {})))]
    e += [Entry(f"model.layers.*.{n}", Replicated(sequence_parallel=sp)) for n in norms]
    e += list(extra)
    e += [Entry("model.norm", Replicated(sequence_parallel=sp)),
          Entry("model.rotary_emb*", Replicated(why="rotary tables (buffers)")),
          Entry("lm_head", LMHead(vocab, tied_to="model.embed_tokens" if tie else None, sequence_parallel=sp))]
    return ShardingPlan(config.model_type, tp_size, sp, heads, vocab, inter, tie, config.num_hidden_layers,
                        "model.layers.*", e)


def plan(config, tp_size, **kw) -> ShardingPlan:
    return decoder_plan(config, tp_size, norms=("input_layernorm", "post_attention_layernorm"), **kw)


from tensorpar.hf.styles import SequenceParallelEntry  # noqa: E402  (defined beside the other styles)


from tensorpar.hf.families.record import Family  # noqa: E402

# every llama-shaped family runs the lean decode path (qwen3: its per-head q/k norms, tensorpar.decode.block)
RECORDS = (
    Family("llama", plan, fast_decode=True, int8=True, pipeline_stages=True, sequence_parallel=True, context_parallel=True),
    Family("mistral", plan, fast_decode=True, int8=True, pipeline_stages=True, sequence_parallel=True, context_parallel=True),
    Family("qwen2", plan, fast_decode=True, int8=True, pipeline_stages=True, sequence_parallel=True, context_parallel=True),
    Family("qwen3", plan, fast_decode=True, int8=True, pipeline_stages=True, sequence_parallel=True, context_parallel=True),
)
