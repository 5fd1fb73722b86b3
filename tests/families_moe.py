"""Small random-weight configs of the mixture-of-experts families with a built-in plan, for the parity tests.

5 query heads and 5 or 1 KV heads (tp = 3, 4 split them unevenly or replicate the KV head); 4 experts with
top-2 routing; expert intermediate sizes 12, 20, 16, 12: multiples of 4, as transformers' default
``grouped_mm`` experts kernel needs 16-byte rows for the unsharded model, while their splits at tp = 2..4 put
ranks on both the ``grouped_mm`` path and the eager fallback of :class:`tensorpar.hf.modules.TPExperts`, some
unevenly (20 and 16 at tp = 3); vocabulary 37 (divisible by none of 2, 3, 4); dropout off. qwen3_moe has one
dense layer (``mlp_only_layers``) to cover the mixed table."""
from __future__ import annotations

V = 37


def config(model_type: str):
    import transformers as T

    common = dict(vocab_size=V, max_position_embeddings=64, hidden_size=40, num_hidden_layers=2,
                  num_attention_heads=5, num_key_value_heads=5, head_dim=8, tie_word_embeddings=False,
                  num_experts_per_tok=2, router_aux_loss_coef=0.02)
    if model_type == "mixtral":
        c = T.MixtralConfig(**common, intermediate_size=12, num_local_experts=4)
    elif model_type == "qwen2_moe":
        # single KV head with its bias replicated at every tp; shared expert (14) and its sigmoid gate
        c = T.Qwen2MoeConfig(**{**common, "num_key_value_heads": 1}, moe_intermediate_size=20, intermediate_size=22,
                             shared_expert_intermediate_size=14, num_experts=4, norm_topk_prob=False)
    elif model_type == "qwen3_moe":
        c = T.Qwen3MoeConfig(**common, moe_intermediate_size=16, intermediate_size=22, num_experts=4,
                             norm_topk_prob=True, mlp_only_layers=[1])
    elif model_type == "olmoe":
        # q_norm / k_norm span all heads; 5 q heads and 1 KV head (replicated on every rank: its k_norm rows
        # are counted on their owner only)
        c = T.OlmoeConfig(**{**common, "num_key_value_heads": 1}, intermediate_size=12, num_experts=4)
    else:
        raise KeyError(model_type)
    c._attn_implementation = "sdpa"
    return c


FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]
