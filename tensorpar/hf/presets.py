"""The random-weight model presets (``tiny``, ``small``, ``bench``) that ``train``, ``verify`` and the planner read.

Llama-shaped configs; the vocabulary size comes from the tokenizer, so it is an argument of :func:`preset_config`.
"""
from __future__ import annotations

# Llama-style architectures trained from scratch. vocab_size comes from the tokenizer, so it is not here.
# num_key_value_heads < num_attention_heads everywhere: grouped-query attention is the case that needs care.
PRESETS: dict[str, dict] = {
    # a few seconds per 100 steps on a laptop core; what the CI trains
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True),
    # ~3 M parameters besides the embedding: learns Shakespeare's spelling in a few hundred steps on a CPU
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, tie_word_embeddings=True),
    # the benchmark model: heads and KV heads divisible by 2, untied, so torch's parallelize_module runs it too
    "bench": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=6,
                  num_key_value_heads=2, tie_word_embeddings=False),
}


def preset_config(name: str, vocab_size: int, seq_len: int, *, attention_dropout: float = 0.0):
    """A ``LlamaConfig`` for preset ``name`` with the tokenizer's vocabulary.

    Raises ValueError for an unknown preset, listing the known ones.
    """
    from transformers import LlamaConfig

    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)} (or give a config.json "
                         f"path, a model folder, or smollm2)")
    p = PRESETS[name]
    return LlamaConfig(vocab_size=vocab_size, max_position_embeddings=max(seq_len, 256), rms_norm_eps=1e-5,
                       rope_theta=10000.0, attention_dropout=attention_dropout, **p)
