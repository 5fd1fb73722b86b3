"""Tensor-parallel replacements for the attention, MLP, norm and expert modules of Hugging Face models.

They keep the submodule names of the modules they replace (``q_proj``, ``gate_proj``, ...), so
parameter names, and therefore safetensors keys and ``state_dict`` keys, stay those of the
original model. Each enters the tensor-parallel region once (one all-reduce of the input
gradient in backward, or one sequence all-gather under sequence parallelism) and leaves it
through its row-parallel output projection (one all-reduce, or one reduce-scatter).

One module per concern: :mod:`.attention` (rotary decoders and encoders), :mod:`.fused_qkv` (GPT-2 and
GPT-NeoX, whose checkpoints fuse q, k and v), :mod:`.mlp`, :mod:`.norms` (norms over a split hidden dimension),
:mod:`.experts` (tensor- and expert-parallel mixtures of experts), :mod:`.common` (the helpers they share).
"""
from tensorpar.hf.modules.attention import (TPAttention, TPEncoderAttention, TPOlmo2Attention, TPOlmoeAttention,
                                            TPStarcoder2Attention, context_parallelize)
from tensorpar.hf.modules.common import sequence_parallel_entry
from tensorpar.hf.modules.experts import (EPExperts, TPExperts, TPSharedExpertMoE, ep_load_balancing_loss,
                                          expert_parallelize)
from tensorpar.hf.modules.fused_qkv import TPConv1D, TPGPT2Attention, TPGPTNeoXAttention
from tensorpar.hf.modules.mlp import TPMLP, TPGatedMLP
from tensorpar.hf.modules.norms import TPRMSNorm, TPSpanningRMSNorm, all_reduce_sum

__all__ = ["TPAttention", "TPEncoderAttention", "TPOlmo2Attention", "TPOlmoeAttention", "TPStarcoder2Attention",
           "context_parallelize", "sequence_parallel_entry", "EPExperts", "TPExperts", "TPSharedExpertMoE",
           "ep_load_balancing_loss",
           "expert_parallelize", "TPConv1D", "TPGPT2Attention", "TPGPTNeoXAttention", "TPMLP", "TPGatedMLP",
           "TPRMSNorm", "TPSpanningRMSNorm", "all_reduce_sum"]
