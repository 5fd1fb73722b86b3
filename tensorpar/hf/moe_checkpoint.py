"""Read a rank's slice of stacked MoE expert weights from a checkpoint that stores one tensor per expert.

transformers 5 keeps the experts of Mixtral, Qwen2-MoE and Qwen3-MoE stacked (``mlp.experts.gate_up_proj
[E, 2f, h]``, ``mlp.experts.down_proj [E, h, f]``) but writes and reads checkpoints in the per-expert layout
(its ``conversion_mapping``: Mixtral ``block_sparse_moe.experts.{e}.w1/w3/w2.weight`` and
``block_sparse_moe.gate.weight``; Qwen-MoE ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``).
:func:`read_moe_shard` maps a stacked parameter of a sharded model to those keys and reads only the rows
and columns this rank holds (the parameter's ``tp_dim`` / ``tp_partition``): its gate and up rows of every
expert under expert tensor parallelism (:class:`~tensorpar.hf.modules.TPExperts`), its whole experts under
expert parallelism (:class:`~tensorpar.hf.modules.EPExperts`).
"""
from __future__ import annotations

import re
from typing import Callable

import torch



def layout(model_type: str | None) -> tuple[str, tuple[str, str, str]] | None:
    """``(name of the MoE block in the checkpoint, (gate, up, down) per-expert names)`` from the family's record
    (:attr:`tensorpar.hf.families.record.Family.moe_checkpoint`), or None for a dense or unknown family."""
    from tensorpar.hf.families import RECORDS

    r = RECORDS.get(model_type)
    return r.moe_checkpoint if r is not None else _transformers_layout(model_type)


def _transformers_layout(model_type: str | None) -> tuple[str, tuple[str, str, str]] | None:
    """The per-expert layout of a family without a record (a ``--discover-plan`` family such as GLM-4-MoE), read
    from transformers' own checkpoint conversion for it: ``mlp.experts.*.{gate}.weight`` and
    ``mlp.experts.*.{up}.weight`` merged into ``mlp.experts.gate_up_proj``, ``mlp.experts.*.{down}.weight``
    into ``mlp.experts.down_proj``; None when it has no such conversion (or this transformers has no table)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return None
    names: dict[str, list[str]] = {}
    for t in get_checkpoint_conversion_mapping(model_type) or []:
        targets = list(getattr(t, "target_patterns", None) or [])
        if targets in (["mlp.experts.gate_up_proj"], ["mlp.experts.down_proj"]):
            src = [re.fullmatch(r"mlp\.experts\.\*\.(\w+)\.weight", x) for x in t.source_patterns]
            if all(src):
                names[targets[0]] = [x[1] for x in src]
    gu, dn = names.get("mlp.experts.gate_up_proj", []), names.get("mlp.experts.down_proj", [])
    return ("mlp", (gu[0], gu[1], dn[0])) if len(gu) == 2 and len(dn) == 1 else None


_STACKED = re.compile(r"^(?P<pre>.*)\.mlp\.experts\.(?P<w>gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"^(?P<pre>.*)\.mlp\.gate\.weight$")


def _rows(sl, idx: list[int], dim: int) -> torch.Tensor:
    from tensorpar.hf.load import _runs

    parts = [sl[a:b] if dim == 0 else sl[:, a:b] for a, b in _runs(idx)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def read_moe_shard(model_type: str | None, name: str, param: torch.nn.Parameter, tp_rank: int,
                   keys, get_slice: Callable[[str], object]) -> torch.Tensor | None:
    """This rank's part of parameter ``name`` assembled from per-expert checkpoint tensors, or None when ``name``
    is not an MoE parameter of a family with a per-expert checkpoint layout (:func:`layout`) (the caller then reports the tensor as missing).

    ``keys``: the checkpoint's tensor names; ``get_slice(key)``: a safetensors slice of that tensor (only the
    bytes indexed are read). Shapes returned: ``param``'s local shape.

    Raises:
        ValueError: a per-expert tensor is missing or has another shape than the model expects (naming it), or
            the parameter is split over tp and ep at once (its experts depend on the ep rank, not passed here).
    """
    lay = layout(model_type)
    if lay is None:
        return None
    block, (g, u, dn) = lay
    m = _ROUTER.match(name)
    if m:
        key = f"{m['pre']}.{block}.gate.weight"
        return get_slice(key)[:] if key in keys else None
    m = _STACKED.match(name)
    if not m:
        return None
    dim, part = getattr(param, "tp_dim", None), getattr(param, "tp_partition", None)
    ep_part = getattr(param, "ep_partition", None)
    if ep_part is not None and ep_part is not part:
        # tp x ep: the rank's experts are given by its ep rank, which this reader is not told
        raise ValueError(f"{name!r} is split over tp and over ep ({ep_part.tp_size} ranks): loading a tp x ep model "
                         f"from a checkpoint is not supported; load it at tp (build_parallel_model) and then call "
                         f"expert_parallelize, which takes each rank's experts from the loaded ones")
    stacked_shape = list(param.shape)
    if dim is not None:
        stacked_shape[dim] = part.n
    e_all, a, b = stacked_shape
    experts = part.indices(tp_rank) if dim == 0 else list(range(e_all))

    def expert(e: int, w: str, want: tuple[int, int]):
        key = f"{m['pre']}.{block}.experts.{e}.{w}.weight"
        if key not in keys:
            raise ValueError(f"tensor {key!r} (expert {e} of {name!r}) is missing from the checkpoint")
        sl = get_slice(key)
        if tuple(sl.get_shape()) != want:
            raise ValueError(f"tensor {key!r} has shape {tuple(sl.get_shape())} in the checkpoint but the model "
                             f"expects {want}")
        return sl

    out = []
    if m["w"] == "gate_up_proj":                                    # [E, 2f, h] from gate [f, h] and up [f, h]
        f, h = a // 2, b
        rows = part.indices(tp_rank) if dim == 1 else list(range(2 * f))
        gate_rows = [r for r in rows if r < f]
        up_rows = [r - f for r in rows if r >= f]
        for e in experts:
            pieces = [_rows(expert(e, g, (f, h)), gate_rows, 0)] if gate_rows else []
            pieces += [_rows(expert(e, u, (f, h)), up_rows, 0)] if up_rows else []
            out.append(torch.cat(pieces, 0))
    else:                                                           # [E, h, f] from down [h, f]
        h, f = a, b
        cols = part.indices(tp_rank) if dim == 2 else list(range(f))
        for e in experts:
            out.append(_rows(expert(e, dn, (h, f)), cols, 1))
    return torch.stack(out, 0)
