"""Built-in sharding tables, one module per family; :data:`FAMILIES` maps ``config.model_type`` to its builder.

A builder is ``f(config, tp_size, *, sequence_parallel, head_split_weights, split_weights) -> ShardingPlan``.
"""
from tensorpar.hf.families import gemma, gpt2, gpt_neox, llama, moe, olmo2, phi3, starcoder2, vit

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
    "vit": vit.vit_plan,
    "dinov2": vit.dinov2_plan,
    "siglip": vit.siglip_plan,
}

#: The transformers auto class a family's plan is written for (names of its modules); the default is
#: ``AutoModelForCausalLM``. :func:`tensorpar.hf.plan.meta_model` builds this class.
MODEL_CLASSES = {
    "vit": "AutoModelForImageClassification",
    "dinov2": "AutoModelForImageClassification",
    "siglip": "AutoModelForImageClassification",
}


def is_causal_lm(model_type: str) -> bool:
    """Whether the family's plan is for a ``*ForCausalLM`` (text generation and training), not a classifier."""
    return MODEL_CLASSES.get(model_type, "AutoModelForCausalLM") == "AutoModelForCausalLM"
