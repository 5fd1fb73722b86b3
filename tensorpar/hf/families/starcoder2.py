"""StarCoder2: the Llama layout with biases everywhere, LayerNorms, a non-gated MLP (``c_fc``/``c_proj``) and
sliding-window attention.

* Attention: q/k/v column-parallel by heads (biases follow their rows), ``o_proj`` row-parallel (bias added
  once after the reduction); the window comes from ``config.sliding_window``.
* MLP: ``c_fc`` column-, ``c_proj`` row-parallel over ``intermediate_size``.
* Dropout: transformers applies StarCoder2's residual and embedding dropouts functionally
  (``nn.functional.dropout`` on torch's global generator, which would draw different masks on different
  ranks); here they become keyed dropouts: the same mask on every rank and at every tp.
"""
from __future__ import annotations

from tensorpar.hf.families.llama import decoder_plan
from tensorpar.hf.styles import KeyedEmbeddingDropout, ResidualDropoutMLP, Starcoder2Attention


def plan(config, tp_size, *, sequence_parallel, **kw):
    p = decoder_plan(config, tp_size, sequence_parallel=sequence_parallel,
                     norms=("input_layernorm", "post_attention_layernorm"), **kw)
    for e in p.entries:
        if e.pattern == "model.embed_tokens":
            e.style = KeyedEmbeddingDropout(p.vocab)
        elif e.pattern == "model.layers.*.self_attn":
            e.style = Starcoder2Attention(p.heads, sequence_parallel=sequence_parallel)
        elif e.pattern == "model.layers.*.mlp":
            e.style = ResidualDropoutMLP(p.intermediate, up="c_fc", down="c_proj", sequence_parallel=sequence_parallel)
    return p


from tensorpar.hf.families.record import Family  # noqa: E402

RECORDS = (Family("starcoder2", plan, fast_decode=True, sequence_parallel=True),)
