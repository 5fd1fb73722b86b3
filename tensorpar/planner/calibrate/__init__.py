"""``tensorpar plan --calibrate``: measure this machine instead of trusting datasheets.

* Matmul throughput: square matmuls timed with torch (bf16 on a GPU, fp32 on a CPU), 2 n^3 FLOPs each.
* Collective latency and bandwidth: two ranks on this host (tensorpar's worker pool, gloo over loopback, and
  tensorpar's shared-memory collectives installed on the same ranks), tensorpar's all-reduce of growing sizes; a
  least-squares fit of ``time = latency + wire_bytes / bandwidth`` per backend (ring all-reduce on 2 ranks sends
  ``2 (g-1)/g = 1`` x the payload).
* Optimizer: torch's AdamW step over 1 Mi fp32 parameters, nanoseconds per parameter.
* Decode (:func:`measure_decode_reads`, not run by :func:`calibrate`: it needs the model's shapes): the one-row
  matmul read rate of a decode step at given per-rank weight shapes, one or several processes at once, and what
  each of the step's collectives adds to it.
* Pipeline (:func:`measure_pipeline`): gloo send/recv latency and bandwidth between two ranks (ping-pong), and the
  CPU of one send or receive of torch.distributed.pipelining's 1F1B schedule (trivial stages).

Also: :func:`saved_activation_bytes`, the bytes autograd keeps for backward while a function runs, which
the tests compare with the activation model.

The modules: ``device.py`` (matmul, memory bandwidth, AdamW: this process alone), ``links.py`` (collectives and
the pipeline's point-to-point link between local ranks, and their latency-bandwidth fit), ``decode.py`` (a
decode step's weight reads), ``decode_device.py`` (the four decode constants at a model's shapes, cached per machine
and shape: what ``generate --plan auto`` adds to a CPU rank's device), ``memory.py`` (saved activations and peak
memory of a function); this file holds :func:`calibrate`, which runs the first two into a :class:`Calibration`.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from tensorpar.planner.calibrate.decode import measure_decode_reads
from tensorpar.planner.calibrate.device import measure_matmul, measure_memory_bandwidth, measure_optimizer
from tensorpar.planner.calibrate.links import (COLLECTIVE_BACKENDS, COLLECTIVE_SIZES, P2P_SIZES, PIPELINE_MICRO_BATCHES,
                                               fit_alpha_beta, measure_collectives, measure_pipeline)
from tensorpar.planner.calibrate.memory import peak_memory_bytes, saved_activation_bytes

__all__ = [
    "COLLECTIVE_BACKENDS", "COLLECTIVE_SIZES", "P2P_SIZES", "PIPELINE_MICRO_BATCHES", "Calibration", "calibrate",
    "fit_alpha_beta", "measure_collectives", "measure_decode_reads", "measure_matmul", "measure_memory_bandwidth",
    "measure_optimizer", "measure_pipeline", "peak_memory_bytes", "saved_activation_bytes",
]


@dataclass(frozen=True)
class Calibration:
    backend: str
    matmul: list[dict]  # {"n", "dtype", "tflops"}
    matmul_tflops: float  # best measured
    collective: dict  # {"backend", "world_size", "samples": [{"bytes", "seconds"}], "latency_us", "bandwidth_gbps"}
    device: dict  # DeviceSpec fields, for --device-file
    pipeline: dict = field(default_factory=dict)  # measure_pipeline's (empty where it could not run)

    def to_dict(self) -> dict:
        return asdict(self)


def _memory_gib() -> float:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 2 ** 30
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30


def calibrate() -> Calibration:
    """Measure matmul throughput, memory bandwidth, torch's AdamW step and loopback collectives (gloo, and
    tensorpar's shared memory in ``collective["by_backend"]`` where it installs). The ``device`` it returns uses
    the *measured* matmul rate as its peak (``matmul_efficiency`` 1), the measured copy bandwidth as
    ``hbm_gbps``, the AdamW time as ``optimizer_ns_per_param``, the measured gloo link as ``local_link_*``,
    labelled as this machine's local link (the NVLink and inter-node fields stay 0: not measured), and the
    pipeline's gloo send/recv link and the CPU of one of its sends or receives (:func:`measure_pipeline`) as
    ``p2p_link_*`` and ``pipeline_p2p_op_cpu_us``."""
    name, matmul = measure_matmul()
    bandwidth = measure_memory_bandwidth()
    optimizer = measure_optimizer()
    try:
        coll = measure_collectives(backends=("gloo", "shm"))
    except RuntimeError:  # no shared-memory collectives here (not x86, no /dev/shm): gloo only
        coll = measure_collectives()
    try:
        pipeline = measure_pipeline()
    except RuntimeError:  # not measured: the pipeline uses the collectives' link and no schedule overhead
        pipeline = {}
    best = max(m["tflops"] for m in matmul)
    label = (f"this machine's local link: {coll['world_size']} {coll['backend']} processes on loopback, "
             "measured (not NVLink, not a network)")
    device = {"name": f"calibrated {name}", "memory_gib": round(_memory_gib(), 2), "peak_tflops": best,
              "intra_node_gbps": 0.0, "inter_node_gbps": 0.0, "matmul_efficiency": 1.0,
              "hbm_gbps": round(bandwidth, 3), "optimizer_ns_per_param": round(optimizer, 3),
              "local_link_gbps": coll["bandwidth_gbps"], "local_link_latency_us": coll["latency_us"],
              "local_link_label": label, "p2p_link_gbps": pipeline.get("p2p_bandwidth_gbps", 0.0),
              "p2p_link_latency_us": pipeline.get("p2p_latency_us", 0.0),
              "pipeline_p2p_op_cpu_us": pipeline.get("pipeline_p2p_op_cpu_us", 0.0),
              "pipeline_p2p_op_cpu_shared_us": pipeline.get("pipeline_p2p_op_cpu_shared_us", 0.0),
              # decode's read rate and in-step collective cost depend on the model's matrix shapes: not measured
              # here (0: hbm_gbps and the link); measure_decode_reads at decode_matrices(model, tp) measures them
              # (bench/bench_plan_inference.py).
              "decode_read_gbps": 0.0, "decode_read_host_gbps": 0.0, "decode_collective_us": 0.0}
    return Calibration(backend=name, matmul=matmul, matmul_tflops=best, collective=coll, device=device,
                       pipeline=pipeline)
