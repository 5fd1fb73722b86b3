"""Small random-weight configs of StarCoder2, GPT-NeoX and OLMo 2 for the parity tests (same rules as
tests/families.py: head and KV-head counts not divisible by 3 or 4, vocabulary 37, dropout off).

A name may carry a variant after ``:`` (``olmo2:kv1``); ``config(name).model_type`` is the family."""
from __future__ import annotations

V = 37


def config(name: str):
    import transformers as T

    model_type, _, variant = name.partition(":")
    common = dict(vocab_size=V, max_position_embeddings=64, num_hidden_layers=2, tie_word_embeddings=False,
                  bos_token_id=0, eos_token_id=0)
    if model_type == "starcoder2":
        # 10 q heads / 2 kv heads (groups of 5): at tp = 3 and 4 a KV head straddles two ranks; biases on;
        # a sliding window shorter than the test sequence
        # (":nobias": use_bias=False)
        c = T.Starcoder2Config(hidden_size=40, intermediate_size=46, num_attention_heads=10, num_key_value_heads=2,
                               sliding_window=5, use_bias=variant != "nobias", residual_dropout=0.0,
                               embedding_dropout=0.0,
                               attention_dropout=0.0, **common)
    elif model_type == "gpt_neox":
        # 5 heads of 8, rotary on a quarter of each head (2 of 8 dims), parallel residual (or not: ":seq");
        # ":tied": LM head tied to embed_in, no attention biases
        c = T.GPTNeoXConfig(hidden_size=40, intermediate_size=46, num_attention_heads=5, rotary_pct=0.25,
                            use_parallel_residual=variant != "seq", hidden_dropout=0.0, attention_dropout=0.0,
                            attention_bias=variant != "tied", **common)
        c.tie_word_embeddings = variant == "tied"
    elif model_type == "olmo2":
        # default: 10 q heads / 2 kv heads (a KV head duplicated on two ranks at tp = 3, 4);
        # ":kv1": 5 q heads / 1 kv head (the KV head, and its k_norm rows, replicated on every rank)
        nh, nkv = (5, 1) if variant == "kv1" else (10, 2)
        c = T.Olmo2Config(hidden_size=40, intermediate_size=46, num_attention_heads=nh, num_key_value_heads=nkv,
                          attention_bias=variant == "kv1", attention_dropout=0.0, **common)
    else:
        raise KeyError(name)
    c._attn_implementation = "sdpa"
    return c


FAMILIES = ["starcoder2", "gpt_neox", "gpt_neox:seq", "olmo2", "olmo2:kv1"]
# tested at tp = 3 only
VARIANTS = ["starcoder2:nobias", "gpt_neox:tied"]
