"""Finding and checking checkpoints on disk, without reading any tensor: the complete checkpoints of a root
(:func:`list_checkpoints`, :func:`latest_checkpoint`), a checkpoint's ``trainer_state.json`` and its validation
(:func:`read_state`, :func:`check_state`), the folders holding its tensors (:func:`tensor_dirs`), the
safetensors headers (:func:`check_files`) and the hint for a damaged one (:func:`damaged_hint`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from tensorpar.train.checkpoint.format import (FORMAT, FORMAT_V1, FORMATS, LATEST, MODEL_DIR, MODEL_FILE, OPTIM_DIR,
                                               OPTIM_FILE, STATE_FILE, CheckpointError)


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in ``root``, oldest first (a folder is complete once renamed into place)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if p.is_dir() and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(root: str | os.PathLike, *, missing_ok: bool = False) -> Path | None:
    """The checkpoint ``<root>/latest`` names (falling back to the newest complete one).

    ``root`` may also be a checkpoint folder itself. Raises FileNotFoundError when there is none,
    unless ``missing_ok``.
    """
    root = Path(root)
    if (root / STATE_FILE).is_file():
        return root
    if root.name.startswith("step_") and root.is_dir():
        raise CheckpointError(f"{root} has no {STATE_FILE}: it is not a complete checkpoint (damaged, or not "
                              f"written by tensorpar); resume from another checkpoint of {root.parent}")
    name = None
    try:
        name = json.loads((root / LATEST).read_text())["checkpoint"]
        if (root / name / STATE_FILE).is_file():
            return root / name
    except (OSError, ValueError, KeyError, TypeError):
        pass
    found = list_checkpoints(root)
    if isinstance(name, str) and (root / name).is_dir():  # published, then damaged: never resume from an older one
        older = f"--resume {found[-1]}" if found else "a fresh run"
        raise CheckpointError(f"{root / name} (named by {root / LATEST}) has no {STATE_FILE}: the latest "
                              f"checkpoint is damaged; resuming silently from an older one would repeat steps, so "
                              f"choose: {older}, or repair it")
    if found:
        return found[-1]
    if missing_ok:
        return None
    raise FileNotFoundError(f"no checkpoint in {root} (expected step_* folders with {STATE_FILE})")


def damaged_hint(ckpt: str | os.PathLike) -> str:
    """What to do about a damaged checkpoint ``ckpt``: resume from the newest complete checkpoint older than it
    (named), or, when there is none, start afresh."""
    ckpt = Path(ckpt)
    older = [p for p in list_checkpoints(ckpt.parent) if p.name < ckpt.name]
    if older:
        return f"the checkpoint {ckpt} is damaged; resume from an older one: --resume {older[-1]}"
    return (f"the checkpoint {ckpt} is damaged and {ckpt.parent} holds no older one; start a fresh run (a new "
            f"--out)")


def check_files(ckpt: str | os.PathLike, state: dict) -> None:
    """The headers of the checkpoint's safetensors files are whole (:func:`tensorpar.hub.check_safetensors`; no
    tensor is read), so that a truncated or corrupt shard is reported before any rank starts.

    Raises:
        CheckpointError: naming the file and what is wrong with it, and an older checkpoint to resume from.
    """
    from tensorpar.hub import check_safetensors

    for folder in dict.fromkeys(tensor_dirs(Path(ckpt), state)):
        if folder.is_dir():
            try:
                check_safetensors(folder, hint=damaged_hint(ckpt))
            except ValueError as e:
                raise CheckpointError(str(e)) from None


def read_state(ckpt: str | os.PathLike) -> dict:
    """The ``trainer_state.json`` of a checkpoint. Raises CheckpointError if it is not one of ours."""
    path = Path(ckpt) / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read as a tensorpar checkpoint state: {e}") from e
    if not isinstance(state, dict) or state.get("format") not in FORMATS:
        fmt = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{path}: format {fmt!r}, expected {FORMAT!r} (or the older {FORMAT_V1!r})")
    check_state(Path(ckpt), state)
    return state


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def tensor_dirs(ckpt: Path, state: dict) -> tuple[Path, Path]:
    """The folders holding the model's and the optimizer's safetensors files, for either format."""
    if state.get("format") == FORMAT_V1:
        return ckpt, ckpt / "optimizer"
    return ckpt / MODEL_DIR, ckpt / OPTIM_DIR


def check_state(ckpt: Path, state: dict) -> None:
    """Reject a checkpoint state that does not describe its own folder (CheckpointError naming the field).

    ``step`` and ``optimizer_step`` must be integers >= 0 with ``optimizer_step <= step``; a folder named
    ``step_<N>`` must hold step ``N``; the tensor files must be there.
    """
    path = ckpt / STATE_FILE
    step = state.get("step")
    if not _is_count(step):
        raise CheckpointError(f"{path}: step={step!r} is not a non-negative integer; the checkpoint is damaged, "
                              f"resume from another one")
    opt = state.get("optimizer_step", 0)
    if not _is_count(opt) or opt > step:
        raise CheckpointError(f"{path}: optimizer_step={opt!r} must be an integer in [0, step={step}]; the "
                              f"checkpoint is damaged, resume from another one")
    name = ckpt.name
    if name.startswith("step_") and name[5:].isdigit() and int(name[5:]) != step:
        raise CheckpointError(f"{path}: step={step} but the folder is {name}; the checkpoint is damaged or was "
                              f"renamed, resume from another one")
    if state.get("format") == FORMAT_V1:
        need = [(ckpt / MODEL_FILE, MODEL_FILE)] + ([(ckpt / OPTIM_FILE, OPTIM_FILE)] if opt > 0 else [])
        for f, label in need:
            if not f.is_file():
                raise CheckpointError(f"{ckpt}: {label} is missing (step {step}); the checkpoint is incomplete, "
                                      f"resume from another one")
    else:
        model_dir, optim_dir = tensor_dirs(ckpt, state)
        for d, needed in ((model_dir, True), (optim_dir, opt > 0)):
            if needed and not any(d.glob("*.safetensors")):
                raise CheckpointError(f"{ckpt}: {d.name}/*.safetensors is missing (step {step}); the checkpoint is "
                                      f"incomplete, resume from another one")
    if not isinstance(state.get("data", {}), dict) or not isinstance(state.get("config", {}), dict):
        raise CheckpointError(f"{path}: 'data' and 'config' must be JSON objects; the checkpoint is damaged")
