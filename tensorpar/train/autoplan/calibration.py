"""The machine's calibration for ``tensorpar train --plan auto``, measured once and cached.

:func:`quick_calibration` measures this machine in a few seconds (1-thread matmuls, copy bandwidth, the AdamW
step, 2-rank all-reduces over gloo and shared memory, the pipeline's send/recv link, and the fixed per-layer and
per-micro-batch times of a training step, :func:`measure_train_overhead`, plus a CPU's decoder-layer matmul
efficiency, :func:`measure_layer_efficiency`); :func:`cached_calibration` keeps it in
``<cache>/calibration/<machine key>.json`` (:func:`machine_key`), written atomically under a file lock.
"""
from __future__ import annotations

import hashlib
import json
import platform
import statistics
from pathlib import Path

from tensorpar.train.autoplan.sampler import CompetitionSampler, _loadavg


CALIBRATION_VERSION = 6  # 6: the pipeline's send/recv link and per-micro-batch schedule CPU (measure_pipeline)


def _median_step_s(model, plan, ids, ctx, clock, reps: int, warmup: int) -> float:
    """Median seconds (by ``clock``) of ``reps`` training steps of ``model`` on ``ids`` ``[b, s]`` after ``warmup``
    untimed ones: forward, vocabulary-parallel cross-entropy (:mod:`tensorpar.layers.cross_entropy`), backward."""
    from tensorpar.layers import vocab_parallel_cross_entropy

    samples = []
    for i in range(reps + warmup):
        start = clock()
        loss = vocab_parallel_cross_entropy(model(input_ids=ids, use_cache=False).logits, ids, ctx.tp,
                                            partition=plan.vocab)
        loss.backward()
        if i >= warmup:
            samples.append(clock() - start)
    return statistics.median(samples)


def machine_key() -> str:
    """A file-name-safe key of this machine as a calibration depends on it: host, usable cores, torch, GPU."""
    import torch

    from tensorpar.launch import usable_cores

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    raw = f"{platform.node()}|{usable_cores()}|{torch.__version__}|{gpu}|v{CALIBRATION_VERSION}"
    return f"{platform.node() or 'host'}-{hashlib.sha256(raw.encode()).hexdigest()[:12]}"


def calibration_path(cache_dir=None) -> Path:
    from tensorpar.cache import cache_root

    return cache_root(cache_dir) / "calibration" / f"{machine_key()}.json"


def quick_calibration() -> dict:
    """A short calibration (a few seconds): 1-thread matmuls, copy bandwidth and AdamW step (CPU; bf16 matmuls and
    the GPU's copy and AdamW on CUDA), all-reduces of 4 KiB to 4 MiB between two local ranks over gloo and over
    tensorpar's shared-memory collectives (``collective["by_backend"]``; shm only where it installs), and the
    fixed per-layer and per-micro-batch times. Same fields as :class:`Calibration` plus ``matmul_threads`` (the
    thread count of the matmul, copy and optimizer measurements), ``optimizer_ns_per_param``, ``cores``."""
    import time

    import torch

    from tensorpar.launch import usable_cores
    from tensorpar.planner.calibrate import (measure_collectives, measure_matmul, measure_memory_bandwidth,
                                             measure_optimizer, measure_pipeline)

    cuda = torch.cuda.is_available()
    threads = torch.get_num_threads()
    load_start = _loadavg()
    # CPU: one torch thread, timed by its CPU time (time.thread_time): the speed of a thread alone on a core, which
    # other users' processes on a shared machine do not change (they change the wall time). CUDA: wall time.
    clock = time.perf_counter if cuda else time.thread_time
    if not cuda:
        torch.set_num_threads(1)
    try:
        name, matmul = measure_matmul(None if cuda else (128, 256, 512), min_seconds=0.1, clock=clock)
        hbm = measure_memory_bandwidth(1 << 26, min_seconds=0.1, clock=clock)
        optimizer = measure_optimizer(1 << 20, min_seconds=0.1, clock=clock)
        overhead = measure_train_overhead(clock=clock)
        peak = max(m["tflops"] for m in matmul)
        layer = ({} if cuda else
                 measure_layer_efficiency(peak, hbm, overhead["train_layer_overhead_us"], clock=clock))
    finally:
        torch.set_num_threads(threads)
    # the collectives are timed by the wall clock (waiting is their cost): record the competition meanwhile
    with CompetitionSampler(interval=0.05) as others:
        try:
            coll = measure_collectives(tuple(2 ** k for k in range(12, 23, 2)), backends=("gloo", "shm"))
        except RuntimeError:  # shared memory not available here (not x86, no /dev/shm): gloo only
            coll = measure_collectives(tuple(2 ** k for k in range(12, 23, 2)))
        try:  # the pipeline's send/recv link and the schedule's fixed CPU per micro-batch (2 gloo ranks)
            pipeline = measure_pipeline()
        except RuntimeError:  # leave them out (0: not modelled) rather than fail the plan
            pipeline = {}
    taken = others.others_cores_between()
    if taken is not None:
        coll["others_busy_cores"] = taken
    return {**overhead, **layer, "pipeline": pipeline, "loadavg_1min": (load_start + _loadavg()) / 2, "version": CALIBRATION_VERSION,
            "backend": name, "matmul": matmul,
            "matmul_tflops": max(m["tflops"] for m in matmul), "matmul_threads": 0 if cuda else 1,
            "hbm_gbps": hbm, "optimizer_ns_per_param": optimizer, "collective": coll, "cores": usable_cores(),
            "cuda": cuda, "memory_gib": _machine_memory_gib(), "clock": "wall" if cuda else "thread_cpu"}


