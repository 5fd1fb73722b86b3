"""A rank's device with the decode constants measured at one model's shapes (:func:`decode_device`), cached per
machine and model shape (:func:`cached_decode_constants`).

The four constants the inference planner's decode model reads (:class:`tensorpar.planner.cluster.DeviceSpec`):

* ``decode_read_gbps``: the one-row matmul (GEMV) read rate of the model's tp = 1 weight shapes, one process alone
  (:func:`~tensorpar.planner.calibrate.decode.measure_decode_reads`);
* ``decode_read_host_gbps``: the same at the tp = ``ranks`` rank's shapes with ``ranks`` processes reading at
  once, times ``ranks`` (0 with one rank: no sharing to cap);
* ``decode_collective_us``: what one collective adds to those passes when the decode step's ``2 x layers + 3``
  collectives run where the lean path runs them, over ``backend`` ("shm": tensorpar's shared-memory collectives,
  gloo where they do not install; "gloo") (0 with one rank);
* ``layer_overhead_us``: greedy decode of the same architecture with 8-wide matrices (head_dim 8, MLP 64,
  vocabulary 256) on the lean path (the generic path where the family has none), tp = 1, one thread, ms per
  token / layers (the floor job the caller passes: :func:`tensorpar.decode.floor.floor_job`).

And the time to first token's (:mod:`tensorpar.planner.prefill`): ``prefill_read_gbps`` and ``prefill_tflops``
(a prefill's matmuls at the tp = 1 shapes over 16 and 256 rows, fitted as weights / read + FLOPs / rate),
``prefill_attention_tflops`` (the prompt's attention), one thread's CPU time each
(:func:`~tensorpar.planner.calibrate.prefill.measure_prefill`; a rank gets ``threads_per_rank`` times them), and
``prefill_layer_overhead_us`` (the floor's warm prefill of its 6-token prompt, per layer, CPU time); and
``int8_reduce_cpu_us`` (a ``--tp-comm int8`` all-reduce's own CPU work at ``[1, h]``:
:func:`~tensorpar.planner.calibrate.decode.measure_int8_reduce`).

Each is measured in fresh worker processes (:class:`tensorpar.testing.WorkerPool`, one thread per rank). About
30-90 s on a 2-core machine (SmolLM2 135M, 2 ranks; most of it starting the worker processes and the floor's
model); the cache, ``<cache>/calibration/decode-<machine key>-<shape key>.json`` (the folder and machine key of
``train --plan auto``'s calibration), makes it a one-time cost per machine, model shape, rank count and backend.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

DECODE_CALIBRATION_VERSION = 4   # 2: prefill constants; 3: the prefill overhead in CPU time; 4: int8_reduce_cpu_us
FLOOR_TOKENS = 16


def measure_decode_constants(model, config: dict, ranks: int, backend: str, floor_job,
                             tokens: int = FLOOR_TOKENS) -> dict:
    """Measure the four decode constants (module docstring) for ``model`` (a
    :class:`~tensorpar.planner.model_spec.ModelSpec`; ``config``: its Hugging Face config dict, for the floor) with
    ``ranks`` ranks on this host. ``floor_job(ctx, config, tokens) -> {"step_ms", "path"}``: the
    :class:`~tensorpar.testing.WorkerPool` job of the floor (:func:`tensorpar.decode.floor.floor_job`; passed in:
    the planner does not import the code it plans). Returns the constants plus ``seconds`` (the time it took),
    ``floor_path``, ``floor_step_ms``, ``backend`` (the one measured), ``loadavg_1min`` (the mean of before and
    after: the rates are wall-clock ones under that load) and ``reads`` (``measure_decode_reads``' results, ranks
    dropped). Raises RuntimeError when a worker fails."""
    from tensorpar.planner.calibrate.decode import measure_decode_reads
    from tensorpar.testing import RankFailure, WorkerPool

    start, load = time.perf_counter(), os.getloadavg()[0]
    from tensorpar.planner.calibrate.decode import measure_int8_reduce
    from tensorpar.planner.calibrate.prefill import measure_prefill
    from tensorpar.planner.partition import busiest_heads

    try:
        with WorkerPool(1, collective_timeout_s=120, job_timeout_s=600) as pool:
            floor = pool.run(floor_job, config, tokens)[0]
            layer_shapes, layers, _ = decode_shapes(model, 1)
            prefill = measure_prefill(pool, layer_shapes, layers,
                                      (busiest_heads(model.num_heads, model.num_kv_heads, 1).q, model.head_dim))
            prefill.update(pool.run(measure_int8_reduce, model.hidden_size)[0])
    except RankFailure as err:
        raise RuntimeError(f"decode floor calibration failed: {err}") from None
    reads = {"alone_tp1": measure_decode_reads(*decode_shapes(model, 1), 1)}
    if ranks > 1:
        try:
            reads["shared"] = measure_decode_reads(*decode_shapes(model, ranks), ranks, backend)
        except RuntimeError:
            if backend != "shm":
                raise
            backend = "gloo"   # no shared-memory collectives here: gloo's
            reads["shared"] = measure_decode_reads(*decode_shapes(model, ranks), ranks, backend)
    for r in reads.values():
        r.pop("ranks", None)
    shared = reads.get("shared", {})
    return {"decode_read_gbps": reads["alone_tp1"]["gbps"], "decode_read_host_gbps": shared.get("host_gbps", 0.0),
            "decode_collective_us": max(0.0, shared.get("collective_us", 0.0)),
            "layer_overhead_us": floor["step_ms"] * 1e3 / model.num_layers, "floor_step_ms": floor["step_ms"],
            "prefill_layer_overhead_us": floor["prefill_ms"] * 1e3 / model.num_layers,
            "floor_prefill_ms": floor["prefill_ms"], **prefill,
            "floor_path": floor["path"], "backend": backend if ranks > 1 else "", "reads": reads,
            "seconds": time.perf_counter() - start, "loadavg_1min": (load + os.getloadavg()[0]) / 2}


def decode_shapes(model, tp: int) -> tuple:
    """``(layer shapes, layers, head shape)`` of the busiest rank at ``tp`` (:func:`tensorpar.planner.inference.
    decode_matrices`): the arguments of :func:`~tensorpar.planner.calibrate.decode.measure_decode_reads`."""
    from tensorpar.planner.inference import decode_matrices

    layer, head = decode_matrices(model, tp)
    return layer, model.num_layers, head


def shape_key(model, config: dict, ranks: int, backend: str) -> str:
    """The part of the cache key that the measurement depends on besides the machine: the weight shapes (layers,
    hidden, heads, KV heads, head_dim, MLP width and kind, vocabulary), the family (the floor's code path), the
    ranks on the host and the collectives' backend. Not the model's name or weights."""
    raw = json.dumps([DECODE_CALIBRATION_VERSION, config.get("model_type"), model.num_layers, model.hidden_size,
                      model.num_heads, model.num_kv_heads, model.head_dim, model.ffn_hidden_size, model.mlp,
                      model.vocab_size, model.num_experts, model.experts_per_token, ranks, backend])
    return hashlib.sha256(raw.encode()).hexdigest()[:12]


def decode_calibration_path(model, config: dict, ranks: int, backend: str, cache_dir=None) -> Path:
    from tensorpar.cache import cache_root

    return (cache_root(cache_dir) / "calibration" /
            f"decode-{machine_key()}-{shape_key(model, config, ranks, backend)}.json")


def machine_key() -> str:
    """This machine as the decode rates depend on it: host, usable cores, torch, GPU (the identity of ``train --plan
    auto``'s calibration key, :func:`tensorpar.train.autoplan.calibration.machine_key`, without its version)."""
    import platform

    import torch

    from tensorpar.launch import usable_cores

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    raw = f"{platform.node()}|{usable_cores()}|{torch.__version__}|{gpu}"
    return f"{platform.node() or 'host'}-{hashlib.sha256(raw.encode()).hexdigest()[:12]}"


def cached_decode_constants(model, config: dict, ranks: int, backend: str, floor_job, cache_dir=None, *,
                            log=None) -> tuple[dict, Path, bool]:
    """``(constants, their file, whether read from the cache)``: :func:`measure_decode_constants` once per machine
    and :func:`shape_key`, saved atomically under a file lock. ``log`` gets one line before a measurement.
    Raises RuntimeError when a worker fails."""
    from tensorpar.cache import atomic_file, file_lock

    path = decode_calibration_path(model, config, ranks, backend, cache_dir)
    with file_lock(path.with_suffix(".lock"), what="a decode calibration of this machine"):
        try:
            data = json.loads(path.read_text())
            if data.get("version") == DECODE_CALIBRATION_VERSION:
                return data, path, True
        except (OSError, ValueError):
            pass  # absent or unreadable: measure again
        if log:
            log(f"calibrating decode for this model shape once: ~30-60 s on 2 cores (cached in {path}) ...")
        data = dict(measure_decode_constants(model, config, ranks, backend, floor_job),
                    version=DECODE_CALIBRATION_VERSION)
        with atomic_file(path, "w") as f:
            json.dump(data, f, indent=2)
    return data, path, False


DECODE_FIELDS = ("decode_read_gbps", "decode_read_host_gbps", "decode_collective_us", "layer_overhead_us")
#: the prefill constants measured with them (:mod:`tensorpar.planner.calibrate.prefill`): the rates one thread's,
#: a rank's threads_per_rank times them; the overhead (and the int8 all-reduce's CPU time) as measured
PREFILL_RATES = ("prefill_read_gbps", "prefill_tflops", "prefill_attention_tflops")
PREFILL_FIELDS = (*PREFILL_RATES, "prefill_layer_overhead_us", "int8_reduce_cpu_us")


def needs_decode_constants(device) -> bool:
    """Whether ``device`` is a CPU rank (``host_cores`` > 0) with none of the decode constants
    (:data:`DECODE_FIELDS`)."""
    return device.host_cores > 0 and not any(getattr(device, k) for k in DECODE_FIELDS)


def decode_device(device, model, config: dict, ranks: int, backend: str, floor_job, cache_dir=None, *, log=None):
    """``(device, note)``: ``device`` with the decode constants of :func:`cached_decode_constants` where
    :func:`needs_decode_constants` (else unchanged, note ""); ``ranks``: the ranks on this host. Raises
    RuntimeError when a worker fails."""
    from dataclasses import replace

    if not needs_decode_constants(device):
        return device, ""
    data, path, cached = cached_decode_constants(model, config, ranks, backend, floor_job, cache_dir, log=log)
    load = (f" (measured at load {data['loadavg_1min']:.1f}; delete it to measure again)"
            if "loadavg_1min" in data else "")
    note = f"decode constants {'read from' if cached else 'measured now, saved to'} {path}{load}"
    threads = max(1, device.threads_per_rank)
    return replace(device, **{k: data[k] for k in DECODE_FIELDS},
                   **{k: data[k] * (threads if k in PREFILL_RATES else 1) for k in PREFILL_FIELDS}), note
