"""Gemma 1, 2 and 3 (text): scaled embedding, (1 + w) RMSNorms, GeGLU MLP, head_dim independent of hidden size.

* gemma: the llama table; the embedding keeps its ``embed_scale`` (sqrt(hidden)).
* gemma2: two more norms per block (pre/post feed-forward), attention logit soft-capping (passed to the kernel
  per rank: it is element-wise on each head's scores), final logit soft-capping (element-wise on the
  vocab-sharded logits, so exact), sliding-window layers.
* gemma3_text: gemma2's norms, per-head q/k norms, local and global rotary tables (``model.rotary_emb*``).
"""
from __future__ import annotations

from tensorpar.hf.families.llama import decoder_plan
from tensorpar.hf.styles import Entry, Replicated


def plan(config, tp_size, *, sequence_parallel, **kw):
    norms = ("input_layernorm", "post_attention_layernorm")
    if config.model_type in ("gemma2", "gemma3_text"):
        norms += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    return decoder_plan(config, tp_size, sequence_parallel=sequence_parallel, norms=norms, **kw)


__all__ = ["plan", "Entry", "Replicated"]


from tensorpar.hf.families.record import Family  # noqa: E402

RECORDS = tuple(Family(mt, plan, fast_decode=True, sequence_parallel=True)
                for mt in ("gemma", "gemma2", "gemma3_text"))