def measure_train_overhead(reps: int = 25, clock=None) -> dict:
    """Fixed time of a training step that no FLOP or byte count explains, on this process's threads.

    Forward, vocabulary-parallel cross-entropy and backward of tensorpar's tp = 1 model of a tiny Llama (hidden
    32, 8 tokens: the arithmetic is negligible) with 1 and with 4 layers; the median of ``reps`` steps (on a
    shared machine, the time a step takes under the load of the moment, like the steps it predicts) give, by
    difference, ``train_layer_overhead_us`` (per layer, forward + backward) and ``train_micro_batch_overhead_us``
    (the rest: embedding, final norm, LM head, loss), in microseconds. ``clock``: ``time.perf_counter`` (wall time)
    by default; ``time.thread_time`` (the thread's CPU time, with one torch thread) gives the time alone on a core.
    """
    import time

    import torch
    from transformers import LlamaConfig

    from tensorpar.parallel import ParallelContext
    from tensorpar.train.config import TrainConfig
    from tensorpar.train.model import ModelSource, build_model

    clock = clock or time.perf_counter
    ctx = ParallelContext.single()
    cfg = TrainConfig(model="calibration", seq_len=8, batch_size=1)
    ids = torch.arange(8).view(1, 8) % 64
    median = {}
    for layers in (1, 4):
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                             tie_word_embeddings=True)
        model, plan = build_model(cfg, ModelSource(config, None, None), ctx.tp, 64)
        median[layers] = _median_step_s(model, plan, ids, ctx, clock, reps, warmup=3)
    per_layer = max(0.0, (median[4] - median[1]) / 3)
    return {"train_layer_overhead_us": per_layer * 1e6,
            "train_micro_batch_overhead_us": max(0.0, median[1] - per_layer) * 1e6}


# The decoder layer that calibrates a CPU's layer efficiency (measure_layer_efficiency): a generic small Llama layer,
# not any model trained here: hidden 384 (6 heads of 64, 2 KV heads), SwiGLU 1024, 2 sequences of 128 tokens.
EFFICIENCY_LAYER = dict(hidden_size=384, intermediate_size=1024, num_attention_heads=6, num_key_value_heads=2,
                        head_dim=64, batch=2, seq=128)


