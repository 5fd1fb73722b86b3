"""Sharding styles: each knows how to shard one module in place, what it claims, and how it prints.

A :class:`~tensorpar.hf.plan.ShardingPlan` maps module-name patterns to these objects, and
:func:`tensorpar.hf.apply.parallelize` does nothing but call :meth:`Style.apply` on every module whose name
matches (the printed plan is the plan that runs, as torchtitan's ``parallelize_module`` plans are). A style
claims every parameter and buffer below the module it is applied to; a plan whose entries leave some
parameter of the model unclaimed is refused when it is made. A style that builds a new module names the
tensors it carries over (:meth:`Style.keeps`); a module holding any other tensor (an extra per-head parameter,
a LoRA adapter wrapped around a projection) is refused at plan time, naming it, instead of losing it.

========================  =====================================================================================
style                     what it does (collectives: forward / backward)
========================  =====================================================================================
``VocabEmbedding``        :class:`~tensorpar.layers.VocabParallelEmbedding`, rows = vocabulary (all-reduce / -)
``Attention``             :class:`~tensorpar.hf.modules.TPAttention`: query heads split, KV heads per rank
                          (HeadLayout); separate or fused q/k/v projections (copy / all-reduce at entry,
                          all-reduce / - at the output projection)
``GatedMLP``, ``MLP``     column, (column,) row over the intermediate dim (all-reduce at the output / at entry)
``Conv1DAttention``       GPT-2's fused ``c_attn`` (each rank's q, k and v heads) and ``c_proj``
``ColumnLinear``,         one linear split by output / input features: an MLP written into its block (OPT's
``RowLinear``             ``fc1``, ``fc2``; the block's forward runs) (- / all-reduce; all-reduce / -)
``LMHead``                column-parallel over the vocabulary, logits stay sharded; may be tied
``MoEExperts``            stacked MoE experts split inside every expert (gate/up rows column, down row); one
                          all-reduce per MoE layer after the combine (:class:`~tensorpar.hf.modules.TPExperts`)
``SharedExpertMoE``       Qwen2-MoE's whole block: routed + shared experts, one all-reduce
``Replicated``            left as is; under sequence parallelism its gradients are summed over tp
========================  =====================================================================================

One module per concern: :mod:`.base` (:class:`Style`, :class:`Entry`, :class:`ApplyContext`, the whole-tensor
styles), :mod:`.dense` (attention and MLPs), :mod:`.family` (one family's variants), :mod:`.moe` (experts).
"""
from tensorpar.hf.styles.base import (ApplyContext, Entry, LMHead, Replicated, SequenceParallelEntry, Style,
                                      VocabEmbedding)
from tensorpar.hf.styles.dense import MLP, Attention, ColumnLinear, Conv1DAttention, Conv1DMLP, GatedMLP, RowLinear
from tensorpar.hf.styles.family import (EncoderAttention, FullWidthQKNormAttention, KeyedEmbeddingDropout,
                                        NeoXAttention, OlmoeAttention, ResidualDropoutMLP, Starcoder2Attention)
from tensorpar.hf.styles.moe import MoEExperts, SharedExpertMoE

__all__ = ["ApplyContext", "Entry", "LMHead", "Replicated", "SequenceParallelEntry", "Style", "VocabEmbedding",
           "MLP", "Attention", "ColumnLinear", "Conv1DAttention", "Conv1DMLP", "GatedMLP", "RowLinear",
           "EncoderAttention", "FullWidthQKNormAttention", "KeyedEmbeddingDropout", "NeoXAttention", "OlmoeAttention",
           "ResidualDropoutMLP", "Starcoder2Attention", "MoEExperts", "SharedExpertMoE"]
