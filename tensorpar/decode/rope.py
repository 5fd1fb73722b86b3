"""Rotary factors per request when they depend on the sequence length (``rope_scaling`` longrope).

transformers' ``dynamic_rope_update`` picks a forward's rotary frequencies from ``max(position_ids) + 1`` over the
whole batch: ``longrope`` takes its ``long_factor`` above ``original_max_position_embeddings`` and its
``short_factor`` at or below. A request generated alone (the reference: transformers' ``generate`` of one prompt)
gets the factors of its own length; in a batch (``generate`` with several prompts, a serving step) the longest row
would decide for every row, so a short request's tokens would change when a long one shares its step. Here each row
gets the factors of its own length: its last position + 1 (a prefill row's last column is its last prompt token, a
decode row's is its new token), exactly the ``seq_len`` transformers computes for that request alone.

``dynamic`` (NTK) rescales only above ``max_position_embeddings``, which ``generate`` and ``serve`` never reach
(they refuse a prompt plus budget longer than that), so its factors are the same for every request here.

Phi-3's own ``generate`` also drops its KV cache and prefills again when a sequence crosses
``original_max_position_embeddings`` during decoding (``Phi3ForCausalLM.prepare_inputs_for_generation``); tensorpar
keeps the cache (the keys written before the crossing keep the short factors, as Llama's ``generate`` does).
"""
from __future__ import annotations

import contextlib

import torch


def rope_switch_length(rotary) -> int | None:
    """The sequence length above which ``rotary`` (a model's ``rotary_emb``) changes its factors, or ``None``."""
    if getattr(rotary, "rope_type", None) == "longrope":
        return int(rotary.config.rope_parameters["original_max_position_embeddings"])
    return None


def row_rotary(rotary, x: torch.Tensor, pos: torch.Tensor, last: torch.Tensor, switch: int):
    """``cos, sin`` ``[r, n, d]`` of positions ``pos`` ``[r, n]`` where each token takes the factors of its row's
    length ``last + 1`` (``last`` ``[r, n]``: its row's last position) instead of the whole batch's.

    Calls ``rotary`` (transformers' module, whose factors follow ``max(position_ids) + 1``) on all positions
    (long factors: a long row's last position is the largest) and, if some rows are short, again on positions
    clamped below ``switch`` (short factors), and picks per token. A padding token's position after its row's
    last one (a serving prefill) is clamped to ``last``: its rotary value is never read (its key is overwritten
    before any real query attends to it). No collectives.
    """
    pos = torch.minimum(pos, last)
    long = last >= switch                                           # row length last + 1 > switch
    if not bool(long.any()) or bool(long.all()):                    # one kind: max(pos) + 1 picks it already
        return rotary(x, pos)
    cl, sl = rotary(x, pos)
    cs, ss = rotary(x, pos.clamp(max=switch - 1))                   # every short row's positions are below switch
    m = long.unsqueeze(-1)
    return torch.where(m, cl, cs), torch.where(m, sl, ss)


class _RowRotary(torch.nn.Module):
    """Stands in for ``model.model.rotary_emb`` in :func:`per_row_rope`: each row's last column is its last token."""

    def __init__(self, rotary, switch: int):
        super().__init__()
        self.inner, self.switch = rotary, switch

    def forward(self, x, position_ids):
        last = position_ids[..., -1:].expand_as(position_ids)
        return row_rotary(self.inner, x, position_ids, last, self.switch)


@contextlib.contextmanager
def per_row_rope(model):
    """Within the block, the Hugging Face module path of ``model`` gives each batch row the rotary factors of its
    own length (rows in the layouts of ``generate`` and ``serve``: left padding, or padding after the row's last
    token, with the last column the row's last token). Nothing changes for models whose factors do not depend
    on the length."""
    base = getattr(model, "model", None)
    rotary = getattr(base, "rotary_emb", None)
    switch = rope_switch_length(rotary)
    if switch is None:
        yield
        return
    base.rotary_emb = _RowRotary(rotary, switch)
    try:
        yield
    finally:
        base.rotary_emb = rotary
