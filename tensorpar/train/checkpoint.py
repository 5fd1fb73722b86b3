"""Checkpoints that every rank writes in parallel with ``torch.distributed.checkpoint`` (DCP), resumable at any
(tp, pp, dp), atomic, and never pickled.

Layout of one checkpoint (a folder, named ``step_<NNNNNN>``, under a checkpoint root)::

    model/shard-<RRRRR>-<KKKKK>.safetensors      parameters: pieces written by global rank R-1
    optimizer/shard-<RRRRR>-<KKKKK>.safetensors  AdamW's exp_avg / exp_avg_sq, keys ``exp_avg/<name>``, ...
    config.json                                  the model's transformers config
    trainer_state.json                           step, AdamW step count, data position, TrainConfig, the
                                                 layout at save time, every parameter's full shape

and ``<root>/latest`` names the newest checkpoint.

Every tensor is stored under its Hugging Face parameter name at full (tp = 1) global coordinates, cut into
the pieces the ranks own: a safetensors file holds, per key, one piece, and its header's ``DCP_SHARDING_INFO``
gives the piece's offsets in the full tensor (DCP's Hugging Face format). A piece is a run of consecutive
rows along the parameter's ``tp_dim`` that the rank owns: its :class:`~tensorpar.shard.Partition` range, or,
for a :class:`~tensorpar.shard.UnitSelection` (KV heads duplicated on several ranks, fused ``[q|k|v]`` or
``[gate|up]`` rows), the rows it owns (lowest holding rank), which may be several runs (file ``K`` holds a
rank's ``K``-th piece of a key). Replicated tensors are written by tp rank 0, only data-parallel replica 0
writes, each pipeline stage writes its own layers, and a tied embedding / LM head only on the first stage.
DCP's global plan check (no overlapping pieces, pieces that fill each tensor) runs at every save.

Why these DCP pieces: our splits are uneven and head-aligned (5 heads of 8 rows over 2 ranks is 24 + 16 rows,
not torch.chunk's 20 + 20) or not contiguous at all (fused projections, duplicated KV heads), so a DTensor
``Shard`` placement, whose offsets DCP computes with torch.chunk rules, describes them wrongly, and
``DTensor.from_local(shape=, stride=)`` only fixes the global shape, not the offsets. A ``ShardedTensor``
(``init_from_local_shards`` with ``ShardMetadata`` offsets) would describe them, but it is the deprecated
``torch.distributed._shard`` API, needs one collective per tensor to build, and a placement per process
group. Instead, small subclasses of DCP's ``DefaultSavePlanner`` / ``DefaultLoadPlanner`` (the documented
extension points) turn our pieces into DCP ``WriteItem``s / ``ReadItem``s with explicit offsets; loading
uses DCP's own resharding (``create_read_items_for_chunk_list``), so a rank at a new layout reads only the
stored pieces that overlap its rows.

Nothing is unpickled: DCP's default ``FileSystemWriter`` stores its ``.metadata`` file with ``pickle`` (and
its reader unpickles it), so we use DCP's ``HuggingFaceStorageWriter`` (``save_distributed=True``, no
consolidation: no metadata file at all) and ``HuggingFaceStorageReader``, which rebuilds DCP's metadata
from the safetensors headers (JSON). Only safetensors and JSON files are read. (At save, DCP exchanges its
plans between the ranks with ``gather_object``, i.e. pickled in memory among our own processes; loading
runs with ``no_dist`` on every rank, without any collective.)

Saving (every rank calls): global rank 0 clears leftovers of killed saves (``.tmp-step_*``, ours only) and
makes ``<root>/.tmp-step_<N>/``; every rank writes its pieces there with ``dcp.save`` (files fsynced); all
ranks agree that every write succeeded (an all-reduce of a flag); only then rank 0 writes ``config.json`` and
``trainer_state.json``, renames the folder to ``step_<N>``, replaces ``latest`` (write + ``os.replace``)
and prunes old checkpoints beyond ``keep`` (only ``step_*`` folders holding our ``trainer_state.json``).
A save that fails or is killed at any point leaves the previous checkpoint and ``latest`` untouched; no
rank ever gathers a parameter or optimizer state.

Loading (every rank, independently): check that the checkpoint holds every parameter at the model's full
shape (else a ValueError naming the tensor and both shapes), then ``dcp.load`` fills this rank's rows of
each parameter and AdamW moment in place (duplicated KV rows on every rank that holds them).
Checkpoints of the previous format (``tensorpar-train-v1``: full-shape ``model.safetensors`` and
``optimizer/state.safetensors``, written by rank 0) load through the same reader (one full piece per key).
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from tensorpar import comm
from tensorpar.comm import Group
from tensorpar.shard import Partition, UnitSelection

FORMAT = "tensorpar-train-v2"
FORMAT_V1 = "tensorpar-train-v1"   # full-shape files written by rank 0 (still loaded)
FORMATS = (FORMAT, FORMAT_V1)
MODEL_DIR = "model"
OPTIM_DIR = "optimizer"
MODEL_FILE = "model.safetensors"              # v1 only
OPTIM_FILE = "optimizer/state.safetensors"    # v1 only
STATE_FILE = "trainer_state.json"
LATEST = "latest"
OPTIM_KEYS = ("exp_avg", "exp_avg_sq")
TMP_PREFIX = ".tmp-step_"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (the previous one is intact) or is not a tensorpar checkpoint."""


