"""Checkpoints independent of the tensor-parallel degree: full-shape safetensors, atomic, never pickled.

Layout of one checkpoint (a folder, named ``step_<NNNNNN>``, under a checkpoint root)::

    config.json                 the model's transformers config            } together a Hugging Face
    model.safetensors           every parameter at its full (tp = 1) shape } model folder
    optimizer/state.safetensors AdamW's exp_avg / exp_avg_sq per parameter, full shape
    trainer_state.json          step, AdamW step count, data position, the TrainConfig, tp at save time

and ``<root>/latest`` names the newest checkpoint.

Saving: each sharded tensor is all-gathered over tp along its ``tp_dim`` and assembled by its
``tp_partition``; for a :class:`~tensorpar.shard.UnitSelection` (KV heads duplicated on several ranks)
each unit's rows are taken from its owner. Tied parameters are stored once. Rank 0 writes everything
into ``<root>/.tmp-<name>-<pid>/``, fsyncs, renames the folder into place, then replaces ``latest``
(write + ``os.replace``); older checkpoints are deleted only after that. A process killed at any point,
or a disk that fills up, leaves the previous checkpoint and ``latest`` untouched; leftover ``.tmp-*``
folders are ignored by loading and removed by the next save.

Loading: each rank reads only its slices, through the same per-parameter layouts the sharded model
loader uses (:func:`tensorpar.hf.load.read_shard`), so a checkpoint saved at one tp loads at any other.
Only safetensors and JSON are read: nothing is unpickled.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.nn as nn

from tensorpar import comm
from tensorpar.comm import Group
from tensorpar.shard import Partition

FORMAT = "tensorpar-train-v1"
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer/state.safetensors"
STATE_FILE = "trainer_state.json"
LATEST = "latest"
OPTIM_KEYS = ("exp_avg", "exp_avg_sq")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (the previous one is intact) or is not a tensorpar checkpoint."""


# ---------------------------------------------------------------- shard <-> full shape

def full_tensor(t: torch.Tensor, param: nn.Parameter, tp: Group) -> torch.Tensor:
    """The full-shape tensor of which ``t`` is this rank's slice laid out like ``param``.

    Shapes: ``t`` has ``param``'s local shape; the result has ``tp_partition.n`` along ``tp_dim``
    (a replicated tensor is returned as is). Collectives: one all-gather over tp for a sharded tensor.
    """
    dim = getattr(param, "tp_dim", None)
    if dim is None or tp.size == 1:
        return t.detach()
    part = param.tp_partition
    gathered = comm.all_gather(t.detach().contiguous(), tp, dim=dim, sizes=part.sizes)
    if isinstance(part, Partition):  # contiguous ranges in rank order: the gather is the full tensor
        return gathered
    shape = list(t.shape)
    shape[dim] = part.n
    full = t.new_empty(shape)
    offset = 0
    for r in range(tp.size):
        idx, own = part.indices(r), part.owner_mask(r)
        rows = gathered.narrow(dim, offset, len(idx))
        offset += len(idx)
        keep = [i for i, o in enumerate(own) if o]
        if keep:
            sel = torch.tensor(keep, device=t.device)
            full.index_copy_(dim, torch.tensor(idx, device=t.device)[sel], rows.index_select(dim, sel))
    return full


# ---------------------------------------------------------------- saving

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


def _write_folder(tmp: Path, model_t: dict, optim_t: dict, state: dict, config_json: str | None) -> None:
    from safetensors.torch import save_file

    (tmp / "optimizer").mkdir(parents=True)
    save_file(model_t, str(tmp / MODEL_FILE), metadata={"format": FORMAT})
    save_file(optim_t, str(tmp / OPTIM_FILE), metadata={"format": FORMAT})
    if config_json is not None:
        (tmp / "config.json").write_text(config_json)
    with open(tmp / STATE_FILE, "w") as f:
        json.dump(state, f, indent=1, sort_keys=True)
    for p in (MODEL_FILE, OPTIM_FILE, "config.json", STATE_FILE, "optimizer", "."):
        if (tmp / p).exists():
            _fsync(tmp / p)


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
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    others = [c for c in list_checkpoints(root) if c.name != final.name]  # the new one is never pruned
    for stale in others[:max(len(others) - (keep - 1), 0)]:
        shutil.rmtree(stale, ignore_errors=True)


