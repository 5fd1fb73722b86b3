"""Saving checkpoints: the pieces a rank writes (:func:`state_pieces`), the parallel write of every rank's
pieces into a temporary folder, the agreement that all succeeded, and rank 0's atomic publish and pruning
(:func:`save_pieces`, :func:`save_checkpoint`; a failed or killed save leaves the previous checkpoint intact).
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from tensorpar.comm import Group
from tensorpar.train.checkpoint.find import latest_checkpoint, list_checkpoints
from tensorpar.train.checkpoint.format import (FORMAT, FORMATS, LATEST, OPTIM_KEYS, STATE_FILE, TMP_PREFIX,
                                               CheckpointError, Piece, pieces)
from tensorpar.train.checkpoint.planners import _dcp_writer, _first_error, _planners


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _is_ours(folder: Path) -> bool:
    """A folder that a tensorpar save wrote: its trainer_state.json names one of our formats."""
    try:
        return json.loads((folder / STATE_FILE).read_text()).get("format") in FORMATS
    except (OSError, ValueError, AttributeError):
        return False


def _publish(root: Path, tmp: Path, final: Path, keep: int) -> None:
    """Rename ``tmp`` to ``final``, point ``latest`` at it, then prune: the old state stays valid until the end."""
    old = None
    if final.exists():  # re-saving the same step: move the old one aside, never delete it first
        old = root / f".old-{final.name}-{os.getpid()}"
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync(root)
    _write_json(root / LATEST, {"checkpoint": final.name})
    _fsync(root)
    if old is not None and _is_ours(old):
        shutil.rmtree(old, ignore_errors=True)
    others = [c for c in list_checkpoints(root) if c.name != final.name]  # the new one is never pruned
    for stale in others[:max(len(others) - (keep - 1), 0)]:
        if _is_ours(stale):
            shutil.rmtree(stale, ignore_errors=True)


def _agree(ok: bool, pg, device: torch.device | None) -> bool:
    """True on every rank of ``pg`` iff ``ok`` on all of them (one all-reduce of one element); ``pg`` None and
    no default group: this process alone."""
    if pg is None and not dist.is_initialized():
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=pg)
    return bool(flag.item())


def _fsync_tree(folder: Path) -> None:
    for p in sorted(folder.rglob("*"), reverse=True):
        _fsync(p)
    _fsync(folder)


def optimizer_step(named_params: list[tuple[str, nn.Parameter]], optimizer: torch.optim.Optimizer) -> int:
    """The common AdamW step count of ``named_params`` (0 before the first step).

    Raises:
        CheckpointError: the parameters' optimizer states are at different steps.
    """
    steps = {float(optimizer.state[p]["step"]) for _, p in named_params if "step" in optimizer.state.get(p, {})}
    if len(steps) > 1:
        raise CheckpointError(f"optimizer parameters are at different steps {sorted(steps)}; cannot store one count")
    return int(steps.pop()) if steps else 0


def state_pieces(named_params: list[tuple[str, nn.Parameter]], optimizer: torch.optim.Optimizer | None,
                 tp_rank: int, *, local: Callable[[nn.Parameter, torch.Tensor], torch.Tensor] | None = None,
                 ep_rank: int = 0) -> list[Piece]:
    """The pieces this rank writes: each parameter's owned rows and its AdamW moments' (``exp_avg/<name>``).

    ``ep_rank``: this rank's place on the expert-parallel axis (experts split over ep sit at their experts' rows).

    ``local(param, tensor)`` returns the tp-local tensor to store for ``param`` (its data or a moment); the
    default is the tensor itself (a data-parallel wrapper that shards over dp plugs in its ``full_tensor``).
    """
    local = local or (lambda p, t: t)
    out: list[Piece] = []
    for name, p in named_params:
        out += pieces(name, local(p, p.detach()), p, tp_rank, owned=True, ep_rank=ep_rank)
        st = optimizer.state.get(p, {}) if optimizer is not None else {}
        for key in OPTIM_KEYS:
            if key in st:
                out += pieces(f"{key}/{name}", local(p, st[key]), p, tp_rank, owned=True, ep_rank=ep_rank)
    return out


def save_pieces(root: str | os.PathLike, ps: list[Piece], *, step: int, state: dict, optimizer_step: int,
                config_json: str | None, keep: int, pg=None, rank: int = 0,
                device: torch.device | None = None, before_publish: Callable[[Path], None] | None = None) -> Path:
    """Write ``<root>/step_<step>`` from the pieces of every rank of ``pg`` (every rank calls, with its own).

    ``pg``: the process group of all ranks (None: the default group, or a single process without
    torch.distributed); ``rank``: this rank in it (0 publishes); ``device``: where the agreement flag lives
    (the backend's device). ``state`` (rank 0's counts) goes into ``trainer_state.json`` with the format, step,
    optimizer step and every model tensor's full shape. ``before_publish(folder)`` (rank 0) adds files to the
    written folder before it is published (a LoRA run's PEFT files: :func:`tensorpar.train.lora.write_peft_files`);
    its failure fails the save like any write.

    Collectives: DCP's plan exchange (gather / scatter of plans, no tensor data) and its final all-reduce,
    plus three one-element all-reduces (folder ready, all pieces written, published). No rank gathers
    tensors. Returns the checkpoint folder on every rank.

    Raises:
        CheckpointError: on every rank, when any rank failed (disk full, permissions, a plan whose pieces
            overlap or leave holes, ...); the previous checkpoint and ``latest`` are untouched.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    root = Path(root)
    final = root / f"step_{step:06d}"
    tmp = root / f"{TMP_PREFIX}{step:06d}"
    single = pg is None and not dist.is_initialized()
    error = ""
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for leftover in root.glob(f"{TMP_PREFIX}*"):  # ours, from a killed save
                shutil.rmtree(leftover, ignore_errors=True)
            tmp.mkdir()
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
    if not _agree(not error, pg, device):
        raise CheckpointError(_failed(root, final, error or "preparing the folder failed on rank 0"))
    SavePieces, _ = _planners()
    planner = SavePieces(ps)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: intended
            dcp.save({}, storage_writer=_dcp_writer(tmp), planner=planner, process_group=pg, no_dist=single)
    except (Exception, CheckpointException) as e:  # DCP's (a BaseException): any rank's failure, raised on all
        error = _first_error(e)
    if not _agree(not error, pg, device):  # every rank finished writing, or the save is abandoned
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(_failed(root, final, error or "writing shards failed on another rank"))
    if rank == 0:
        try:
            shapes = {k: list(v.size) for k, v in planner.metadata.state_dict_metadata.items()
                      if k.split("/", 1)[0] not in OPTIM_KEYS}
            full_state = dict(state, format=FORMAT, step=step, optimizer_step=optimizer_step, tensors=shapes)
            if config_json is not None:
                (tmp / "config.json").write_text(config_json)
            with open(tmp / STATE_FILE, "w") as f:
                json.dump(full_state, f, indent=1, sort_keys=True)
            if before_publish is not None:
                before_publish(tmp)
            _fsync_tree(tmp)
            _publish(root, tmp, final, keep)
        except Exception as e:  # OSError, disk full, ... (the folder is not published: nothing else changed)
            error = f"{type(e).__name__}: {e}"
            shutil.rmtree(tmp, ignore_errors=True)
    if not _agree(not error, pg, device):
        raise CheckpointError(_failed(root, final, error or "publishing failed on rank 0"))
    return final


def _failed(root: Path, final: Path, why: str) -> str:
    try:
        prev = latest_checkpoint(root, missing_ok=True) if root.is_dir() else None
    except CheckpointError:
        prev = None
    return (f"saving checkpoint {final} failed ({why}); "
            f"{'the previous checkpoint ' + str(prev) + ' is intact' if prev else 'no previous checkpoint'}"
            f". Free disk space or choose another out_dir")


def save_checkpoint(root: str | os.PathLike, *, named_params: list[tuple[str, nn.Parameter]],
                    optimizer: torch.optim.Optimizer, tp: Group, step: int, state: dict,
                    config_json: str | None = None, keep: int = 2) -> Path:
    """Save parameters and AdamW state of a tp-only run as ``<root>/step_<step>``; called on every tp rank.

    Each tp rank writes the rows it owns (:func:`save_pieces`) in parallel; see the module docstring.

    Args:
        named_params: ``(name, parameter)`` with each tied parameter once.
        optimizer: the AdamW (or any optimizer with ``exp_avg``/``exp_avg_sq`` and a common ``step``).
        state: JSON-serialisable trainer state (data position, config, ...), stored in ``trainer_state.json``.
        config_json: the model's ``config.json`` text.
        keep: how many checkpoints to keep in ``root`` (the oldest beyond it are deleted after the save).

    Raises:
        CheckpointError: the write failed on some rank, on every rank; the previous checkpoint is intact.
    """
    ps = state_pieces(named_params, optimizer, tp.rank)
    device = next((p.device for _, p in named_params), None)
    return save_pieces(root, ps, step=step, state=dict(state, tp_size_at_save=tp.size),
                       optimizer_step=optimizer_step(named_params, optimizer), config_json=config_json, keep=keep,
                       pg=tp.pg, rank=tp.rank, device=device)
