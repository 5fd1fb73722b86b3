"""Apply a :class:`~tensorpar.hf.plan.ShardingPlan` to a Hugging Face model, in place."""
from __future__ import annotations

import torch.nn as nn

from tensorpar.comm import Group
from tensorpar.hf.modules import TPAttention, TPGatedMLP, sequence_parallel_entry
from tensorpar.hf.plan import ShardingPlan
from tensorpar.layers.embedding import VocabParallelEmbedding
from tensorpar.layers.linear import ColumnParallelLinear, mark_sequence_parallel


def parallelize(model: nn.Module, plan: ShardingPlan, tp: Group) -> nn.Module:
    """Replace the modules of ``model`` (a ``*ForCausalLM``) by their tensor-parallel versions.

    Weights are sliced from the modules being replaced (which may live on the meta device, for
    a sharded load afterwards). Parameter names are unchanged. Returns ``model``.

    After this, ``model(input_ids).logits`` holds this rank's vocabulary slice
    ``[b, s, V_r]`` (``V_r = plan.vocab.sizes[tp_rank]``); use
    :func:`~tensorpar.layers.vocab_parallel_cross_entropy` for the loss, or gather the logits.

    Raises:
        ValueError: ``plan.tp_size`` differs from the group's size, or the model's type from the plan's.
    """
    if plan.tp_size != tp.size:
        raise ValueError(f"plan was made for tp_size={plan.tp_size} but the tp group has {tp.size} ranks")
    if model.config.model_type != plan.model_type:
        raise ValueError(f"plan is for {plan.model_type!r} but the model is {model.config.model_type!r}")
    sp = plan.sequence_parallel
    inner = model.model
    inner.embed_tokens = VocabParallelEmbedding.from_embedding(inner.embed_tokens, tp, partition=plan.vocab)
    for i, layer in enumerate(inner.layers):
        layer.self_attn = TPAttention(layer.self_attn, tp, plan.heads, sequence_parallel=sp)
        layer.mlp = TPGatedMLP(layer.mlp, tp, partition=plan.intermediate, sequence_parallel=sp)
        if sp:
            mark_sequence_parallel(layer.input_layernorm.weight)
            mark_sequence_parallel(layer.post_attention_layernorm.weight)
        if sp and i == 0:
            sequence_parallel_entry(layer, tp)
    if sp:
        mark_sequence_parallel(inner.norm.weight)
    head = ColumnParallelLinear.from_linear(model.lm_head, tp, partition=plan.vocab, sequence_parallel=sp)
    if plan.tie_word_embeddings:
        head.weight = inner.embed_tokens.weight
    model.lm_head = head
    model.tensorpar_plan = plan
    model.tp_group = tp
    return model