def save_checkpoint(root: str | os.PathLike, *, named_params: list[tuple[str, nn.Parameter]],
                    optimizer: torch.optim.Optimizer, tp: Group, step: int, state: dict,
                    config_json: str | None = None, keep: int = 2) -> Path:
    """Save full-shape parameters and AdamW state as ``<root>/step_<step>``; called on every tp rank.

    Args:
        named_params: ``(name, parameter)`` with each tied parameter once.
        optimizer: the AdamW (or any optimizer with ``exp_avg``/``exp_avg_sq`` and a common ``step``).
        state: JSON-serialisable trainer state (data position, config, ...), stored in ``trainer_state.json``.
        config_json: the model's ``config.json`` text (makes the checkpoint a Hugging Face model folder).
        keep: how many checkpoints to keep in ``root`` (the oldest beyond it are deleted after the save).

    Collectives: one all-gather per sharded tensor (parameters and both moments), one broadcast of the
    outcome. Returns the checkpoint folder on every rank.

    Raises:
        CheckpointError: the write failed on rank 0 (disk full, permissions, ...), on every rank; the
            partial folder is removed and the previous checkpoint and ``latest`` are untouched.
    """
    model_t, optim_t, opt_step = gather_full_state(named_params, optimizer, tp)
    error = ""
    if tp.rank == 0:
        error = write_checkpoint(root, model_t, optim_t, dict(state, tp_size_at_save=tp.size), step=step,
                                 optimizer_step=opt_step, config_json=config_json, keep=keep)
    flag = comm.broadcast(torch.tensor([0 if not error else 1]), tp, src=0)
    final = Path(root) / f"step_{step:06d}"
    if int(flag[0]):
        raise CheckpointError(error or f"saving checkpoint {final} failed on tp rank 0 (see its error)")
    return final


def gather_full_state(named_params: list[tuple[str, nn.Parameter]], optimizer: torch.optim.Optimizer,
                      tp: Group) -> tuple[dict, dict, int]:
    """Full-shape parameters and AdamW moments (``exp_avg/<name>``, ...) of ``named_params``, and the optimizer's
    step count. Collectives: one all-gather over tp per sharded tensor.

    Raises:
        CheckpointError: the parameters' optimizer states are at different steps.
    """
    model_t: dict[str, torch.Tensor] = {}
    optim_t: dict[str, torch.Tensor] = {}
    steps = set()
    for name, p in named_params:
        model_t[name] = full_tensor(p, p, tp).contiguous()
        st = optimizer.state.get(p, {})
        for key in OPTIM_KEYS:
            if key in st:
                optim_t[f"{key}/{name}"] = full_tensor(st[key], p, tp).contiguous()
        if "step" in st:
            steps.add(float(st["step"]))
    if len(steps) > 1:
        raise CheckpointError(f"optimizer parameters are at different steps {sorted(steps)}; cannot store one count")
    return model_t, optim_t, int(steps.pop()) if steps else 0


def write_checkpoint(root: str | os.PathLike, model_t: dict, optim_t: dict, state: dict, *, step: int,
                     optimizer_step: int, config_json: str | None, keep: int) -> str:
    """Write full-shape tensors as ``<root>/step_<step>`` atomically (one process calls it); return ``""`` on
    success, else the one-line error (the partial folder removed, the previous checkpoint intact)."""
    root = Path(root)
    final = root / f"step_{step:06d}"
    full_state = dict(state, format=FORMAT, step=step, optimizer_step=optimizer_step,
                      tensors={n: list(t.shape) for n, t in model_t.items()})
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        for leftover in root.glob(".tmp-*"):  # from a killed save
            shutil.rmtree(leftover, ignore_errors=True)
        _write_folder(tmp, model_t, optim_t, full_state, config_json)
        _publish(root, tmp, final, keep)
    except Exception as e:  # OSError, SafetensorError (disk full), ...
        shutil.rmtree(tmp, ignore_errors=True)
        prev = latest_checkpoint(root, missing_ok=True)
        return (f"saving checkpoint {final} failed ({type(e).__name__}: {e}); "
                f"{'the previous checkpoint ' + str(prev) + ' is intact' if prev else 'no previous checkpoint'}"
                f". Free disk space or choose another out_dir")
    return ""


