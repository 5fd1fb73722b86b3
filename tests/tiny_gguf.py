"""Write a tiny random Llama GGUF file (quantised like the real SmolLM2 one), for tests of the loading code.

The file has what transformers needs to build both a model and a tokenizer from it: llama
hyper-parameters, a byte-level BPE vocabulary (the 256 GPT-2 byte symbols, a few merges, one control
token) and weights in the same mix of types as SmolLM2's file: Q8_0 embedding, Q4_1 projections, F32
norms, and no ``output.weight`` so the embeddings are tied.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Sizes of the tiny model. Row lengths (hidden, ffn) must be multiples of 32, the GGUF block size."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 128
    context: int = 256
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    seed: int = 0


# Merges of the tiny vocabulary, in GPT-2 byte spelling ("Ġ" is the space byte).
MERGES = ("Ġ t", "h e", "Ġt he", "i n", "Ġ a", "o u", "Ġ s")
EOS = "<|endoftext|>"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def vocabulary() -> list[str]:
    """Token strings by id: the byte symbols in byte order, the merge results, then the EOS token."""
    table = bytes_to_unicode()
    tokens = [table[b] for b in range(256)]
    tokens += ["".join(m.split(" ")) for m in MERGES]
    return tokens + [EOS]


def write_tiny_llama_gguf(path: str | Path, spec: TinyLlamaSpec = TinyLlamaSpec()) -> Path:
    """Write a random tiny Llama GGUF to ``path`` (a few hundred KB); returns the path."""
    import gguf
    from gguf.quants import quantize

    Q = gguf.GGMLQuantizationType
    path = Path(path)
    tokens = vocabulary()
    head_dim = spec.hidden // spec.heads
    rng = np.random.default_rng(spec.seed)

    def normal(*shape: int, std: float = 0.05) -> np.ndarray:
        return rng.normal(0.0, std, size=shape).astype(np.float32)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-random-llama")
    w.add_block_count(spec.layers)
    w.add_context_length(spec.context)
    w.add_embedding_length(spec.hidden)
    w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.heads)
    w.add_head_count_kv(spec.kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * (len(tokens) - 1) + [gguf.TokenType.CONTROL])
    w.add_token_merges(list(MERGES))
    w.add_bos_token_id(len(tokens) - 1)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_add_bos_token(False)

    # numpy shapes are (out_features, in_features), as in torch; the writer stores them reversed.
    w.add_tensor("token_embd.weight", quantize(normal(len(tokens), spec.hidden, std=0.5), Q.Q8_0), raw_dtype=Q.Q8_0)
    for i in range(spec.layers):
        linears = {"attn_q": (spec.hidden, spec.hidden), "attn_k": (spec.kv_heads * head_dim, spec.hidden),
                   "attn_v": (spec.kv_heads * head_dim, spec.hidden), "attn_output": (spec.hidden, spec.hidden),
                   "ffn_gate": (spec.ffn, spec.hidden), "ffn_up": (spec.ffn, spec.hidden),
                   "ffn_down": (spec.hidden, spec.ffn)}
        for name, shape in linears.items():
            w.add_tensor(f"blk.{i}.{name}.weight", quantize(normal(*shape, std=0.1), Q.Q4_1), raw_dtype=Q.Q4_1)
        w.add_tensor(f"blk.{i}.attn_norm.weight", 1.0 + normal(spec.hidden))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", 1.0 + normal(spec.hidden))
    w.add_tensor("output_norm.weight", 1.0 + normal(spec.hidden))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
