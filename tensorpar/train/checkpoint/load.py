"""Reading checkpoints: DCP's metadata rebuilt from the safetensors headers and checked for whole tensors
(:func:`stored_shapes`), this rank's pieces filled in place with ``dcp.load`` and no collective
(:func:`read_pieces`), whole tensors for export (:func:`read_full`), and :func:`load_checkpoint`, which resumes
a model and its AdamW state from a checkpoint saved at any layout.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from tensorpar.comm import Group
from tensorpar.train.checkpoint.find import damaged_hint, read_state, tensor_dirs
from tensorpar.train.checkpoint.format import OPTIM_KEYS, STATE_FILE, Piece, _shape, full_shape, pieces
from tensorpar.train.checkpoint.planners import _first_error, _planners


def _metadata(folder: str | os.PathLike, expect: dict | None = None):
    """DCP's metadata of a folder of safetensors pieces, rebuilt from their headers (JSON; nothing unpickled),
    after checking that the pieces of every key fill its full shape (``expect[key]`` where given: a missing
    last piece would otherwise shrink the inferred shape).

    Raises:
        ValueError: a truncated or corrupt file (naming it); a key whose pieces do not fill it (a shard file
            missing), naming the key and the element counts.
    """
    import math

    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from tensorpar.hub import check_safetensors

    folder = Path(folder)
    ckpt = folder if (folder / STATE_FILE).is_file() else folder.parent
    check_safetensors(folder, hint=damaged_hint(ckpt))  # a truncated or corrupt file fails here, naming it
    md = HuggingFaceStorageReader(str(folder)).read_metadata()
    for key, v in md.state_dict_metadata.items():
        size = tuple((expect or {}).get(key) or v.size)
        held = sum(math.prod(c.sizes) for c in v.chunks)
        if held != math.prod(size):
            raise ValueError(f"{folder}: tensor {key!r} is incomplete: its stored pieces hold {held} of the "
                             f"{math.prod(size)} elements of its shape {_shape(size)}; a shard file is missing or "
                             f"damaged, resume from another checkpoint")
    return md


def stored_shapes(folder: str | os.PathLike, expect: dict | None = None) -> dict[str, tuple[int, ...]]:
    """Key -> full shape of every tensor in a folder of safetensors pieces (headers only). Raises the
    ValueErrors of :func:`_metadata` (corrupt file, pieces that do not fill a tensor)."""
    md = _metadata(folder, expect)
    return {k: tuple(v.size) for k, v in md.state_dict_metadata.items()}


def read_pieces(folder: str | os.PathLike, ps: list[Piece]) -> None:
    """Fill ``ps`` (views of local tensors) from the safetensors pieces in ``folder`` with ``dcp.load``
    (``no_dist``: no collective; reads only the stored boxes that overlap). Raises ValueError if a read fails."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    if not ps:
        return
    _, LoadPieces = _planners()
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist is intended
            dcp.load({}, storage_reader=HuggingFaceStorageReader(str(folder)), planner=LoadPieces(ps), no_dist=True)
    except CheckpointException as e:  # a BaseException: one line instead
        raise ValueError(f"reading {folder} failed ({_first_error(e)}); the checkpoint is damaged, resume from "
                         f"another one") from None


def read_full(folder: str | os.PathLike, keys: list[str] | None = None,
              expect: dict | None = None) -> dict[str, torch.Tensor]:
    """Whole tensors (CPU, stored dtype) of ``keys`` (default all) from a folder of pieces, assembled by DCP on
    this process (for export: a one-off that holds the full model). ``expect``: key -> full shape (the
    checkpoint's ``tensors``). Raises the ValueErrors of :func:`_metadata`."""
    md = _metadata(folder, expect)
    out = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
           if keys is None or k in keys}
    read_pieces(folder, [Piece(k, t, (0,) * t.dim(), tuple(t.shape)) for k, t in out.items()])
    return out


def load_checkpoint(ckpt: str | os.PathLike, *, named_params: list[tuple[str, nn.Parameter]],
                    optimizer: torch.optim.Optimizer | None, tp: Group, part: bool = False,
                    ep: Group | None = None) -> dict:
    """Fill this rank's parameter rows (and AdamW state) from a checkpoint saved at any layout; return its state.

    No collectives: each rank reads the stored pieces that overlap its rows (``dcp.load`` with ``no_dist``),
    duplicated KV rows included. Parameters are updated in place, so the optimizer keeps its references.
    ``part``: the parameters are one pipeline stage's, so the checkpoint's other tensors are expected.
    ``ep``: the expert-parallel group when experts are split over it (each rank reads its own experts).

    Raises:
        ValueError: a tensor is missing or extra, or its stored shape differs from the model's full shape
            (one line naming the tensor and both shapes), e.g. a checkpoint of another model size; a
            truncated or corrupt file (naming it).
        CheckpointError: the folder is not a tensorpar checkpoint.
    """
    ckpt = Path(ckpt)
    state = read_state(ckpt)
    model_dir, optim_dir = tensor_dirs(ckpt, state)
    shapes = state.get("tensors") if isinstance(state.get("tensors"), dict) else {}
    stored = stored_shapes(model_dir, shapes)
    names = [n for n, _ in named_params]
    if len(set(names)) != len(names):
        raise ValueError(f"named_params lists {sorted({n for n in names if names.count(n) > 1})[:3]} more than once; "
                         f"pass each (tied) parameter once")
    missing = [n for n in names if n not in stored]
    extra = [] if part else sorted(set(stored) - set(names))
    if missing or extra:
        raise ValueError(f"checkpoint {ckpt} does not match the model: tensors missing from it {missing[:5]}, "
                         f"tensors the model lacks {extra[:5]}; resume with the model the checkpoint was "
                         f"trained with")
    for name, p in named_params:
        if tuple(stored[name]) != full_shape(p):
            raise ValueError(f"checkpoint {ckpt}: tensor {name!r} has shape {_shape(stored[name])} in the "
                             f"checkpoint but the model expects {_shape(full_shape(p))}; resume with the model "
                             f"the checkpoint was trained with")
    ep_rank = ep.rank if ep is not None else 0
    read_pieces(model_dir, [pc for name, p in named_params
                            for pc in pieces(name, p.data, p, tp.rank, owned=False, ep_rank=ep_rank)])
    if optimizer is not None and state.get("optimizer_step", 0) > 0:
        have = stored_shapes(optim_dir, {f"{k}/{n}": s for n, s in shapes.items() for k in OPTIM_KEYS})
        ps = []
        for name, p in named_params:
            if f"{OPTIM_KEYS[0]}/{name}" not in have:  # never updated (no gradient yet): no state
                continue
            st = {"step": torch.tensor(float(state["optimizer_step"]))}
            for key in OPTIM_KEYS:
                st[key] = torch.zeros_like(p.data)
                ps += pieces(f"{key}/{name}", st[key], p, tp.rank, owned=False, ep_rank=ep_rank)
            optimizer.state[p] = st
        read_pieces(optim_dir, ps)
    return state
