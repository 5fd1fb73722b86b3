"""Tensor-parallel layers: column/row-parallel linear, vocab-parallel embedding, cross-entropy and log-softmax."""
from tensorpar.layers.cross_entropy import vocab_parallel_cross_entropy
from tensorpar.layers.embedding import VocabParallelEmbedding
from tensorpar.layers.log_softmax import (vocab_parallel_log_softmax, vocab_parallel_logprobs,
                                          vocab_parallel_logsumexp, vocab_parallel_topk_logprobs)
from tensorpar.layers.linear import (ColumnParallelLinear, RowParallelLinear, column_parallel_linears,
                                     mark_sequence_parallel, mark_sharded, set_grad_comm_overlap)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
           "vocab_parallel_log_softmax", "vocab_parallel_logprobs", "vocab_parallel_logsumexp",
           "vocab_parallel_topk_logprobs",
           "mark_sharded", "mark_sequence_parallel", "column_parallel_linears", "set_grad_comm_overlap"]
