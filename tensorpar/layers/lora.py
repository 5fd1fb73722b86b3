"""LoRA adapters under tensor parallelism: PEFT's ``lora.Linear`` sharded together with its base layer.

A LoRA projection computes ``y = x W^T + b + s * B(A(dropout(x)))`` with ``A [r, in]``, ``B [out, r]`` and
``s = lora_alpha / r`` (Hu et al. 2021; PEFT's ``peft.tuners.lora.Linear``). The adapters follow the split of the
base weight (the same rule as Megatron-style LoRA, e.g. NeMo's ``ParallelLinearAdapter``):

* column-parallel base (``W`` split by output rows): ``A`` replicated, ``B`` split by the same output rows as
  ``W``, so each rank's output slice gets its own slice of the adapter product. ``A``'s gradient on a rank covers
  only its ``B`` rows (``(B_r^T g_r)^T x``): it is a partial sum, summed over tp after backward (marked like the
  sequence-parallel norm weights, :func:`tensorpar.grads.sync_sequence_parallel_grads`).
* row-parallel base (``W`` split by input columns): ``A`` split by the same input columns, ``B`` replicated; the
  rank's ``B (A_r x_r)`` is a partial product like ``W_r x_r``, and the one all-reduce (reduce-scatter under
  sequence parallelism) runs after their sum: ``y = sum_r (x_r W_r^T + s B A_r x_r) + b``. ``B``'s gradient is a
  partial sum (it sees ``A_r x_r`` only): summed over tp after backward.

The base weight keeps the name and layout of the plain parallel linear (``q_proj.weight``: the checkpoint's name,
so a sharded load reads it as usual) and is frozen when PEFT froze it; the adapters keep PEFT's names
(``q_proj.lora_A.default.weight``). :func:`peft_state_dict` turns such names into PEFT's saved ones.

Dropout on the adapter's input (``lora_dropout > 0``) is keyed (:mod:`tensorpar.layers.dropout`), so the masks are
the same at every tp: the column case draws the mask of the replicated input, the row case draws the mask of the
whole ``[b, s, in]`` input and keeps its columns.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tensorpar import comm
from tensorpar.comm import Group
from tensorpar.layers.dropout import KeyedDropout, keep_mask
from tensorpar.layers.linear import (ColumnParallelLinear, RowParallelLinear, _slice, mark_sequence_parallel,
                                     mark_sharded)


def is_lora_layer(m: nn.Module) -> bool:
    """Whether ``m`` is a PEFT LoRA tuner layer (``peft.tuners.lora.*`` with a ``base_layer`` and ``lora_A``)."""
    return (type(m).__module__.startswith("peft.tuners.lora") and isinstance(getattr(m, "base_layer", None),
                                                                              nn.Module)
            and isinstance(getattr(m, "lora_A", None), nn.ModuleDict))


def lora_problem(m: nn.Module) -> str | None:
    """Why the PEFT tuner layer ``m`` cannot be sharded (None if it can): tensorpar shards plain LoRA on an
    ``nn.Linear`` base with one adapter (no DoRA, no adapter bias, no ``fan_in_fan_out``)."""
    if not is_lora_layer(m):
        return f"{type(m).__name__} (a PEFT tuner other than LoRA on a linear layer)"
    if type(m).__name__ != "Linear" or type(m.base_layer) is not nn.Linear:
        return f"LoRA on {type(m.base_layer).__name__} (tensorpar shards LoRA on nn.Linear layers only)"
    names = list(m.lora_A.keys())
    if len(names) != 1:
        return f"{len(names)} adapters {names} (one adapter per model)"
    name = names[0]
    if m.use_dora.get(name, False):
        return "DoRA (use_dora=True)"
    if m.lora_B[name].bias is not None:
        return "an adapter bias (lora_bias=True)"
    if getattr(m, "fan_in_fan_out", False):
        return "fan_in_fan_out=True"
    if bool(getattr(m, "merged_adapters", [])):
        return "adapters merged into the base weight (unmerge them first)"
    return None


class _Matrix(nn.Module):
    """One adapter matrix under PEFT's name (``lora_A.<adapter>.weight``); ``weight`` is this rank's part."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class LoraDropout(nn.Dropout):
    """The adapter's input dropout; :func:`tensorpar.hf.apply.parallelize` turns it into its keyed form through
    :meth:`keyed` (the input is replicated over tp, or split by columns ``partition`` for a row-parallel base)."""

    def __init__(self, p: float, partition=None):
        super().__init__(p)
        self.partition = partition

    def keyed(self, rng, key, tp: Group) -> KeyedDropout:
        if self.partition is None:
            return KeyedDropout(self.p, rng, key, tp)         # the entered input: the same on every rank
        return ColumnKeyedDropout(self.p, rng, key, tp, self.partition)