# ---------------------------------------------------------------- shard <-> full shape

def full_tensor(t: torch.Tensor, param: nn.Parameter, tp: Group) -> torch.Tensor:
    """The full-shape tensor of which ``t`` is this rank's slice laid out like ``param`` (tests, export).

    Shapes: ``t`` has ``param``'s local shape; the result has ``tp_partition.n`` along ``tp_dim``
    (a replicated tensor is returned as is). Collectives: one all-gather over tp for a sharded tensor.
    Checkpoint saving never calls it.
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


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The tp = 1 shape of a (possibly tp-sharded) parameter: its local shape with ``tp_partition.n`` along
    ``tp_dim``."""
    shape = list(param.shape)
    dim = getattr(param, "tp_dim", None)
    part = getattr(param, "tp_partition", None)
    if dim is not None and part is not None:
        shape[dim] = part.n
    return tuple(shape)


@dataclass(frozen=True)
class Piece:
    """A box of a full tensor that lives in ``tensor`` (a view of this rank's local tensor).

    ``key``: the stored name; ``offsets``: where ``tensor`` starts in the full tensor of shape ``size``.
    """

    key: str
    tensor: torch.Tensor
    offsets: tuple[int, ...]
    size: tuple[int, ...]


def pieces(key: str, t: torch.Tensor, param: torch.Tensor, tp_rank: int, *, owned: bool) -> list[Piece]:
    """The boxes of the full tensor ``key`` that ``t`` (laid out like ``param`` on tp rank ``tp_rank``) holds.

    ``owned``: only the rows this rank owns (saving: every element once over tp: a replicated tensor on tp
    rank 0, a duplicated KV unit on its lowest holding rank); else every row it holds (loading). Rows that are
    consecutive both in ``t`` and in the full tensor form one piece, so a :class:`Partition` gives one piece and
    a fused ``[q|k|v]`` selection one per block.
    """
    size = full_shape(param)
    dim = getattr(param, "tp_dim", None)
    part = getattr(param, "tp_partition", None)
    if dim is None or part is None:
        if owned and tp_rank != 0:
            return []
        return [Piece(key, t, (0,) * t.dim(), size)]
    if isinstance(part, Partition):  # one contiguous range, owned by its only holder
        runs = [(0, part.offsets[tp_rank], part.sizes[tp_rank])]
    elif isinstance(part, UnitSelection):  # walk its units (heads, not rows); owner: the lowest holding rank
        first: dict[int, int] = {}
        for r, us in enumerate(part.units):
            for u in us:
                first.setdefault(u, r)
        runs = []  # (local row, global row, rows)
        for i, u in enumerate(part.units[tp_rank]):
            if owned and first[u] != tp_rank:
                continue
            lo, go = i * part.unit, u * part.unit
            if runs and runs[-1][0] + runs[-1][2] == lo and runs[-1][1] + runs[-1][2] == go:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + part.unit)
            else:
                runs.append((lo, go, part.unit))
    else:
        raise TypeError(f"{key}: tp_partition of type {type(part).__name__} cannot be checkpointed; expected a "
                        f"Partition or a UnitSelection")
    out = []
    for lo, go, n in runs:
        off = [0] * t.dim()
        off[dim] = go
        out.append(Piece(key, t.narrow(dim, lo, n), tuple(off), size))
    return out


