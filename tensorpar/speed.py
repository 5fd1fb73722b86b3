"""Whether tensor parallelism can pay off for decode on this communication path (``tensorpar generate``).

:func:`tp_speed_warning` is the rule (decode reads every weight once per token; splitting over ``tp`` ranks saves at
most ``1 - 1/tp`` of that time and costs one latency per collective); :func:`measure_speed` measures this run's
latency and bandwidth once, after the first decode step, and applies it.
"""
from __future__ import annotations

import time

import torch

from tensorpar import comm
from tensorpar.comm import Group


def tp_speed_warning(*, tp_size: int, collectives_per_token: int, latency_s: float, weight_bytes: float,
                     bandwidth_bytes_per_s: float, path: str) -> str | None:
    """A one-line warning when communication costs more per decoded token than tensor parallelism can save.

    Decode is memory-bound: one rank reads all ``weight_bytes`` per token in about
    ``weight_bytes / bandwidth`` seconds, and ``tp_size`` ranks can save at most the fraction
    ``1 - 1/tp_size`` of that (Pope et al. 2022, "Efficiently Scaling Transformer Inference", Sec. 3.1:
    small-batch decode time is the weight-loading time). Splitting costs ``collectives_per_token *
    latency_s`` (small messages: latency-bound). When the cost exceeds the best-case saving, tp is slower
    than one rank; the message gives the numbers and what to change. Returns ``None`` otherwise or at tp = 1.
    """
    if tp_size < 2:
        return None
    comm_s = collectives_per_token * latency_s
    saving_s = weight_bytes / bandwidth_bytes_per_s * (1 - 1 / tp_size)
    if comm_s <= saving_s:
        return None
    fix = ("use --fast-collectives on (shared memory, ranks on one host) or --tp 1" if path == "gloo"
           else "use --fast-collectives auto (across hosts: the hosts' leaders exchange small tensors over their own "
                "TCP connections) or --tp 1" if path == "gloo across hosts"
           else "use a smaller --tp, or --tp 1 for a model this small")
    return (f"tensorpar: warning: tp={tp_size} is likely slower than one rank here: {collectives_per_token} "
            f"collectives/token x {latency_s * 1e3:.3f} ms ({path}) = {comm_s * 1e3:.1f} ms/token of communication, "
            f"more than the {saving_s * 1e3:.1f} ms/token that splitting {weight_bytes / 1e6:.0f} MB of weights over "
            f"{tp_size} ranks can save at {bandwidth_bytes_per_s / 1e9:.0f} GB/s; {fix}")


def measure_speed(model, tp: Group, probe: torch.Tensor, per_token: int) -> str | None:
    """Measure this run's small all-reduce latency and the memory bandwidth, then :func:`tp_speed_warning`.

    Costs about 12 all-reduces of one decode step's activation (``probe``) and one 64 MB copy; the
    latency is the max over ranks (every rank waits for the slowest), so all ranks reach the same verdict.
    """
    x = torch.zeros_like(probe)
    for _ in range(2):
        comm.all_reduce(x, tp)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        comm.all_reduce(x, tp)
        times.append(time.perf_counter() - t0)
    times.sort()
    lat = comm.all_reduce(torch.tensor([times[len(times) // 2]], dtype=torch.float64, device=probe.device), tp,
                          op="max")
    buf = torch.empty(16 * 2**20, dtype=torch.float32, device=probe.device)
    dst = torch.empty_like(buf)
    dst.copy_(buf)
    t0 = time.perf_counter()
    dst.copy_(buf)
    if buf.is_cuda:
        torch.cuda.synchronize()
    bw = 2 * buf.numel() * 4 / max(time.perf_counter() - t0, 1e-9)      # read + write bytes per second
    from tensorpar.decode.packed import packed_weight_bytes      # packed weights are not parameters
    local = sum(p.numel() * p.element_size() for p in model.parameters()) + packed_weight_bytes(model)
    if model.__dict__.get("_tensorpar_int8") is not None:      # --quantize int8: the lean path reads int8 bytes
        from tensorpar.decode.int8 import int8_weight_bytes
        local = int8_weight_bytes(model)
    weight_bytes = float(comm.all_reduce(torch.tensor([float(local)], dtype=torch.float64, device=probe.device), tp))
    from tensorpar.shm.hierarchical import HierarchicalComm
    path = ("nccl" if probe.is_cuda else ("gloo" if tp.hosts is None else "gloo across hosts") if tp.fast is None
            else "TCP between hosts" if isinstance(tp.fast, HierarchicalComm) else "shared memory")
    return tp_speed_warning(tp_size=tp.size, collectives_per_token=per_token, latency_s=float(lat),
                            weight_bytes=weight_bytes, bandwidth_bytes_per_s=bw, path=path)
