"""Built-in sharding tables, one module per family; :data:`FAMILIES` maps ``config.model_type`` to its builder.

A builder is ``f(config, tp_size, *, sequence_parallel, head_split_weights, split_weights) -> ShardingPlan``.
"""
from tensorpar.hf.families import gemma, gpt2, gpt_neox, llama, moe, olmo2, phi3, starcoder2

FAMILIES = {
    "llama": llama.plan,
    "mistral": llama.plan,
    "qwen2": llama.plan,
    "qwen3": llama.plan,
    "gemma": gemma.plan,
    "gemma2": gemma.plan,
    "gemma3_text": gemma.plan,
    "phi3": phi3.plan,
    "gpt2": gpt2.plan,
    "starcoder2": starcoder2.plan,
    "gpt_neox": gpt_neox.plan,
    "olmo2": olmo2.plan,
    "mixtral": moe.plan,
    "qwen2_moe": moe.plan,
    "qwen3_moe": moe.plan,
    "olmoe": moe.plan,
}
