"""OLMo 2: the Llama layout with norms after attention and MLP (``post_attention_layernorm``,
``post_feedforward_layernorm``, no input norm) and q/k RMSNorms over the whole projection.

``q_norm`` normalises all ``heads * head_dim`` query features together and ``k_norm`` all
``kv_heads * head_dim`` key features, before the split into heads, so neither is per head: each rank holds
its heads' rows of the norm weights and the sum of squares is all-reduced over tp, with a KV head held by
several ranks counted on its owner only (:class:`~tensorpar.hf.modules.TPRMSNorm`).
"""
from __future__ import annotations

from tensorpar.hf.families.llama import decoder_plan
from tensorpar.hf.styles import FullWidthQKNormAttention


def plan(config, tp_size, *, sequence_parallel, **kw):
    p = decoder_plan(config, tp_size, sequence_parallel=sequence_parallel,
                     norms=("post_attention_layernorm", "post_feedforward_layernorm"), **kw)
    for e in p.entries:
        if e.pattern == "model.layers.*.self_attn":
            e.style = FullWidthQKNormAttention(p.heads, sequence_parallel=sequence_parallel)
    return p


from tensorpar.hf.families.record import Family  # noqa: E402

RECORDS = (Family("olmo2", plan, fast_decode=True, int8=True, sequence_parallel=True),)
