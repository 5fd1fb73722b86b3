"""GPT-2: Conv1D layers (weights ``[in, out]``), fused ``c_attn``, learned position embeddings, tied LM head."""
from __future__ import annotations

from tensorpar.hf.plan import ShardingPlan, _get
from tensorpar.hf.styles import Conv1DAttention, Conv1DMLP, Entry, LMHead, Replicated, VocabEmbedding
from tensorpar.layers.attention import HeadLayout
from tensorpar.shard import Partition


def plan(config, tp_size, *, sequence_parallel, head_split_weights, split_weights) -> ShardingPlan:
    if sequence_parallel:
        raise ValueError("sequence_parallel=True is not supported for gpt2 (its blocks take no sequence shard); "
                         "run gpt2 with sequence_parallel=False")
    nh, h = config.n_head, config.n_embd
    if h % nh:
        raise ValueError(f"n_embd ({h}) must be a multiple of n_head ({nh})")
    heads = HeadLayout.make(nh, nh, h // nh, tp_size, split_weights=head_split_weights)
    vocab = Partition.make(config.vocab_size, tp_size, weights=split_weights, name="vocab_size")
    inner = config.n_inner or 4 * h
    inter = Partition.make(inner, tp_size, weights=split_weights, name="n_inner")
    tie = bool(_get(config, "tie_word_embeddings", default=True))
    e = [Entry("transformer.wte", VocabEmbedding(vocab)),
         Entry("transformer.wpe", Replicated(why="position embeddings")),
         Entry("transformer.h.*.attn", Conv1DAttention(heads)),
         Entry("transformer.h.*.mlp", Conv1DMLP(inter)),
         Entry("transformer.h.*.ln_*", Replicated()),
         Entry("transformer.ln_f", Replicated()),
         Entry("lm_head", LMHead(vocab, tied_to="transformer.wte" if tie else None))]
    return ShardingPlan("gpt2", tp_size, False, heads, vocab, inter, tie, config.n_layer, "transformer.h.*", e)


from tensorpar.hf.families.record import Family  # noqa: E402

RECORDS = (Family("gpt2", plan),)
