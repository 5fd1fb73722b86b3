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

The modules: ``format.py`` (names, versions, :class:`Piece` and the geometry of pieces), ``planners.py`` (DCP's
writer and planners), ``find.py`` (finding and checking checkpoints, no tensor read), ``load.py`` (reading
pieces, :func:`load_checkpoint`), ``save.py`` (:func:`save_pieces`, :func:`save_checkpoint`).
"""
from tensorpar.train.checkpoint.find import (check_files, check_state, damaged_hint, latest_checkpoint,
                                             list_checkpoints, read_state, tensor_dirs)
from tensorpar.train.checkpoint.format import (FORMAT, FORMAT_V1, FORMATS, LATEST, MODEL_DIR, MODEL_FILE, OPTIM_DIR,
                                               OPTIM_FILE, OPTIM_KEYS, STATE_FILE, TMP_PREFIX, CheckpointError, Piece,
                                               full_shape, full_tensor, pieces)
from tensorpar.train.checkpoint.load import load_checkpoint, read_full, read_pieces, stored_shapes
from tensorpar.train.checkpoint.save import optimizer_step, save_checkpoint, save_pieces, state_pieces

__all__ = [
    "FORMAT", "FORMAT_V1", "FORMATS", "LATEST", "MODEL_DIR", "MODEL_FILE", "OPTIM_DIR", "OPTIM_FILE", "OPTIM_KEYS",
    "STATE_FILE", "TMP_PREFIX", "CheckpointError", "Piece", "check_files", "check_state", "damaged_hint", "full_shape",
    "full_tensor", "latest_checkpoint", "list_checkpoints", "load_checkpoint", "optimizer_step", "pieces", "read_full",
    "read_pieces", "read_state", "save_checkpoint", "save_pieces", "state_pieces", "stored_shapes", "tensor_dirs",
]
