"""Sharded loading: build a Hugging Face model on the meta device, shard it by its plan, and let
each rank read only its own slices of the safetensors files.

The slice a rank reads for a parameter is given by the parameter's own ``tp_dim`` and
``tp_partition`` (set by the plan at module replacement), so the plan is the one source of
truth for both.

Files are read with plain reads (:class:`SafetensorsReader`), not memory-mapped: a safetensors file
is an 8-byte little-endian header length, a JSON header (``dtype``, ``shape``, ``data_offsets``
per tensor) and the row-major data, so the bytes of a rank's slice are a list of contiguous runs
(one per selected block of rows, times the product of the dimensions before the split one). Each
run is read with ``readinto`` straight into the preallocated, contiguous parameter; when the file's
dtype differs from the model's or the parameter lives on an accelerator, runs go through a bounded
bounce buffer (``BOUNCE_BYTES``) and are converted by ``copy_`` chunk by chunk. A rank's memory
therefore grows by its shard (plus the bounce buffer), never by the whole file, and no parameter is
a view into a mapping of the file (see ``bench/bench_load.py`` for the measurement).

Before any weight is read, :func:`check_checkpoint` compares the checkpoint's headers with the
model the config describes, in both directions (missing tensors, unused tensors, wrong shapes).

One module per concern: :mod:`.reader` (safetensors headers and plain reads of a rank's slice), :mod:`.check`
(the checkpoint against the model, before any read), :mod:`.build` (the sharded model, built and filled).
"""
from tensorpar.hf.load.reader import (BOUNCE_BYTES, DTYPES, SafetensorsReader, _runs, read_header, read_shard,
                                      weight_map)
from tensorpar.hf.load.check import _meta_model, check_checkpoint
from tensorpar.hf.load.build import (build_parallel_model, follow_stored_ties, load_sharded,
                                     resolve_attn_implementation, stored_untied)

__all__ = ["BOUNCE_BYTES", "DTYPES", "SafetensorsReader", "read_header", "read_shard", "weight_map",
           "check_checkpoint", "build_parallel_model", "follow_stored_ties", "load_sharded",
           "resolve_attn_implementation", "stored_untied"]
