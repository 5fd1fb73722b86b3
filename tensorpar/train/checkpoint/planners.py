"""DCP plumbing of the checkpoint: the safetensors writer that buckets a rank's pieces into files
(:func:`_dcp_writer`), the save and load planners that turn pieces (:class:`~tensorpar.train.checkpoint.format.Piece`)
into DCP write and read items with explicit offsets (:func:`_planners`; loading reshards through DCP's
``create_read_items_for_chunk_list``), and the one-line summary of a failed DCP call (:func:`_first_error`).
"""
from __future__ import annotations

from pathlib import Path

import torch

from tensorpar.train.checkpoint.format import MODEL_DIR, OPTIM_DIR, OPTIM_KEYS, Piece


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


def _first_error(e: BaseException) -> str:
    """One line for a failed ``dcp.save``: the first rank's underlying exception (DCP's CheckpointException holds
    a traceback per failing rank), else the exception itself."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, inner = sorted(failures.items())[0]
        inner = inner[0] if isinstance(inner, tuple) else inner  # (exception, traceback summary)
        return f"rank {rank}: {type(inner).__name__}: {inner}"
    return f"{type(e).__name__}: {e}".splitlines()[0]