def measure_layer_efficiency(peak_tflops: float, hbm_gbps: float, layer_overhead_us: float,
                             reps: int = 3, clock=None) -> dict:
    """The fraction of the square-matmul peak that a decoder layer's matmuls reach on this CPU, measured.

    Forward and backward of tensorpar's tp = 1 model of :data:`EFFICIENCY_LAYER` with 1 and 2 layers (the median
    of ``reps`` steps each, after one warm-up); the difference is one layer's time, ``T``. The planner's time of
    that layer at ``matmul_efficiency`` ``e`` is
    ``F / (e peak) + E + O`` (``F``: its matmul and attention FLOPs forward and backward, ``E``: its elementwise
    traffic at ``hbm_gbps``, ``O``: the measured fixed ``layer_overhead_us``, :func:`tensorpar.planner.cost.
    layer_times`), so ``e = F / (peak (T - E - O))``, clamped to [0.05, 1]. The counterpart of the A100's
    ``matmul_efficiency``, which was fitted to measured layer times too (Korthikanti et al. 2022, Table 4): the
    shapes of a layer's matmuls (skinny, batched attention) run below a large square matmul's rate.
    Returns ``{"layer_matmul_efficiency", "layer_seconds", "layer_predicted_at_peak_seconds"}``.
    """
    import time
    from dataclasses import replace

    import torch
    from transformers import LlamaConfig

    from tensorpar.parallel import ParallelContext
    from tensorpar.planner.cluster import ClusterSpec, DeviceSpec
    from tensorpar.planner.cost import layer_times
    from tensorpar.planner.layout import Assumptions, Layout, Workload
    from tensorpar.planner.model_spec import from_hf_config
    from tensorpar.train.config import TrainConfig
    from tensorpar.train.model import ModelSource, build_model

    clock = clock or time.perf_counter
    shape = dict(EFFICIENCY_LAYER)
    batch, seq = shape.pop("batch"), shape.pop("seq")
    ctx = ParallelContext.single()
    cfg = TrainConfig(model="calibration", seq_len=seq, batch_size=batch)
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))
    median = {}
    for layers in (1, 2):
        config = LlamaConfig(vocab_size=256, num_hidden_layers=layers, max_position_embeddings=seq,
                             tie_word_embeddings=True, **shape)
        model, plan = build_model(cfg, ModelSource(config, None, None), ctx.tp, 256)
        median[layers] = _median_step_s(model, plan, ids, ctx, clock, reps, warmup=1)
    measured = max(1e-9, median[2] - median[1])
    spec = from_hf_config(config.to_dict(), name="calibration")
    device = DeviceSpec("calibration", 1.0, peak_tflops, 0.0, 0.0, matmul_efficiency=1.0, hbm_gbps=hbm_gbps,
                        local_link_gbps=1.0, train_layer_overhead_us=layer_overhead_us)
    assume = Assumptions(activation_bytes=4, param_bytes=4, grad_bytes=4, optimizer_bytes=8, attention="sdpa")
    lay = Layout(tp=1, pp=1, dp=1, micro_batch=batch)
    work = Workload(batch, seq)
    at_peak = layer_times(spec, lay, ClusterSpec(device, 1, 1), work, assume).total
    no_matmul = layer_times(spec, lay, ClusterSpec(replace(device, peak_tflops=1e9), 1, 1), work, assume).total
    flops_seconds = at_peak - no_matmul  # the matmul and attention FLOPs at the peak
    efficiency = flops_seconds / max(1e-12, measured - no_matmul)
    return {"layer_matmul_efficiency": min(1.0, max(0.05, efficiency)), "layer_seconds": measured,
            "layer_predicted_at_peak_seconds": at_peak}


def _machine_memory_gib() -> float:
    from tensorpar.planner.calibrate import _memory_gib

    return _memory_gib()


def cached_calibration(cache_dir=None, *, log=None) -> tuple[dict, Path, bool]:
    """``(calibration, its file, whether it was read from the cache)``; measures and saves it when absent.

    Raises RuntimeError when a calibration rank fails (its message says which).
    """
    from tensorpar.cache import atomic_file, file_lock

    path = calibration_path(cache_dir)
    with file_lock(path.with_suffix(".lock"), what="a calibration of this machine"):
        try:
            data = json.loads(path.read_text())
            if data.get("version") == CALIBRATION_VERSION:
                return data, path, True
        except (OSError, ValueError):
            pass  # absent or unreadable: measure again
        if log:
            log(f"measuring this machine once for the planner (cached in {path}) ...")
        data = quick_calibration()
        with atomic_file(path, "w") as f:
            json.dump(data, f, indent=2)
    return data, path, False


def describe_device_source(path: Path, cached: bool) -> str:
    return f"calibration {'read from' if cached else 'measured now, saved to'} {path}"