# ---------------------------------------------------------------- DCP plumbing

def _dcp_writer(path: Path):
    """DCP's Hugging Face safetensors writer, one folder per key prefix, one file per (rank, piece ordinal).

    ``HuggingFaceStorageWriter`` would put every piece of a rank in one file under its key, so a rank with
    two pieces of one key (a fused projection) would lose one; pieces are therefore bucketed by their ordinal
    within the key, and optimizer keys (``exp_avg/...``) go to ``optimizer/``.
    """
    import queue

    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    class _Writer(HuggingFaceStorageWriter):
        def write_data(self, plan, planner):
            from torch.futures import Future
            if not plan.items:
                fut = Future()
                fut.set_result([])
                return fut
            shard = plan.storage_data.get("shard_index", 1)
            seen: dict[str, int] = {}
            buckets: dict[tuple[str, int], list] = {}
            for item in plan.items:
                k = seen.get(item.index.fqn, 0)
                seen[item.index.fqn] = k + 1
                sub = OPTIM_DIR if item.index.fqn.split("/", 1)[0] in OPTIM_KEYS else MODEL_DIR
                buckets.setdefault((sub, k + 1), []).append(item)
            files: queue.Queue = queue.Queue()
            for (sub, k), items in sorted(buckets.items()):
                self.fs.mkdir(self.fs.concat_path(self.path, sub))
                name = f"{sub}/shard-{shard:05d}-{k:05d}.safetensors"
                files.put((self.fs.concat_path(self.path, name), name, items))
            return self._write_data(planner, files)

    return _Writer(str(path), save_distributed=True)


def _planners():
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    def index(p: Piece):
        return MetadataIndex(p.key, torch.Size(p.offsets))

    class SavePieces(DefaultSavePlanner):
        """Writes exactly the given pieces (no dedup needed: each element has one owner)."""

        def __init__(self, ps: list[Piece]):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.by_index = {index(p): p for p in ps}

        def create_local_plan(self):
            items = [WriteItem(index=i, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=p.tensor.size()),
                properties=TensorProperties.create_from_tensor(p.tensor), size=torch.Size(p.size)))
                for i, p in self.by_index.items()]
            self.plan = SavePlan(items)
            return self.plan

        def resolve_data(self, write_item):
            return self.by_index[write_item.index].tensor.detach()

    class LoadPieces(DefaultLoadPlanner):
        """Fills the given pieces in place; DCP computes which stored boxes overlap each."""

        def __init__(self, ps: list[Piece]):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.ps = ps
            self.by_index = {index(p): p for p in ps}

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

        def create_local_plan(self):
            by_key: dict[str, list[Piece]] = {}
            for p in self.ps:
                by_key.setdefault(p.key, []).append(p)
            items = []
            for key, ps in by_key.items():
                chunks = [ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=p.tensor.size()) for p in ps]
                items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], chunks)
            return LoadPlan(items)

        def resolve_tensor(self, read_item):
            t = self.by_index[MetadataIndex(read_item.dest_index.fqn, read_item.dest_index.offset)].tensor
            for d, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                t = t.narrow(d, o, n)
            return t

        def commit_tensor(self, read_item, tensor):
            pass

    return SavePieces, LoadPieces


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
                 tp_rank: int, *, local: Callable[[nn.Parameter, torch.Tensor], torch.Tensor] | None = None
                 ) -> list[Piece]:
    """The pieces this rank writes: each parameter's owned rows and its AdamW moments' (``exp_avg/<name>``).

    ``local(param, tensor)`` returns the tp-local tensor to store for ``param`` (its data or a moment); the
    default is the tensor itself (a data-parallel wrapper that shards over dp plugs in its ``full_tensor``).
    """
    local = local or (lambda p, t: t)
    out: list[Piece] = []
    for name, p in named_params:
        out += pieces(name, local(p, p.detach()), p, tp_rank, owned=True)
        st = optimizer.state.get(p, {}) if optimizer is not None else {}
        for key in OPTIM_KEYS:
            if key in st:
                out += pieces(f"{key}/{name}", local(p, st[key]), p, tp_rank, owned=True)
    return out


