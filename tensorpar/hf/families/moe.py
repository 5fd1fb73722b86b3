"""Sparse mixture-of-experts decoders: mixtral, qwen2_moe (shared expert, QKV bias), qwen3_moe (per-head q/k norm),
olmoe (q/k norms over all heads: each rank normalises its rows with an all-reduced mean of squares).

Each MoE block: the router ``mlp.gate`` (``[E, h]``) is replicated, so every rank routes every token the same
way; the stacked experts ``mlp.experts`` (``gate_up_proj [E, 2f, h]``, ``down_proj [E, h, f]``) are split inside
every expert over the expert intermediate size ``f`` (:class:`~tensorpar.hf.styles.MoEExperts`): one all-reduce
per MoE layer after the routing-weighted combine. Qwen2-MoE's block is replaced whole
(:class:`~tensorpar.hf.styles.SharedExpertMoE`): its shared expert is a gated MLP (column, row) whose partial sum
joins the routed experts' before the one all-reduce, and its sigmoid gate ``shared_expert_gate`` (``[1, h]``) is
replicated. Dense layers
(``mlp_only_layers``, ``decoder_sparse_step``) get the gated-MLP entry by layer index. Attention, norms,
embedding and LM head are as in the llama table.

Not supported (ValueError at plan time): sequence parallelism, Mixtral's router jitter noise (random per rank),
OLMoE's ``clip_qkv``. Expert parallelism (experts whole over an ep group) is the Python API
:func:`tensorpar.hf.modules.expert_parallelize`, not a plan entry.
"""
from __future__ import annotations

from tensorpar.hf.plan import ShardingPlan, _get, head_layout
from tensorpar.hf.styles import (Attention, Entry, GatedMLP, LMHead, MoEExperts, OlmoeAttention, Replicated,
                                  SharedExpertMoE, VocabEmbedding)
from tensorpar.shard import Partition


def moe_layers(config) -> list[int]:
    """Indices of the decoder layers whose MLP is a sparse MoE block (transformers' rule for Qwen-MoE;
    every layer for Mixtral)."""
    n = config.num_hidden_layers
    experts = _get(config, "num_local_experts", "num_experts", default=0)
    only = set(_get(config, "mlp_only_layers", default=()) or ())
    step = _get(config, "decoder_sparse_step", default=1)
    return [i for i in range(n) if i not in only and experts > 0 and (i + 1) % step == 0]


def plan(config, tp_size, *, sequence_parallel, head_split_weights, split_weights) -> ShardingPlan:
    mt = config.model_type
    if sequence_parallel:
        raise ValueError(f"sequence_parallel=True is not supported for {mt} (the MoE block takes no sequence "
                         f"shard); run {mt} with sequence_parallel=False")
    jitter = _get(config, "router_jitter_noise", default=0.0)
    if jitter:
        raise ValueError(f"router_jitter_noise={jitter} is not supported: the noise is drawn independently on each "
                         f"rank and would route tokens differently; set router_jitter_noise=0.0")
    clip = getattr(config, "clip_qkv", None)
    if clip is not None:
        raise ValueError(f"clip_qkv={clip} is not supported by tensorpar's {mt} attention; use a config with "
                         f"clip_qkv=None")
    heads = head_layout(config, tp_size, head_split_weights)
    vocab = Partition.make(config.vocab_size, tp_size, weights=split_weights, name="vocab_size")
    f = _get(config, "moe_intermediate_size", "intermediate_size")
    expert = Partition.make(f, tp_size, weights=split_weights,
                            name="moe_intermediate_size" if getattr(config, "moe_intermediate_size", None)
                            else "intermediate_size")
    num_experts = _get(config, "num_local_experts", "num_experts")
    tie = bool(_get(config, "tie_word_embeddings", default=False))
    sparse = moe_layers(config)
    n = config.num_hidden_layers
    dense = [i for i in range(n) if i not in sparse]
    sel = ["*"] if len(sparse) == n else [str(i) for i in sparse]

    e = [Entry("model.embed_tokens", VocabEmbedding(vocab)),
         Entry("model.layers.*.self_attn", (OlmoeAttention if mt == "olmoe" else Attention)(heads))]
    shared_f = getattr(config, "shared_expert_intermediate_size", None)
    for i in sel:
        if shared_f:                       # Qwen2-MoE: the whole block, so routed and shared share one all-reduce
            shared = Partition.make(shared_f, tp_size, weights=split_weights, name="shared_expert_intermediate_size")
            e.append(Entry(f"model.layers.{i}.mlp", SharedExpertMoE(expert, shared, num_experts)))
        else:
            e += [Entry(f"model.layers.{i}.mlp.gate", Replicated(why="router: every rank routes every token")),
                  Entry(f"model.layers.{i}.mlp.experts", MoEExperts(expert, num_experts))]
    if dense:
        inter = Partition.make(config.intermediate_size, tp_size, weights=split_weights, name="intermediate_size")
        e += [Entry(f"model.layers.{i}.mlp", GatedMLP(inter)) for i in dense]
    e += [Entry(f"model.layers.*.{m}", Replicated()) for m in ("input_layernorm", "post_attention_layernorm")]
    e += [Entry("model.norm", Replicated()),
          Entry("model.rotary_emb*", Replicated(why="rotary tables (buffers)")),
          Entry("lm_head", LMHead(vocab, tied_to="model.embed_tokens" if tie else None))]
    return ShardingPlan(mt, tp_size, False, heads, vocab, expert, tie, n, "model.layers.*", e)


from tensorpar.hf.families.record import Family  # noqa: E402

# the per-expert checkpoint layout transformers writes (its conversion_mapping): block name, (gate, up, down)
_PER_EXPERT = ("mlp", ("gate_proj", "up_proj", "down_proj"))
RECORDS = (
    Family("mixtral", plan, fast_decode=True, moe_checkpoint=("block_sparse_moe", ("w1", "w3", "w2"))),
    Family("qwen2_moe", plan, fast_decode=True, moe_checkpoint=_PER_EXPERT),
    Family("qwen3_moe", plan, fast_decode=True, moe_checkpoint=_PER_EXPERT),
    Family("olmoe", plan, fast_decode=True, moe_checkpoint=_PER_EXPERT),
)
