"""Tensor-parallel layers: column/row-parallel linear, vocab-parallel embedding and cross-entropy."""
from tensorpar.layers.cross_entropy import vocab_parallel_cross_entropy
from tensorpar.layers.embedding import VocabParallelEmbedding
from tensorpar.layers.linear import ColumnParallelLinear, RowParallelLinear, mark_sequence_parallel, mark_sharded

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
           "mark_sharded", "mark_sequence_parallel"]