class ColumnKeyedDropout(KeyedDropout):
    """Keyed dropout of an input split by its last dimension ``[b, s, in_r]``: the mask of the whole ``[b, s, in]``
    is drawn (the same on every rank) and the rank keeps its columns of ``partition``. No collectives."""

    def __init__(self, p, rng, key, tp: Group, partition):
        super().__init__(p, rng, key, tp)
        self.partition = partition

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        full = list(x.shape[:-1]) + [self.partition.n]
        mask = keep_mask(self.rng.generator(x.device, *self.key), full, self.p, x.device)
        mask = _slice(mask, -1 % mask.dim(), self.partition, self.tp.rank)
        return x * mask.to(x.dtype) / (1.0 - self.p)


class _Adapter:
    """What both LoRA linears share: the adapter's name, scaling, matrices and dropout."""

    _split: str       # which adapter matrix follows the base weight's split: "B" (column-parallel) or "A" (row)

    @classmethod
    def from_peft(cls, layer: nn.Module, tp: Group, **kwargs):
        """The sharded layer of a PEFT ``lora.Linear`` ``layer`` (its ``base_layer`` an ``nn.Linear`` holding the
        full weight): the base weight split as the class splits it, the adapter as :meth:`_take_adapter`."""
        base = layer.base_layer
        out = cls(base.in_features, base.out_features, tp=tp, bias=base.bias is not None, _full=base, **kwargs)
        out._take_adapter(layer, tp, split=cls._split, partition=out.partition)
        return out

    def _take_adapter(self, layer: nn.Module, tp: Group, *, split: str, partition) -> None:
        """Copy ``layer``'s (a PEFT ``lora.Linear``) adapter into this module: ``split`` "B" (column-parallel
        base: ``B`` rows of ``partition``, ``A`` replicated) or "A" (row-parallel: ``A`` columns, ``B``
        replicated). Replicated matrices are marked so their partial gradients are summed over tp."""
        (name,) = list(layer.lora_A.keys())
        self.adapter_name, self.scaling = name, float(layer.scaling[name])
        self.r = layer.r[name]
        a, b = layer.lora_A[name].weight, layer.lora_B[name].weight       # [r, in], [out, r]
        if split == "B":
            pa = mark_sequence_parallel(nn.Parameter(a.detach().clone(), requires_grad=a.requires_grad))
            pb = mark_sharded(nn.Parameter(_slice(b.detach(), 0, partition, tp.rank).clone(),
                                           requires_grad=b.requires_grad), 0, partition)
        else:
            pa = mark_sharded(nn.Parameter(_slice(a.detach(), 1, partition, tp.rank).clone(),
                                           requires_grad=a.requires_grad), 1, partition)
            pb = mark_sequence_parallel(nn.Parameter(b.detach().clone(), requires_grad=b.requires_grad))
        pa.lora_adapter = pb.lora_adapter = True   # not in the base checkpoint (tensorpar.hf.load keeps them)
        self.lora_A = nn.ModuleDict({name: _Matrix(pa)})
        self.lora_B = nn.ModuleDict({name: _Matrix(pb)})
        drop = layer.lora_dropout[name]
        p = drop.p if isinstance(drop, nn.Dropout) else 0.0
        self.lora_dropout = nn.ModuleDict({name: LoraDropout(p, None if split == "B" else partition)
                                           if p > 0 else nn.Identity()})

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        """``s * B_r(A(dropout(x)))`` (column) or ``s * B(A_r(dropout(x_r)))`` (row, a partial sum); no collective.
        Shapes: ``x [*, in]`` or ``[*, in_r]`` -> ``[*, out_r]`` or ``[*, out]``."""
        n = self.adapter_name
        x = self.lora_dropout[n](x)
        a, b = self.lora_A[n].weight, self.lora_B[n].weight
        return F.linear(F.linear(x.to(a.dtype) if not torch.is_autocast_enabled() else x, a), b) * self.scaling


