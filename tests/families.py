"""Small random-weight configs of every family with a built-in plan, for the parity tests.

Head counts are chosen so that tp = 3 and 4 do not divide them (uneven head splits, KV heads that straddle
ranks or are replicated), the vocabulary (37) is divisible by none of 2, 3, 4, and dropout is off (parity is
exact math; dropout has its own tests)."""
from __future__ import annotations

V = 37


def config(model_type: str):
    import transformers as T

    common = dict(vocab_size=V, max_position_embeddings=64)
    llama_like = dict(hidden_size=40, intermediate_size=44, num_hidden_layers=2, num_attention_heads=5,
                      num_key_value_heads=5, head_dim=8, tie_word_embeddings=False, **common)
    if model_type == "llama":
        c = T.LlamaConfig(**{**llama_like, "num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 24,
                             "head_dim": 4, "tie_word_embeddings": True})
    elif model_type == "mistral":
        c = T.MistralConfig(**{**llama_like, "num_attention_heads": 6, "num_key_value_heads": 2, "sliding_window": 5, "hidden_size": 48})
    elif model_type == "qwen2":
        # 5 q heads / 1 kv head: the single KV head (with its bias) is replicated at every tp
        c = T.Qwen2Config(**{**llama_like, "num_key_value_heads": 1})
    elif model_type == "qwen3":
        c = T.Qwen3Config(**{**llama_like, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 6, "hidden_size": 48})
    elif model_type == "gemma":
        c = T.GemmaConfig(**{**llama_like, "num_key_value_heads": 1, "head_dim": 12, "tie_word_embeddings": True})
    elif model_type == "gemma2":
        c = T.Gemma2Config(**{**llama_like, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 12, "hidden_size": 48,
                              "sliding_window": 4, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0,
                              "query_pre_attn_scalar": 10, "tie_word_embeddings": True})
    elif model_type == "gemma3_text":
        c = T.Gemma3TextConfig(**{**llama_like, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 12, "hidden_size": 48,
                                  "sliding_window": 4, "query_pre_attn_scalar": 10, "tie_word_embeddings": True,
                                  "num_hidden_layers": 3, "layer_types": ["sliding_attention", "full_attention",
                                                                          "sliding_attention"]})
    elif model_type == "phi3":
        c = T.Phi3Config(**{**llama_like, "num_attention_heads": 6, "num_key_value_heads": 2, "pad_token_id": 0, "hidden_size": 48,
                            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0})
    elif model_type == "gpt2":
        c = T.GPT2Config(vocab_size=V, n_embd=24, n_layer=2, n_head=6, n_positions=64, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    else:
        raise KeyError(model_type)
    c._attn_implementation = "eager" if model_type == "gemma2" else "sdpa"   # gemma2's soft-capping needs eager
    return c


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "gpt2"]
