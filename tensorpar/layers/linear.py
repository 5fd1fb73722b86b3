"""Column- and row-parallel linear layers (Shoeybi et al. 2019, Megatron-LM, Sec. 3).

A linear ``y = x W^T + b`` with ``W: [out, in]`` is split either

* by output rows (:class:`ColumnParallelLinear`): rank ``r`` holds ``W[out_r, :]`` and ``b[out_r]``
  and produces ``y[..., out_r]``; no reduction is needed, or
* by input columns (:class:`RowParallelLinear`): rank ``r`` holds ``W[:, in_r]`` and produces a
  partial sum that is all-reduced (or reduce-scattered under sequence parallelism); the bias is
  replicated and added once, after the reduction.

Column followed by row (the MLP, or attention's QKV then output projection) needs one
all-reduce in forward and one in backward.

Every sharded parameter carries ``tp_dim`` (the dim it is split along) and ``tp_partition``
(a :class:`~tensorpar.shard.Partition`); replicated parameters that receive only a
sequence shard's gradient carry ``sequence_parallel = True``. Checkpointing, grad-norm and
gradient synchronisation read these attributes.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tensorpar import comm
from tensorpar.comm import Group
from tensorpar.shard import Partition, UnitSelection


def mark_sharded(param: nn.Parameter, dim: int, partition: Partition | UnitSelection) -> nn.Parameter:
    """Record that ``param`` holds this rank's slice of ``dim`` under ``partition``."""
    param.tp_dim = dim
    param.tp_partition = partition  # a Partition, or a UnitSelection (overlapping units)
    return param


def mark_sequence_parallel(param: nn.Parameter) -> nn.Parameter:
    """Record that ``param`` is replicated but sees only this rank's sequence shard in backward,
    so its gradient must be summed over the tp group (:func:`tensorpar.grads.sync_sequence_parallel_grads`)."""
    param.sequence_parallel = True
    return param


def _is_peft(m: nn.Module) -> bool:
    """A PEFT tuner layer (LoRA) wrapping the linear: sharded with its adapter (:mod:`tensorpar.layers.lora`)."""
    return type(m).__module__.startswith("peft.")