def save_pieces(root: str | os.PathLike, ps: list[Piece], *, step: int, state: dict, optimizer_step: int,
                config_json: str | None, keep: int, pg=None, rank: int = 0,
                device: torch.device | None = None) -> Path:
    """Write ``<root>/step_<step>`` from the pieces of every rank of ``pg`` (every rank calls, with its own).

    ``pg``: the process group of all ranks (None: the default group, or a single process without
    torch.distributed); ``rank``: this rank in it (0 publishes); ``device``: where the agreement flag lives
    (the backend's device). ``state`` (rank 0's counts) goes into ``trainer_state.json`` with the format, step,
    optimizer step and every model tensor's full shape.

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
            _fsync_tree(tmp)
            _publish(root, tmp, final, keep)
        except Exception as e:  # OSError, disk full, ... (the folder is not published: nothing else changed)
            error = f"{type(e).__name__}: {e}"
            shutil.rmtree(tmp, ignore_errors=True)
    if not _agree(not error, pg, device):
        raise CheckpointError(_failed(root, final, error or "publishing failed on rank 0"))
    return final


def _first_error(e: BaseException) -> str:
    """One line for a failed ``dcp.save``: the first rank's underlying exception (DCP's CheckpointException holds
    a traceback per failing rank), else the exception itself."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, inner = sorted(failures.items())[0]
        inner = inner[0] if isinstance(inner, tuple) else inner  # (exception, traceback summary)
        return f"rank {rank}: {type(inner).__name__}: {inner}"
    return f"{type(e).__name__}: {e}".splitlines()[0]


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


def _shape(s) -> str:
    return "(" + ", ".join(str(int(x)) for x in s) + ("," if len(s) == 1 else "") + ")"


def load_checkpoint(ckpt: str | os.PathLike, *, named_params: list[tuple[str, nn.Parameter]],
                    optimizer: torch.optim.Optimizer | None, tp: Group, part: bool = False) -> dict:
    """Fill this rank's parameter rows (and AdamW state) from a checkpoint saved at any layout; return its state.

    No collectives: each rank reads the stored pieces that overlap its rows (``dcp.load`` with ``no_dist``),
    duplicated KV rows included. Parameters are updated in place, so the optimizer keeps its references.
    ``part``: the parameters are one pipeline stage's, so the checkpoint's other tensors are expected.

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
    read_pieces(model_dir, [pc for name, p in named_params for pc in pieces(name, p.data, p, tp.rank, owned=False)])
    if optimizer is not None and state.get("optimizer_step", 0) > 0:
        have = stored_shapes(optim_dir, {f"{k}/{n}": s for n, s in shapes.items() for k in OPTIM_KEYS})
        ps = []
        for name, p in named_params:
            if f"{OPTIM_KEYS[0]}/{name}" not in have:  # never updated (no gradient yet): no state
                continue
            st = {"step": torch.tensor(float(state["optimizer_step"]))}
            for key in OPTIM_KEYS:
                st[key] = torch.zeros_like(p.data)
                ps += pieces(f"{key}/{name}", st[key], p, tp.rank, owned=False)
            optimizer.state[p] = st
        read_pieces(optim_dir, ps)
    return state