# ---------------------------------------------------------------- finding and loading

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
    try:
        name = json.loads((root / LATEST).read_text())["checkpoint"]
        if (root / name / STATE_FILE).is_file():
            return root / name
    except (OSError, ValueError, KeyError, TypeError):
        pass
    found = list_checkpoints(root)
    if found:
        return found[-1]
    if missing_ok:
        return None
    raise FileNotFoundError(f"no checkpoint in {root} (expected step_* folders with {STATE_FILE})")


def read_state(ckpt: str | os.PathLike) -> dict:
    """The ``trainer_state.json`` of a checkpoint. Raises CheckpointError if it is not one of ours."""
    path = Path(ckpt) / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read as a tensorpar checkpoint state: {e}") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        fmt = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{path}: format {fmt!r}, expected {FORMAT!r}")
    check_state(Path(ckpt), state)
    return state


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def check_state(ckpt: Path, state: dict) -> None:
    """Reject a checkpoint state that does not describe its own folder (CheckpointError naming the field).

    ``step`` and ``optimizer_step`` must be integers >= 0 with ``optimizer_step <= step``; a folder named
    ``step_<N>`` must hold step ``N``; the tensor files must be there; ``tensors`` (name -> shape) must match
    the model file's header when both are present.
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
    for f in (MODEL_FILE,) + ((OPTIM_FILE,) if opt > 0 else ()):
        if not (ckpt / f).is_file():
            raise CheckpointError(f"{ckpt}: {f} is missing (step {step}); the checkpoint is incomplete, resume "
                                  f"from another one")
    if not isinstance(state.get("data", {}), dict) or not isinstance(state.get("config", {}), dict):
        raise CheckpointError(f"{path}: 'data' and 'config' must be JSON objects; the checkpoint is damaged")


def _read_into(handle, key: str, param: nn.Parameter, dest: torch.Tensor, tp: Group) -> None:
    from tensorpar.hf.load import read_shard

    dest.copy_(read_shard(handle, key, param, tp.rank))


def load_checkpoint(ckpt: str | os.PathLike, *, named_params: list[tuple[str, nn.Parameter]],
                    optimizer: torch.optim.Optimizer | None, tp: Group, part: bool = False) -> dict:
    """Fill this rank's parameter slices (and AdamW state) from a checkpoint saved at any tp; return its state.

    No collectives: each rank reads its own slices (``safe_open`` maps the file; only those bytes are
    copied). Parameters are updated in place, so the optimizer keeps its references. ``part``: the
    parameters are one pipeline stage's, so the checkpoint's other tensors are expected, not extra.

    Raises:
        ValueError: a tensor is missing or extra, or its stored shape differs from the model's full shape
            (the message names the tensor), e.g. resuming from a checkpoint of another model size; a
            truncated or corrupt file (naming it).
        CheckpointError: the folder is not a tensorpar checkpoint.
    """
    from safetensors import safe_open

    from tensorpar.hub import check_safetensors

    ckpt = Path(ckpt)
    state = read_state(ckpt)
    names = [n for n, _ in named_params]
    check_safetensors(ckpt)  # headers only: a truncated or corrupt file fails here, naming it
    with safe_open(str(ckpt / MODEL_FILE), framework="pt") as h:
        stored = set(h.keys())
        missing = [n for n in names if n not in stored]
        extra = [] if part else sorted(stored - set(names))
        if missing or extra:
            raise ValueError(f"checkpoint {ckpt} does not match the model: tensors missing from it {missing[:5]}, "
                             f"tensors the model lacks {extra[:5]}; resume with the model the checkpoint was "
                             f"trained with")
        with torch.no_grad():
            for name, p in named_params:
                _read_into(h, name, p, p.data, tp)
    if optimizer is not None and state.get("optimizer_step", 0) > 0:
        check_safetensors(ckpt / OPTIM_FILE.rsplit("/", 1)[0])
        with safe_open(str(ckpt / OPTIM_FILE), framework="pt") as h, torch.no_grad():
            stored = set(h.keys())
            for name, p in named_params:
                if f"{OPTIM_KEYS[0]}/{name}" not in stored:  # never updated (no gradient yet): no state
                    continue
                st = {"step": torch.tensor(float(state["optimizer_step"]))}
                for key in OPTIM_KEYS:
                    t = torch.empty_like(p.data)
                    _read_into(h, f"{key}/{name}", p, t, tp)
                    st[key] = t
                optimizer.state[p] = st
    return state
