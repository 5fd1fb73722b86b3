"""Tensor-parallel MLPs: gated (gate/up column-parallel, down row-parallel) and plain (up column, down row).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from tensorpar.comm import Group
from tensorpar.hf.modules.common import _act, _lean_fused, _project
from tensorpar.layers.linear import ColumnParallelLinear, RowParallelLinear
from tensorpar.shard import Partition, UnitSelection

class TPGatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with the intermediate dim split (column, column, row).

    Shapes: input/output ``[b, s, h]`` (``[b, s_r, h]`` with sequence parallelism); the
    intermediate ``[b, s, f_r]`` with ``f_r = partition.sizes[tp_rank]``. With ``fused`` (Phi-3's
    ``gate_up_proj``, rows ``[gate | up]``) each rank holds its gate rows and its up rows in one
    ``[2 f_r, h]`` weight.
    Collectives: forward one all-reduce (reduce-scatter, plus an all-gather at entry, with
    sequence parallelism); backward one all-reduce (or reduce-scatter + all-gather).
    ``output_dropout`` (``None`` by default) is applied to the output, as in :class:`TPAttention`.
    """

    def __init__(self, mlp: nn.Module, tp: Group, *, partition: Partition | None = None,
                 sequence_parallel: bool = False, fused: str | None = None):
        super().__init__()
        self.tp, self.sequence_parallel, self.fused = tp, sequence_parallel, fused
        if fused:
            f = getattr(mlp, fused).out_features // 2
            part = partition or tp.partition(f, what="intermediate_size")
            rows = UnitSelection(2 * f, 1, tuple(tuple(part.indices(r)) + tuple(f + i for i in part.indices(r))
                                                 for r in range(tp.size)))
            setattr(self, fused, ColumnParallelLinear.from_linear(getattr(mlp, fused), tp, partition=rows))
        else:
            part = partition or tp.partition(mlp.gate_proj.out_features, what="intermediate_size")
            self.gate_proj = ColumnParallelLinear.from_linear(mlp.gate_proj, tp, partition=part)
            self.up_proj = ColumnParallelLinear.from_linear(mlp.up_proj, tp, partition=part)
        self.down_proj = RowParallelLinear.from_linear(mlp.down_proj, tp, partition=part,
                                                       sequence_parallel=sequence_parallel)
        self.act_fn = _act(mlp)
        self.output_dropout = None
        self.overlap_grad_comm = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lean = None if (self.fused or torch.is_grad_enabled() or self.sequence_parallel) \
            else _lean_fused(self, ("gate_proj", "up_proj"))
        if self.fused:
            gate, up = _project(self, x, getattr(self, self.fused))[0].chunk(2, dim=-1)
        elif lean is not None:  # one matmul over the fused gate/up rows (tensorpar.decode.prepare.fuse_projections)
            gate, up = torch.nn.functional.linear(x, *lean).chunk(2, dim=-1)
        else:
            gate, up = _project(self, x, self.gate_proj, self.up_proj)
        y = self.down_proj(self.act_fn(gate) * up)
        return y if self.output_dropout is None else self.output_dropout(y)

    def extra_repr(self) -> str:
        return f"tp={self.tp.size}, intermediate local {self.down_proj.in_features_local}"


class TPMLP(nn.Module):
    """``down(act(up(x)))`` with the intermediate dim split (column, row); ``up``/``down`` name the projections.

    Shapes and collectives as :class:`TPGatedMLP`. ``output_dropout`` follows the output (StarCoder2's
    residual dropout, made tp-invariant by :func:`tensorpar.hf.apply.parallelize`).
    """

    def __init__(self, mlp: nn.Module, tp: Group, *, partition: Partition, up: str, down: str,
                 sequence_parallel: bool = False):
        super().__init__()
        self.tp, self.sequence_parallel, self.up, self.down = tp, sequence_parallel, up, down
        setattr(self, up, ColumnParallelLinear.from_linear(getattr(mlp, up), tp, partition=partition))
        setattr(self, down, RowParallelLinear.from_linear(getattr(mlp, down), tp, partition=partition,
                                                          sequence_parallel=sequence_parallel))
        self.act_fn = _act(mlp)
        self.output_dropout = None
        self.overlap_grad_comm = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (h,) = _project(self, x, getattr(self, self.up))
        y = getattr(self, self.down)(self.act_fn(h))
        return y if self.output_dropout is None else self.output_dropout(y)
