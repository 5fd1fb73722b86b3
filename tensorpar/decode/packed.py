"""oneDNN-prepacked weights as the only copy of a rank's matmul weights (issue 28, item 4: no second copy).

:class:`~tensorpar.decode.lean.LeanDecoder` runs its CPU matmuls on weights reordered once into oneDNN's blocked
layout (:func:`tensorpar.decode.kernels.pack`; bf16: 1.8x faster GEMV than ``F.linear``, which reorders on every
call). Kept beside the plain weights, the packed copies doubled a rank's resident memory (SmolLM2 fp32 and the 1.1B
Llama: 2.0x the shard after 32 decode steps). :func:`pack_weights` makes the packed layout *replace* the plain one:

* each packed Linear (the fused q/k/v and gate/up projections, ``o_proj``, ``down_proj``, an untied LM head) loses
  its ``weight`` parameter, whose storage is freed, and becomes :class:`PackedColumnParallelLinear` /
  :class:`PackedRowParallelLinear`: ``weight`` is a property that converts the packed tensor back to the plain
  ``[out, in]`` tensor on access (``to_dense``, exact: the same bits), so the module path (``path="hf"``, one
  matrix at a time), ``state_dict`` (the same keys and values) and :mod:`tensorpar.verify` read the same values;
* a tied LM head is not packed: the embedding looks rows up in the same table, which a packed tensor cannot give;
* :func:`unpack_weights` restores the plain parameters (the same ``Parameter`` objects, fused q/k/v and gate/up
  views again): a new decoder does it first, verify does it before its module-path forward and backward.

While packed, a converted ``weight`` is a fresh inference tensor: writing to it in place, or recording it for a
backward (training), raises instead of silently changing nothing; call :func:`unpack_weights` first. ``.to(dtype)``
does not reach the packed tensors either (unpack first). No collectives here.
"""
from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import torch
import torch.nn as nn

from tensorpar.decode.bf16_weights import Bf16Weight
from tensorpar.decode.gemv_kernel import BlockedWeight
from tensorpar.decode.kernels import pack
from tensorpar.layers.fused import FUSED_KEY
from tensorpar.layers.embedding import VocabParallelEmbedding
from tensorpar.layers.linear import ColumnParallelLinear, RowParallelLinear

#: a packed module's ``__dict__`` entry holding its :class:`PackedWeight`
PACKED_KEY = "_packed_weight"
#: the model's ``__dict__`` entry listing its packed modules (and fused owners) in packing order
_MODEL_KEY = "_tensorpar_packed"


class PackedWeight(NamedTuple):
    """``packed``: the oneDNN tensor ``[out_total, in]`` (several projections' rows when fused); ``param``: the
    module's original ``weight`` Parameter, its storage released (``[0]``), kept to be restored by
    :func:`unpack_weights`; ``start``/``stop``: this module's rows of ``packed`` (``None``: all of them)."""
    packed: torch.Tensor
    param: nn.Parameter | None
    start: int | None = None
    stop: int | None = None

    def dense(self) -> torch.Tensor:
        """The plain ``[out, in]`` weight (its rows of ``packed``), a new inference tensor, bit for bit the weight
        that was packed."""
        with torch.inference_mode():
            w = _dense(self.packed)
            return w if self.start is None else w[self.start:self.stop].clone()


def _dense(packed) -> torch.Tensor:
    """The plain ``[out, in]`` weight of a packed one: oneDNN's tensor (``to_dense``) or our GEMV's
    :class:`~tensorpar.decode.gemv_kernel.BlockedWeight`, or a bf16 model's blocked
    :class:`~tensorpar.decode.bf16_weights.Bf16Weight`; exact either way."""
    return packed.dense() if isinstance(packed, (BlockedWeight, Bf16Weight)) else packed.to_dense()


class _Packed:
    """Mixin of a Linear whose ``weight`` parameter was replaced by its packed tensor (:func:`pack_weights`)."""

    @property
    def weight(self) -> torch.Tensor:
        return self.__dict__[PACKED_KEY].dense()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight         # the plain values, under the parameter's key
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if prefix + "weight" in state_dict:     # (strict=False would otherwise drop it without a word)
            raise RuntimeError(f"{prefix}weight is packed for decoding: call tensorpar.decode.packed."
                               f"unpack_weights(model) before load_state_dict")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply(self, fn, *args, **kwargs):
        # .to() / .float() / .cuda() cannot reach the packed tensor (not a parameter): refuse rather than leave it
        # in the old dtype or device beside converted norms
        raise RuntimeError(f"this {type(self).__name__}'s weight is packed for decoding: call "
                           f"tensorpar.decode.packed.unpack_weights(model) before .to() / .float() / .cuda()")