class LoraColumnParallelLinear(_Adapter, ColumnParallelLinear):
    """:class:`~tensorpar.layers.linear.ColumnParallelLinear` with a LoRA adapter (``A`` replicated ``[r, in]``,
    ``B`` ``[n_r, r]`` the base weight's rows). Shapes as the base class.

    Collectives: those of entering the tp region once (:func:`~tensorpar.comm.copy_to_tp_region`: backward
    all-reduce of the input gradient, base and adapter paths together; or the sequence all-gather /
    reduce-scatter), plus the sum of ``A``'s gradient over tp after backward (by the trainer's
    :func:`~tensorpar.grads.sync_sequence_parallel_grads`).
    """

    _split = "B"

    def forward_local(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_delta(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.forward_local(enter_tp_region(x, self.tp, self.sequence_parallel, self.seq_dim))
        if self.gather_output:
            y = comm.gather_from_tp_region(y, self.tp, self.partition)
        return y

    def extra_repr(self) -> str:
        return super().extra_repr() + f", lora r={self.r}, scaling={self.scaling:g} (A replicated, B by rows)"


class LoraRowParallelLinear(_Adapter, RowParallelLinear):
    """:class:`~tensorpar.layers.linear.RowParallelLinear` with a LoRA adapter (``A`` ``[r, k_r]`` the base
    weight's columns, ``B`` replicated ``[out, r]``). Shapes as the base class.

    Collectives: forward one all-reduce of ``x_r W_r^T + s B A_r x_r`` (reduce-scatter under sequence
    parallelism), backward as the base class; the sum of ``B``'s gradient over tp after backward.
    """

    _split = "A"

    def partial_product(self, x: torch.Tensor) -> torch.Tensor:
        """Base and adapter partial sums together ``[*, out]``: the base class's forward all-reduces them once."""
        return F.linear(x, self.weight) + self.lora_delta(x)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", lora r={self.r}, scaling={self.scaling:g} (A by columns, B replicated)"


def enter_tp_region(x: torch.Tensor, tp: Group, sequence_parallel: bool, seq_dim: int = 1) -> torch.Tensor:
    """Enter the tp region once: ``x`` replicated (forward identity, backward all-reduce) or, under sequence
    parallelism, ``[b, s_r, h] -> [b, s, h]`` (all-gather / reduce-scatter)."""
    if sequence_parallel:
        return comm.gather_from_sequence_region(x, tp, seq_dim)
    return comm.copy_to_tp_region(x, tp)


def has_lora(m: nn.Module) -> bool:
    return isinstance(m, _Adapter)


def peft_state_dict(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's saved names (``adapter_model.safetensors``) of full adapter tensors named as in the sharded model
    (``model.layers.0.self_attn.q_proj.lora_A.default.weight`` ->
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``): the adapter name dropped, PeftModel's
    prefix added, as ``peft.get_peft_model_state_dict`` writes them."""
    out = {}
    for k, t in named.items():
        parts = k.split(".")
        i = next(i for i, p in enumerate(parts) if p in ("lora_A", "lora_B"))
        out["base_model.model." + ".".join(parts[:i + 1] + parts[i + 2:])] = t
    return out
