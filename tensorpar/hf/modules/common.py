"""Helpers shared by the tensor-parallel modules: entering the tp region (:func:`_project`), the rows of a rank's
heads in a fused projection, the activation of an MLP, and the sequence-parallel entry of the first block.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from tensorpar import comm
from tensorpar.comm import Group
from tensorpar.layers.attention import HeadLayout
from tensorpar.layers.fused import FUSED_KEY, fused_weight
from tensorpar.layers.linear import column_parallel_linears
from tensorpar.layers.lora import enter_tp_region, has_lora
from tensorpar.shard import UnitSelection

def _project(mod: nn.Module, x: torch.Tensor, *linears: nn.Module) -> list[torch.Tensor]:
    """Enter ``mod``'s tp region with ``x`` and apply the column-parallel ``linears`` that share it
    (:func:`tensorpar.layers.linear.column_parallel_linears`): under sequence parallelism only the sequence
    shard is kept for backward, and the input-gradient collective overlaps the weight gradients while
    ``mod.overlap_grad_comm``. LoRA projections (:mod:`tensorpar.layers.lora`) enter the region once, together,
    and add their adapters to the base products: the input gradient of both paths is reduced by that one entry
    (with the base frozen there is no weight gradient to overlap)."""
    if any(has_lora(m) for m in linears):
        x = enter_tp_region(x, mod.tp, getattr(mod, "sequence_parallel", False))
        return [m.forward_local(x) for m in linears]
    return column_parallel_linears(x, linears, mod.tp, sequence_parallel=getattr(mod, "sequence_parallel", False),
                                   seq_dim=1, overlap=getattr(mod, "overlap_grad_comm", True))


def _head_rows(layout: HeadLayout, rank_units, q_first: int, kv_first: int, v_first: int):
    """Rows of a fused ``[q heads | k heads | v heads]`` projection that each rank holds, as a UnitSelection of
    ``head_dim``-row units: its q heads, then its KV heads' k rows, then their v rows."""
    return UnitSelection(layout.num_heads + 2 * layout.num_kv_heads, layout.head_dim, tuple(
        tuple(q_first + h for h in range(*layout.q_heads.range(r)))
        + tuple(kv_first + u for u in rank_units[r]) + tuple(v_first + u for u in rank_units[r])
        for r in range(layout.tp_size)))


def _lean_fused(owner: nn.Module, names: tuple[str, ...]):
    if FUSED_KEY not in owner.__dict__:
        return None
    if any(has_lora(getattr(owner, n, None)) for n in names):   # unmerged adapters: the projections' own path
        return None
    f = fused_weight(owner, names)
    # int8 (tensorpar.decode.quantize): the projections' own dequantizing weights run; lean reads the int8 one
    return f if f is None or isinstance(f[0], torch.Tensor) else None


def _act(mlp: nn.Module):
    for name in ("act_fn", "activation_fn", "act"):
        if hasattr(mlp, name):
            return getattr(mlp, name)
    raise ValueError(f"{type(mlp).__name__} has no act_fn / activation_fn / act attribute")


def sequence_parallel_entry(layer: nn.Module, tp: Group) -> None:
    """Make ``layer`` (the first decoder block) split its input along the sequence.

    ``[b, s, h] -> [b, s_r, h]``; forward split (no communication), backward all-gather. The block's
    ``forward`` is wrapped on the instance, so parameter names are unchanged. The split happens while
    ``layer.sequence_parallel`` is true (generation turns it off: :func:`tensorpar.hf.apply.sequence_parallel_off`).
    """
    inner = layer.forward

    def forward(hidden_states, *args, **kwargs):
        if layer.sequence_parallel:
            hidden_states = comm.scatter_to_sequence_region(hidden_states, tp, dim=1)
        return inner(hidden_states, *args, **kwargs)

    layer.forward = forward
    layer.sequence_parallel = True
    layer._tensorpar_sp_entry = True
