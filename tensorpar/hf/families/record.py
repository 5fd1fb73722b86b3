"""What tensorpar can do with one Hugging Face ``model_type``: the family's record.

Each module of :mod:`tensorpar.hf.families` exports ``RECORDS``, one :class:`Family` per model type it shards.
Capabilities that hold for a whole family live in the record; the few that depend on the config (an active
sliding window, a model with no experts) are decided by :func:`tensorpar.hf.families.why_not`, the one query the
launching process and the ranks both ask, so a config the parent accepts never fails in a rank for a reason the
parent could have checked.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Family:
    """The record of one ``model_type``.

    Attributes:
        model_type: the Hugging Face ``config.model_type``.
        plan: the sharding-table builder ``f(config, tp_size, *, sequence_parallel, head_split_weights,
            split_weights) -> ShardingPlan``.
        model_class: the transformers auto class the plan's module names are written for.
        fast_decode: the lean decode path (:class:`tensorpar.decode.lean.LeanDecoder`: fused QKV and gate-up matmuls,
            static KV cache) runs this family; it is also what ``--quantize int8`` needs.
        int8: ``--quantize int8`` (:func:`tensorpar.decode.quantize.quantize_int8`) quantizes it: its layers are
            separate q/k/v projections and a gated MLP with separate gate/up projections (the fused and plain-MLP
            layouts of Phi-3, StarCoder2 and GPT-NeoX and the expert blocks are not quantized yet).
        pipeline_stages: :class:`tensorpar.pipeline.stages.DecoderStage` can cut it (blocks that need only the
            causal mask and the shared rotary table).
        sequence_parallel: its plan splits the sequence between blocks (parity proven in the family tests).
        context_parallel: its attention (:class:`tensorpar.hf.modules.TPAttention`, rotary from ``position_ids``)
            runs over a sequence split across cp ranks (:mod:`tensorpar.layers.ring_attention`).
        moe_checkpoint: for mixture-of-experts families, ``(block name in the checkpoint, (gate, up, down)
            per-expert names)`` of the per-expert checkpoint layout (:mod:`tensorpar.hf.moe_checkpoint`);
            ``None`` for dense families. Expert parallelism needs it.
    """

    model_type: str
    plan: Callable
    model_class: str = "AutoModelForCausalLM"
    fast_decode: bool = False
    int8: bool = False
    pipeline_stages: bool = False
    sequence_parallel: bool = False
    context_parallel: bool = False
    moe_checkpoint: tuple[str, tuple[str, str, str]] | None = None

    @property
    def causal_lm(self) -> bool:
        """A text decoder (generate, train, serve), not an image classifier."""
        return self.model_class == "AutoModelForCausalLM"

    @property
    def expert_parallel(self) -> bool:
        """Experts can be distributed whole over an ep group."""
        return self.moe_checkpoint is not None
