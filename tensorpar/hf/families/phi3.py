"""Phi-3: fused ``qkv_proj`` (rows ``[q | k | v]``) and fused ``gate_up_proj`` (rows ``[gate | up]``).

Each rank's slice of ``qkv_proj`` is its q heads' rows, then its KV heads' k rows, then their v rows; of
``gate_up_proj`` its gate rows then its up rows: never one contiguous block of the fused weight.
The residual dropouts of each block are replaced by keyed dropouts (same mask on every rank).
"""
from __future__ import annotations

from tensorpar.hf.families.llama import decoder_plan


def plan(config, tp_size, **kw):
    return decoder_plan(config, tp_size, norms=("input_layernorm", "post_attention_layernorm"),
                        attention_kw={"fused": "qkv_proj"}, mlp_kw={"fused": "gate_up_proj"}, **kw)


from tensorpar.hf.families.record import Family  # noqa: E402

RECORDS = (Family("phi3", plan, fast_decode=True, sequence_parallel=True),)