class PackedColumnParallelLinear(_Packed, ColumnParallelLinear):
    """A :class:`~tensorpar.layers.linear.ColumnParallelLinear` whose weight ``[n_r, in]`` is held packed (shapes
    and collectives unchanged; ``weight`` converts on access, see :class:`_Packed`). Inference only."""


class PackedRowParallelLinear(_Packed, RowParallelLinear):
    """A :class:`~tensorpar.layers.linear.RowParallelLinear` whose weight ``[out, k_r]`` is held packed (shapes and
    collectives unchanged; ``weight`` converts on access, see :class:`_Packed`). Inference only."""


class PackedVocabParallelEmbedding(_Packed, VocabParallelEmbedding):
    """A :class:`~tensorpar.layers.embedding.VocabParallelEmbedding` whose table ``[v_r, h]`` is held as our GEMV's
    :class:`~tensorpar.decode.gemv_kernel.BlockedWeight` because a tied LM head reads it
    (:func:`tensorpar.decode.matmuls.use_blocked`): the forward looks its rows up in that layout (the same values;
    shapes and collectives unchanged). Inference only."""

    def _lookup(self, local: torch.Tensor, pad: int | None) -> torch.Tensor:
        table = self.__dict__[PACKED_KEY].packed
        if local.numel() and (int(local.min()) < 0 or int(local.max()) >= table.shape[0]):
            raise IndexError(f"token id out of range: the embedding has {table.shape[0]} rows on this rank")
        return table.rows(local)


def table_of(emb: nn.Module):
    """An input embedding's table as held: its ``weight`` tensor, or the
    :class:`~tensorpar.decode.gemv_kernel.BlockedWeight` in its place (:class:`PackedVocabParallelEmbedding`, whose
    ``weight`` would convert the whole table)."""
    pw = emb.__dict__.get(PACKED_KEY)
    return emb.weight if pw is None else pw.packed


_CLASSES = ((ColumnParallelLinear, PackedColumnParallelLinear), (RowParallelLinear, PackedRowParallelLinear),
            (VocabParallelEmbedding, PackedVocabParallelEmbedding))


def _swap(mod: nn.Module, pw: PackedWeight) -> None:
    cls = next((p for plain, p in _CLASSES if type(mod) is plain), None)
    if cls is None:
        raise ValueError(f"cannot pack the weight of a {type(mod).__name__} (packs "
                         f"{', '.join(plain.__name__ for plain, _ in _CLASSES)})")
    del mod._parameters["weight"]
    mod.__class__ = cls
    mod.__dict__[PACKED_KEY] = pw
    pw.param.data = pw.param.data.new_empty(0)          # the plain storage is freed once nothing else holds it


def _pack_linear(mod: nn.Module, rows: int, packer, done: dict):
    """Pack ``mod``'s weight, or take the packed form ``done`` holds for it (a tied weight's second module)."""
    p = mod._parameters["weight"]
    packed = done[id(p)] if id(p) in done else packer(p, rows)
    _swap(mod, PackedWeight(packed, p))
    return packed


def _pack_fused(owner: nn.Module, names: tuple[str, ...], rows: int, packer) -> torch.Tensor:
    """Pack ``owner``'s fused weight (:mod:`tensorpar.layers.fused`) and free it and its projections' views."""
    fw, fb = owner.__dict__[FUSED_KEY]
    packed = packer(fw, rows)
    off = 0
    for n in names:
        mod = getattr(owner, n)
        rows = mod._parameters["weight"].shape[0]
        _swap(mod, PackedWeight(packed, mod._parameters["weight"], off, off + rows))
        off += rows
    owner.__dict__[FUSED_KEY] = (PackedWeight(packed, None), fb)
    return packed


def packed_model(model) -> bool:
    """Whether :func:`pack_weights` packed ``model`` (and :func:`unpack_weights` has not restored it)."""
    return bool(model.__dict__.get(_MODEL_KEY))


def _fused_names(mod: nn.Module) -> tuple[str, ...]:
    """The projections :func:`tensorpar.decode.prepare.fuse_projections` fused on ``mod``: q/k/v or gate/up."""
    return ("q_proj", "k_proj", "v_proj") if hasattr(mod, "q_proj") else ("gate_proj", "up_proj")


