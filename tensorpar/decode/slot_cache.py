"""The module path's KV cache: per serving slot a static region of every layer's cache, plugged into a Hugging Face
model as its ``cache`` (the lean path keeps its own, :class:`~tensorpar.decode.lean.LeanDecoder`).
"""
from __future__ import annotations

import torch


class SlotKVCache:
    """Static per-slot KV cache holding this rank's KV heads, plugged into the model as its ``cache``.

    Storage per layer: ``k``, ``v`` of shape ``[max_batch, kv_local, max_len, head_dim]`` (``kv_local``: the KV
    heads this rank holds; allocated on the first :meth:`update` of each layer, i.e. at the engine's warm-up,
    in the dtype and on the device of the model's keys). Before each forward :meth:`bind` says which slots the
    batch rows are and at which positions their tokens go; the attention modules of
    :mod:`tensorpar.hf.modules` then call :meth:`update`, which writes the new K/V there and returns each row's
    first ``length`` cache entries. No collectives. Every position is kept, also for sliding-window layers (the
    engine's mask applies the window).
    """

    def __init__(self, max_batch: int, max_len: int):
        self.max_batch, self.max_len = max_batch, max_len
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self._slots = self._pos = None
        self._length = 0

    def bind(self, slots: torch.Tensor, positions: torch.Tensor, length: int) -> None:
        """Rows ``i`` of the next forward are slot ``slots[i]`` (``[b]`` int64) with tokens at ``positions[i]``
        (``[b, s]`` int64); attention reads cache entries ``[0, length)``."""
        self._slots, self._pos, self._length = slots, positions, length

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store ``k``, ``v`` ``[b, kv_local, s, d]`` at the bound slots/positions; return ``[b, kv_local, L, d]``."""
        if layer_idx not in self.k:
            shape = (self.max_batch, k.shape[1], self.max_len, k.shape[3])
            self.k[layer_idx] = torch.zeros(shape, dtype=k.dtype, device=k.device)
            self.v[layer_idx] = torch.zeros(shape, dtype=v.dtype, device=v.device)
        kc, vc = self.k[layer_idx], self.v[layer_idx]
        slots, pos, L = self._slots, self._pos, self._length
        kc[slots[:, None], :, pos] = k.transpose(1, 2)                     # [b, s, kv, d] into the slots
        vc[slots[:, None], :, pos] = v.transpose(1, 2)
        if slots.numel() == 1:
            i = int(slots[0])
            return kc[i:i + 1, :, :L], vc[i:i + 1, :, :L]
        return kc[:, :, :L].index_select(0, slots), vc[:, :, :L].index_select(0, slots)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.k, self.v) for t in d.values())
