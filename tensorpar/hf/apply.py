"""Apply a :class:`~tensorpar.hf.plan.ShardingPlan` to a Hugging Face model, in place."""
from __future__ import annotations

import torch.nn as nn

from tensorpar.comm import Group
from tensorpar.hf.modules import TPAttention, TPConv1D, TPGatedMLP, sequence_parallel_entry
from tensorpar.shard import UnitSelection
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
    if plan.model_type == "gpt2":
        return _parallelize_gpt2(model, plan, tp)
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


def _parallelize_gpt2(model: nn.Module, plan: ShardingPlan, tp: Group) -> nn.Module:
    """GPT-2: keep HF's attention and MLP classes; replace their Conv1D layers and local sizes."""
    tr = model.transformer
    tr.wte = VocabParallelEmbedding.from_embedding(tr.wte, tp, partition=plan.vocab)
    lay = plan.heads
    nh, hd = lay.num_heads, lay.head_dim
    s, e = lay.q_heads.range(tp.rank)
    # this rank's q heads, then the same heads' k and v, in c_attn's [q | k | v] column order
    qkv = UnitSelection(3 * nh, hd, tuple(tuple(k * nh + u for k in range(3) for u in range(*lay.q_heads.range(r)))
                                          for r in range(tp.size)))
    for block in tr.h:
        attn = block.attn
        attn.c_attn = TPConv1D(attn.c_attn, tp, "column", qkv)
        attn.c_proj = TPConv1D(attn.c_proj, tp, "row", lay.q_rows)
        attn.split_size = (e - s) * hd        # q|k|v of the local heads
        attn.num_heads = e - s
        attn.embed_dim = (e - s) * hd
        block.mlp.c_fc = TPConv1D(block.mlp.c_fc, tp, "column", plan.intermediate)
        block.mlp.c_proj = TPConv1D(block.mlp.c_proj, tp, "row", plan.intermediate)
    head = ColumnParallelLinear.from_linear(model.lm_head, tp, partition=plan.vocab)
    if plan.tie_word_embeddings:
        head.weight = tr.wte.weight
    model.lm_head = head
    model.tensorpar_plan = plan
    model.tp_group = tp
    return model
