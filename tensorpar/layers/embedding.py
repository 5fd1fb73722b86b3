"""Vocabulary-parallel embedding (Shoeybi et al. 2019, Megatron-LM, Sec. 3, "input embedding").

The embedding table ``[V, h]`` is split by rows: rank ``r`` holds tokens
``[start_r, stop_r)`` of :attr:`partition`. A vocabulary that tp does not divide is split
near-evenly (sizes differ by at most one), so no padding rows exist at all: nothing
padded can leak into outputs or saved weights.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tensorpar import comm
from tensorpar.comm import Group
from tensorpar.layers.linear import _slice, mark_sharded
from tensorpar.shard import Partition


class VocabParallelEmbedding(nn.Module):
    """Embedding whose table is split over the tp group along the vocabulary.

    Shapes (``V_r = partition.sizes[tp_rank]``):
        input ids: ``[*]`` (global token ids in ``[0, V)``, the same on every rank);
        weight: ``[V_r, h]``;
        output: ``[*, h]`` replicated, or ``[b, s_r, h]`` with ``sequence_parallel``.

    Each rank looks up the ids it owns, writes zeros for the rest, and the partial results are
    summed. A source embedding with an ``embed_scale`` buffer (Gemma's ``ScaledWordEmbedding``) keeps
    it: the output is multiplied by it, as the original module does. Collectives: forward all-reduce (reduce-scatter along ``seq_dim`` with
    ``sequence_parallel``); backward none (all-gather with ``sequence_parallel``).

    Raises:
        ValueError: from the split (vocab smaller than tp, bad weights).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp: Group, padding_idx: int | None = None,
                 sequence_parallel: bool = False, seq_dim: int = 1, partition: Partition | None = None,
                 split_weights=None, device=None, dtype=None, _full: nn.Embedding | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp, self.padding_idx = tp, padding_idx
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        self.partition = partition or tp.partition(num_embeddings, weights=split_weights, what="vocab_size")
        if self.partition.n != num_embeddings or self.partition.tp_size != tp.size:
            raise ValueError(f"partition {self.partition.sizes} does not split vocab_size={num_embeddings} "
                             f"over tp_size={tp.size}")
        self.vocab_start, self.vocab_stop = self.partition.range(tp.rank)
        full = _full if _full is not None else nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx,
                                                            device=device, dtype=dtype)
        w = _slice(full.weight.detach(), 0, self.partition, tp.rank).clone()
        self.weight = mark_sharded(nn.Parameter(w, requires_grad=full.weight.requires_grad), 0, self.partition)
        scale = getattr(full, "embed_scale", None)  # Gemma's scaled embedding: output * sqrt(h), kept as a buffer
        if scale is not None:                       # (a tensor; BioGPT's is a Python float)
            self.register_buffer("embed_scale", torch.as_tensor(scale).detach().clone(), persistent=False)
        else:
            self.embed_scale = None

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, tp: Group, **kwargs) -> "VocabParallelEmbedding":
        """Shard an existing ``nn.Embedding`` (rows sliced; the original is not modified)."""
        return cls(emb.num_embeddings, emb.embedding_dim, tp=tp, padding_idx=emb.padding_idx, _full=emb, **kwargs)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            out = self._lookup(ids, self.padding_idx)
        else:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_stop)
            local = (ids - self.vocab_start).masked_fill(outside, 0)
            pad = None
            if self.padding_idx is not None and self.vocab_start <= self.padding_idx < self.vocab_stop:
                pad = self.padding_idx - self.vocab_start
            out = self._lookup(local, pad)
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.embed_scale is not None:
            out = out * self.embed_scale.to(out.dtype)
        if self.sequence_parallel:
            return comm.reduce_scatter_to_sequence_region(out, self.tp, self.seq_dim)
        return comm.reduce_from_tp_region(out, self.tp)

    def _lookup(self, local: torch.Tensor, pad: int | None) -> torch.Tensor:
        """Rows ``local`` (this rank's row indices, any shape) of the table -> ``[*local.shape, embedding_dim]``
        (``pad``: the padding row, which gets no gradient); a packed table looks them up itself."""
        return F.embedding(local, self.weight, pad)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, local rows [{self.vocab_start}, {self.vocab_stop}), "
                f"tp={self.tp.size}, sequence_parallel={self.sequence_parallel}")