def pack_plan(model, ids: set[int]) -> list[tuple[nn.Module, tuple[str, ...] | None]]:
    """What :func:`pack_weights` will pack for the weights whose ``id`` is in ``ids``: ``(owner, names)`` for a
    fused weight (:data:`~tensorpar.layers.fused.FUSED_KEY` of ``owner``, the projections ``names``), ``(linear,
    None)`` for a Linear's ``weight`` parameter. Changes nothing. Raises ValueError naming a weight that is neither,
    or a Linear that is not a plain column/row-parallel one (its class could not become a packed one)."""
    plan, found = [], set()
    for name, mod in model.named_modules():
        f = mod.__dict__.get(FUSED_KEY)
        if f is not None and isinstance(f[0], torch.Tensor) and id(f[0]) in ids:
            plan.append((mod, _fused_names(mod)))
            found.add(id(f[0]))
            continue
        p = mod._parameters.get("weight")
        if p is not None and id(p) in ids:             # a tied weight: each module holding it
            if not any(type(mod) is plain for plain, _ in _CLASSES):
                raise ValueError(f"cannot pack {name} ({type(mod).__name__})")
            plan.append((mod, None))
            found.add(id(p))
    if found != ids:
        raise ValueError(f"{len(ids - found)} weight(s) to pack are not held by a Linear or a fused projection")
    return plan


def pack_weights(model, plan, rows: int = 1, packer=None) -> dict[int, torch.Tensor]:
    """Replace the plain matmul weights of :func:`pack_plan`'s ``plan`` with oneDNN-packed ones (``packer``
    ``None``; else ``packer(weight, rows)`` makes the packed tensor: :func:`tensorpar.decode.matmuls.use_blocked`
    passes our GEMV's blocked layout), freeing the plain
    storage one matrix at a time (peak: the shard plus its largest matrix, when the caller holds no other
    reference to them). ``rows``: the input rows a step runs at most (:func:`~tensorpar.decode.kernels.pack`'s
    hint). Returns ``{id(plain weight): packed}`` (ids of the fused tensors and of the Linear weight
    parameters). No collectives."""
    from tensorpar.decode.quantize import _release_freed_memory
    out: dict[int, torch.Tensor] = {}
    done = model.__dict__.setdefault(_MODEL_KEY, [])
    dev = None
    packer = packer or pack
    for mod, names in plan:
        if names is None:
            key, dev = id(mod._parameters["weight"]), mod._parameters["weight"].device
            out[key] = _pack_linear(mod, rows, packer, out)
        else:
            key = id(mod.__dict__[FUSED_KEY][0])
            out[key] = _pack_fused(mod, names, rows, packer)
        done.append((mod, names))
    if dev is not None:
        _release_freed_memory(dev)
    return out


def _unswap(mod: nn.Module, w: torch.Tensor) -> None:
    pw = mod.__dict__.pop(PACKED_KEY)
    mod.__class__ = next(plain for plain, p in _CLASSES if type(mod) is p)
    pw.param.data = w
    rest = dict(mod._parameters)                # "weight" first again: named_parameters / state_dict order
    mod._parameters.clear()
    mod._parameters["weight"] = pw.param
    mod._parameters.update(rest)


def unpack_weights(model) -> None:
    """Undo :func:`pack_weights`: every packed weight back to a plain parameter (the original ``Parameter``
    objects, with their attributes; the fused q/k/v and gate/up weights as one tensor with the parameters as its
    row views again), the packed tensors dropped one at a time. A no-op for a model that is not packed. No
    collectives."""
    done = model.__dict__.pop(_MODEL_KEY, None)
    # a tied weight's modules get one plain tensor, kept (with the packed one: its id) until the last of them
    uses = Counter(id(mod.__dict__[PACKED_KEY].packed) for mod, names in done or () if names is None)
    dense: dict[int, tuple] = {}
    for mod, names in done or ():
        if names is None:
            t = mod.__dict__[PACKED_KEY].packed
            key = id(t)
            if key not in dense:
                dense[key] = (t, _dense(t))
            _unswap(mod, dense[key][1])
            uses[key] -= 1
            if not uses[key]:
                del dense[key], t
            continue
        pw, fb = mod.__dict__[FUSED_KEY]
        fused = _dense(pw.packed)
        for n in names:
            sub = getattr(mod, n)
            p = sub.__dict__[PACKED_KEY]
            _unswap(sub, fused[p.start:p.stop])
        mod.__dict__[FUSED_KEY] = (fused, fb)


def packed_weight_bytes(model) -> int:
    """Bytes of ``model``'s packed weights (not parameters while packed: a reader summing parameters adds these;
    ``numel * element_size``, oneDNN's padding of a block not counted)."""
    seen: dict[int, int] = {}
    for mod in model.modules():
        pw = mod.__dict__.get(PACKED_KEY)
        if pw is not None:
            t = pw.packed
            seen[id(t)] = (t.stored_bytes() if isinstance(t, (BlockedWeight, Bf16Weight))
                           else t.numel() * t.element_size())
    return sum(seen.values())