def _slice(t: torch.Tensor, dim: int, partition: Partition | UnitSelection, rank: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``t`` along ``dim`` (a narrow view, or gathered units for a selection)."""
    if isinstance(partition, Partition):
        start, stop = partition.range(rank)
        return t.narrow(dim, start, stop - start)
    if t.device.type == "meta":
        shape = list(t.shape)
        shape[dim] = partition.sizes[rank]
        return t.new_empty(shape)
    return t.index_select(dim, torch.tensor(partition.indices(rank), device=t.device))


class _ColumnLinears(torch.autograd.Function):
    """Enter the tp region and apply ``k`` column-parallel linears that share one input.

    forward: all-gather ``x`` along ``seq_dim`` under sequence parallelism, then ``y_i = x W_i^T + b_i``;
    only ``x`` as given (the sequence shard) is saved.
    backward: under sequence parallelism, start the all-gather of the saved shard; compute the input
    gradient ``sum_i g_i W_i``; start its reduce-scatter (all-reduce without sequence parallelism); compute
    the weight gradients ``g_i^T x`` while it runs; wait (Megatron-LM's overlap, Narayanan et al. 2021,
    section 4.2; Korthikanti et al. 2022, section 4.2.2). With ``overlap=False`` each collective is waited
    for as soon as it is issued (same results, bit for bit).
    """

    @staticmethod
    def forward(ctx, x, tp, sequence_parallel, seq_dim, sizes, overlap, n, *params):
        weights, biases = params[:n], params[n:]
        total = comm.all_gather(x, tp, seq_dim, sizes) if sequence_parallel else x
        outs = tuple(F.linear(total, w, b) for w, b in zip(weights, biases))
        ctx.save_for_backward(x, *weights)
        ctx.tp, ctx.sp, ctx.seq_dim, ctx.sizes, ctx.overlap, ctx.n = tp, sequence_parallel, seq_dim, sizes, overlap, n
        ctx.has_bias = [b is not None for b in biases]
        return outs

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        tp, n, overlap = ctx.tp, ctx.n, ctx.overlap
        need = ctx.needs_input_grad
        need_x = need[0]
        need_w = [need[7 + i] for i in range(n)]
        need_b = [need[7 + n + i] and ctx.has_bias[i] for i in range(n)]
        cd = grads[0].dtype                                         # the compute dtype (bf16 under autocast)
        g2 = [g.reshape(-1, g.shape[-1]) for g in grads]            # [N, out_i]
        gather = None
        if any(need_w):
            gather = (comm.all_gather_async(x, tp, ctx.seq_dim, ctx.sizes) if ctx.sp
                      else comm.Pending("all_gather", tp, x, result=x))
            if not overlap:
                gather.wait()
        gx, pending = None, None
        if need_x:
            acc = None
            for g, w in zip(g2, weights):
                part = g.matmul(w.to(cd))                            # [N, in]
                acc = part if acc is None else acc.add_(part)
            acc = acc.to(x.dtype).view(*grads[0].shape[:-1], x.shape[-1])   # [b, s, in]: the gathered shape
            pending = (comm.reduce_scatter_async(acc, tp, ctx.seq_dim, ctx.sizes) if ctx.sp
                       else comm.all_reduce_async(acc, tp))
            if not overlap:
                gx = pending.wait()
        gw, gb = [None] * n, [None] * n
        if gather is not None:
            total = gather.wait()
            t2 = total.reshape(-1, total.shape[-1]).to(cd)          # [N, in]
            for i in range(n):
                if need_w[i]:
                    gw[i] = g2[i].t().matmul(t2).to(weights[i].dtype)
        for i in range(n):
            if need_b[i]:
                gb[i] = g2[i].sum(0)
        if pending is not None and gx is None:
            gx = pending.wait()
        return (gx, None, None, None, None, None, None, *gw, *gb)


def column_parallel_linears(x: torch.Tensor, linears, tp: Group, *, sequence_parallel: bool = False,
                            seq_dim: int = 1, sizes=None, overlap: bool = True) -> list[torch.Tensor]:
    """Enter the tensor-parallel region with ``x`` and apply column-parallel linears that share it.

    Shapes: ``x`` ``[*, in]`` replicated, or ``[b, s_r, in]`` (the sequence shard along ``seq_dim``, of
    ``sizes``, default equal) with ``sequence_parallel``; each linear ``i`` (anything with ``weight``
    ``[n_i, in]`` and ``bias`` ``[n_i]`` or ``None``) gives ``[*, n_i]`` (``[b, s, n_i]`` under sequence
    parallelism). Equal to ``F.linear(enter(x), W_i, b_i)`` for each ``i``, with ``enter`` =
    :func:`~tensorpar.comm.copy_to_tp_region` or :func:`~tensorpar.comm.gather_from_sequence_region`.

    Collectives: forward an all-gather of the sequence dim with ``sequence_parallel`` (else none);
    backward an all-reduce of the input gradient (reduce-scatter with ``sequence_parallel``) that runs
    while the weight gradients are computed when ``overlap``, and under sequence parallelism a second
    all-gather of the saved shard: only the ``1/t`` shard of the input is kept for backward, not the
    gathered input (Korthikanti et al. 2022, section 4.2.2). Without autograd (inference, or nothing
    requiring a gradient) it is the plain all-gather and matmuls.

    Raises:
        ValueError: from :func:`~tensorpar.comm.all_gather` when the shard sizes do not match ``x``.
    """
    if all(hasattr(m, "forward_local") for m in linears) and not (torch.is_grad_enabled() and (
            x.requires_grad or any(p.requires_grad for m in linears for p in m.parameters()))):
        # no gradient needed: each module's own local product (F.linear; the int8 matmul of a quantized module)
        total = comm.all_gather(x, tp, seq_dim, sizes) if sequence_parallel and tp.size > 1 else x
        return [m.forward_local(total) for m in linears]
    weights = [m.weight for m in linears]
    biases = [m.bias for m in linears]
    if tp.size == 1:
        return [F.linear(x, w, b) for w, b in zip(weights, biases)]
    grad = torch.is_grad_enabled() and (x.requires_grad or any(p is not None and p.requires_grad
                                                               for p in (*weights, *biases)))
    if not grad:
        total = comm.all_gather(x, tp, seq_dim, sizes) if sequence_parallel else x
        return [F.linear(total, w, b) for w, b in zip(weights, biases)]
    return list(_ColumnLinears.apply(x, tp, sequence_parallel, seq_dim, sizes, overlap, len(linears),
                                     *weights, *biases))


def set_grad_comm_overlap(model: nn.Module, enabled: bool) -> int:
    """Switch the overlap of the input-gradient collective with the weight-gradient matmuls (see
    :func:`column_parallel_linears`) on or off in every tensor-parallel module of ``model`` that has it
    (attribute ``overlap_grad_comm``); returns how many modules were set. Results are identical either way."""
    count = 0
    for m in model.modules():
        if hasattr(m, "overlap_grad_comm"):
            m.overlap_grad_comm = bool(enabled)
            count += 1
    return count


class ColumnParallelLinear(nn.Module):
    """Linear layer with its output features split over the tp group.

    Shapes (``n_r = partition.sizes[tp_rank]``):
        input: ``[*, in_features]`` (replicated), or ``[b, s_r, in_features]`` with ``sequence_parallel``;
        weight: ``[n_r, in_features]``; bias: ``[n_r]``;
        output: ``[*, n_r]``, or ``[*, out_features]`` with ``gather_output``.

    Collectives: forward all-gather of the sequence dim if ``sequence_parallel``, all-gather of
    the output if ``gather_output``; backward all-reduce of the input gradient (reduce-scatter
    with ``sequence_parallel``, plus an all-gather of the saved sequence shard), overlapped with the
    weight gradient while ``overlap_grad_comm`` (see :func:`column_parallel_linears`), and a split of
    the output gradient with ``gather_output``.

    Args:
        in_features, out_features: global sizes.
        tp: the tensor-parallel group.
        bias: whether to add a (sharded) bias.
        gather_output: all-gather the output so every rank has ``[*, out_features]``.
        sequence_parallel: the input is split along ``seq_dim``; gather it first.
        partition: explicit split of ``out_features``; else built from ``split_weights`` and ``unit``.
        split_weights, unit: see :func:`tensorpar.shard.split_sizes`.

    Raises:
        ValueError: from the split (too few rows for tp, bad weights).
    """

    def __init__(self, in_features: int, out_features: int, *, tp: Group, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, seq_dim: int = 1,
                 partition: Partition | UnitSelection | None = None, split_weights=None, unit: int = 1,
                 device=None, dtype=None, _full: nn.Linear | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.tp, self.gather_output = tp, gather_output
        if gather_output and partition is not None and not partition.is_disjoint:
            raise ValueError("gather_output needs a disjoint partition of out_features, not overlapping units")
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        self.partition = partition or tp.partition(out_features, weights=split_weights, unit=unit, what="out_features")
        if self.partition.n != out_features or self.partition.tp_size != tp.size:
            raise ValueError(f"partition {self.partition.sizes} does not split out_features={out_features} "
                             f"over tp_size={tp.size}")
        # Initialise the full weight and slice it, so the layer is the same function at every tp.
        full = _full if _full is not None else nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        w = _slice(full.weight.detach(), 0, self.partition, tp.rank).clone()
        self.weight = mark_sharded(nn.Parameter(w, requires_grad=full.weight.requires_grad), 0, self.partition)
        if full.bias is not None:
            b = _slice(full.bias.detach(), 0, self.partition, tp.rank).clone()
            self.bias = mark_sharded(nn.Parameter(b, requires_grad=full.bias.requires_grad), 0, self.partition)
        else:
            self.register_parameter("bias", None)
        self.overlap_grad_comm = True

    @classmethod
    def from_linear(cls, linear: nn.Linear, tp: Group, **kwargs) -> "ColumnParallelLinear":
        """Shard an existing ``nn.Linear`` (its weight rows are sliced; the original is not modified); a PEFT LoRA
        layer becomes a :class:`~tensorpar.layers.lora.LoraColumnParallelLinear` (its adapter sharded with it)."""
        if _is_peft(linear):
            from tensorpar.layers.lora import LoraColumnParallelLinear
            return LoraColumnParallelLinear.from_peft(linear, tp, **kwargs)
        return cls(linear.in_features, linear.out_features, tp=tp, bias=linear.bias is not None, _full=linear, **kwargs)

    @property
    def out_features_local(self) -> int:
        return self.partition.sizes[self.tp.rank]

    def forward_local(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W_r^T + b_r`` with no communication: for callers that already entered the tp region."""
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = column_parallel_linears(x, [self], self.tp, sequence_parallel=self.sequence_parallel,
                                    seq_dim=self.seq_dim, overlap=self.overlap_grad_comm)[0]
        if self.gather_output:
            y = comm.gather_from_tp_region(y, self.tp, self.partition)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (local {self.out_features_local}), "
                f"tp={self.tp.size}, gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Linear layer with its input features split over the tp group.

    Shapes (``k_r = partition.sizes[tp_rank]``):
        input: ``[*, k_r]`` if ``input_is_parallel`` else ``[*, in_features]``;
        weight: ``[out_features, k_r]``; bias: ``[out_features]`` (replicated);
        output: ``[*, out_features]`` (replicated), or ``[b, s_r, out_features]`` with ``sequence_parallel``.

    Collectives: forward all-reduce of the partial products (reduce-scatter along ``seq_dim``
    with ``sequence_parallel``), and a split of the input if not ``input_is_parallel``;
    backward identity (all-gather with ``sequence_parallel``) and an all-gather of the input
    gradient if not ``input_is_parallel``.

    The bias is added after the reduction, so it is counted once, not ``tp`` times.

    Raises:
        ValueError: from the split (too few columns for tp, bad weights).
    """

    def __init__(self, in_features: int, out_features: int, *, tp: Group, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, seq_dim: int = 1,
                 partition: Partition | None = None, split_weights=None, unit: int = 1,
                 device=None, dtype=None, _full: nn.Linear | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.tp, self.input_is_parallel = tp, input_is_parallel
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        self.partition = partition or tp.partition(in_features, weights=split_weights, unit=unit, what="in_features")
        if self.partition.n != in_features or self.partition.tp_size != tp.size:
            raise ValueError(f"partition {self.partition.sizes} does not split in_features={in_features} "
                             f"over tp_size={tp.size}")
        full = _full if _full is not None else nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        w = _slice(full.weight.detach(), 1, self.partition, tp.rank).clone()
        self.weight = mark_sharded(nn.Parameter(w, requires_grad=full.weight.requires_grad), 1, self.partition)
        if full.bias is not None:
            self.bias = nn.Parameter(full.bias.detach().clone(), requires_grad=full.bias.requires_grad)
            if sequence_parallel:
                mark_sequence_parallel(self.bias)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, tp: Group, **kwargs) -> "RowParallelLinear":
        """Shard an existing ``nn.Linear`` (its weight columns are sliced; the original is not modified); a PEFT LoRA
        layer becomes a :class:`~tensorpar.layers.lora.LoraRowParallelLinear` (its adapter sharded with it)."""
        if _is_peft(linear):
            from tensorpar.layers.lora import LoraRowParallelLinear
            return LoraRowParallelLinear.from_peft(linear, tp, **kwargs)
        return cls(linear.in_features, linear.out_features, tp=tp, bias=linear.bias is not None, _full=linear, **kwargs)

    @property
    def in_features_local(self) -> int:
        return self.partition.sizes[self.tp.rank]

    def partial_product(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum ``x_r @ W_r^T`` ``[*, out]`` before the all-reduce (no collectives; a LoRA layer
        adds its adapter's partial here, so one all-reduce sums both)."""
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = comm.scatter_to_tp_region(x, self.tp, self.partition)
        y = self.partial_product(x)
        if self.sequence_parallel:
            y = comm.reduce_scatter_to_sequence_region(y, self.tp, self.seq_dim)
        else:
            y = comm.reduce_from_tp_region(y, self.tp)
        if self.bias is not None:
            y = y + self.bias
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.in_features_local}), out_features={self.out_features}, "
                f"tp={self.tp.size}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")
