"""GPT-NeoX (Pythia): fused per-head interleaved ``query_key_value``, partial rotary, parallel residual.

Names: ``gpt_neox.embed_in``, ``gpt_neox.layers.*.{attention, mlp, input_layernorm, post_attention_layernorm}``,
``gpt_neox.final_layer_norm``, ``lm_head`` (``embed_out`` in older transformers). The block (parallel or
sequential residual, its ``nn.Dropout`` modules) is left as transformers wrote it: only attention and MLP
are replaced, and both leave the tp region with an all-reduce, so ``x + attn(ln1(x)) + mlp(ln2(x))`` is
computed on replicated tensors.
"""
from __future__ import annotations

from tensorpar.hf.plan import ShardingPlan, _get
from tensorpar.hf.styles import (MLP, Entry, LMHead, NeoXAttention, Replicated, SequenceParallelEntry,
                                 VocabEmbedding)
from tensorpar.layers.attention import HeadLayout
from tensorpar.shard import Partition


def plan(config, tp_size, *, sequence_parallel, head_split_weights, split_weights) -> ShardingPlan:
    nh, h = config.num_attention_heads, config.hidden_size
    if h % nh:
        raise ValueError(f"hidden_size ({h}) must be a multiple of num_attention_heads ({nh}) for gpt_neox")
    heads = HeadLayout.make(nh, nh, h // nh, tp_size, split_weights=head_split_weights)
    vocab = Partition.make(config.vocab_size, tp_size, weights=split_weights, name="vocab_size")
    inter = Partition.make(config.intermediate_size, tp_size, weights=split_weights, name="intermediate_size")
    tie = bool(_get(config, "tie_word_embeddings", default=False))
    sp = sequence_parallel
    e = [Entry("gpt_neox.embed_in", VocabEmbedding(vocab))]
    if sp:
        e.append(Entry("gpt_neox.layers.0", SequenceParallelEntry()))
    e += [Entry("gpt_neox.layers.*.attention", NeoXAttention(heads, sequence_parallel=sp)),
          Entry("gpt_neox.layers.*.mlp", MLP(inter, up="dense_h_to_4h", down="dense_4h_to_h", sequence_parallel=sp)),
          Entry("gpt_neox.layers.*.input_layernorm", Replicated(sequence_parallel=sp)),
          Entry("gpt_neox.layers.*.post_attention_layernorm", Replicated(sequence_parallel=sp)),
          Entry("gpt_neox.final_layer_norm", Replicated(sequence_parallel=sp)),
          Entry("gpt_neox.rotary_emb", Replicated(why="rotary tables (buffers)")),
          Entry("lm_head", LMHead(vocab, tied_to="gpt_neox.embed_in" if tie else None, sequence_parallel=sp))]
    return ShardingPlan(config.model_type, tp_size, sp, heads, vocab, inter, tie, config.num_hidden_layers,
                        "gpt_neox.layers.*", e)


from tensorpar.hf.families.record import Family  # noqa: E402

RECORDS = (Family("gpt_neox", plan, fast_decode=True, sequence_parallel=True),)
