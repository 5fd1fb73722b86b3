"""Sharded loading: build a Hugging Face model on the meta device, shard it by its plan, and let
each rank read only its own slices of the safetensors files.

The slice a rank reads for a parameter is given by the parameter's own ``tp_dim`` and
``tp_partition`` (set by the plan at module replacement), so the plan is the one source of
truth for both. ``safetensors.safe_open(...).get_slice`` maps the file and copies only the
requested rows/columns; the full tensor is never materialised.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn

from tensorpar.comm import Group
from tensorpar.hf.apply import parallelize
from tensorpar.hf.plan import ShardingPlan, make_plan

_META_ATTRS = ("tp_dim", "tp_partition", "sequence_parallel")


def weight_map(folder: str | Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of a Hugging Face-format folder.

    Raises:
        FileNotFoundError: the folder has no ``*.safetensors`` file.
        ValueError: a file's header cannot be read (truncated or corrupt), naming the file.
    """
    from safetensors import safe_open

    from tensorpar.hub import check_safetensors

    folder = Path(folder)
    check_safetensors(folder)  # headers only: truncated or corrupt files fail here, naming the file
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {folder}")
    out: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    out[k] = f
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"cannot read safetensors file {f}: {e}") from e
    return out


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def read_shard(handle, name: str, param: nn.Parameter, tp_rank: int) -> torch.Tensor:
    """Read the part of tensor ``name`` that ``param`` holds on ``tp_rank`` (only those bytes).

    Raises:
        ValueError: the stored tensor's shape differs from the model's full shape, naming the tensor.
    """
    sl = handle.get_slice(name)
    stored = tuple(sl.get_shape())
    dim = getattr(param, "tp_dim", None)
    full = list(param.shape)
    if dim is not None:
        full[dim] = param.tp_partition.n
    if stored != tuple(full):
        raise ValueError(f"tensor {name!r} has shape {stored} in the checkpoint but the model expects {tuple(full)}")
    if dim is None:
        return sl[:]
    parts = []
    for a, b in _runs(param.tp_partition.indices(tp_rank)):
        parts.append(sl[a:b] if dim == 0 else sl[:, a:b])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def load_sharded(model: nn.Module, folder: str | Path, tp: Group, *, device=None, dtype=torch.float32) -> nn.Module:
    """Fill every parameter of a sharded ``model`` (meta or real) with its slice from ``folder``.

    Tied parameters are loaded once. Raises ValueError for a missing tensor or a shape mismatch
    (naming the tensor) and for unreadable files (naming the file).
    """
    from safetensors import safe_open

    device = torch.device(device or "cpu")
    wmap = weight_map(folder)
    handles: dict[Path, object] = {}
    new: dict[int, nn.Parameter] = {}
    try:
        for name, p in model.named_parameters():
            key = name if name in wmap else None
            if key is None:
                raise ValueError(f"tensor {name!r} is missing from the checkpoint in {folder}")
            f = wmap[key]
            if f not in handles:
                handles[f] = safe_open(str(f), framework="pt").__enter__()
            t = read_shard(handles[f], key, p, tp.rank).to(device=device, dtype=dtype)
            q = nn.Parameter(t, requires_grad=p.requires_grad)
            for a in _META_ATTRS:
                if hasattr(p, a):
                    setattr(q, a, getattr(p, a))
            new[id(p)] = q
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    for m in model.modules():
        for pn, p in list(m._parameters.items()):
            if p is not None and id(p) in new:
                m._parameters[pn] = new[id(p)]
    for m in model.modules():  # real buffers were kept off meta; move them to the device
        for bn, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[bn] = b.to(device)
    return model


def build_parallel_model(folder: str | Path, tp: Group, *, sequence_parallel: bool = False, dtype=torch.float32,
                         device=None, attn_implementation: str = "sdpa",
                         dropout_seed: int | None = None, user_plan=None) -> tuple[nn.Module, ShardingPlan]:
    """Meta-initialise the model of ``folder``, shard it by its plan, load this rank's slices.

    ``user_plan``: a plan file path or dict merged into the built-in table (:mod:`tensorpar.hf.user_plan`).
    Returns ``(model, plan)``; the model is in eval mode. Raises the ValueErrors of
    :func:`~tensorpar.hf.plan.make_plan` (at plan time, before any weight is read) and of
    :func:`load_sharded`.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    plan = make_plan(config, tp.size, sequence_parallel=sequence_parallel, user_plan=user_plan)
    config._attn_implementation = attn_implementation
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    parallelize(model, plan, tp, dropout_seed=dropout_seed)
    load_sharded(model, folder, tp, device=device, dtype=dtype)
    return model.eval(), plan
