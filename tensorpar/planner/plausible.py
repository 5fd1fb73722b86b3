"""The range each field of a :class:`~tensorpar.planner.cluster.DeviceSpec` plausibly takes, and the one check
of it (:func:`check_plausible`) that the planner's device flags, ``--device-file`` and the link between hosts
(``generate`` / ``serve``) all run in the launching process."""
from __future__ import annotations

import math
from types import MappingProxyType


#: The range each device field plausibly takes, ``field: (flag, low, high, unit)`` (``flag`` None where only a device
#: file gives the field), from a small CPU host to well past today's largest accelerator, with room on both sides:
#: a value outside is a unit slip or a typo (``--hbm-gbps 1e-300`` printed TTFTs of 1e300 ms), refused in one line by
#: :func:`check_plausible`, from a flag or a ``--device-file``. 0, where a field allows it, means "not measured" and
#: is not checked. The link between hosts also has a softer rule inside its range
#: (:data:`tensorpar.planner.cluster.PLAUSIBLE_INTER_NODE_GBPS`: a note).
PLAUSIBLE_DEVICE = MappingProxyType({"memory_gib": ("--memory-gb", 0.01, 1e5, "GiB"),
                                     "peak_tflops": ("--peak-tflops", 1e-4, 1e5, "TFLOP/s"),
                                     "intra_node_gbps": ("--intra-node-bw", 1e-3, 1e5, "GB/s"),
                                     "inter_node_gbps": ("--inter-node-bw", 1e-4, 1e5, "GB/s"),
                                     "hbm_gbps": ("--hbm-gbps", 1e-2, 1e5, "GB/s"),
                                     "intra_node_latency_us": ("--intra-node-latency-us", 0.0, 1e7, "microseconds"),
                                     "inter_node_latency_us": ("--inter-node-latency-us", 0.0, 1e7, "microseconds"),
                                     # the fields only a device file (``plan --calibrate --json``) gives: no flag
                                     **{f: (None, 1e-3, 1e5, "GB/s") for f in (
                                         "local_link_gbps", "tp_link_gbps", "p2p_link_gbps", "decode_read_gbps",
                                         "decode_read_host_gbps", "prefill_read_gbps")},
                                     **{f: (None, 1e-4, 1e5, "TFLOP/s") for f in (
                                         "prefill_tflops", "prefill_attention_tflops")},
                                     **{f: (None, 0.0, 1e7, "microseconds") for f in (
                                         "local_link_latency_us", "tp_link_latency_us", "p2p_link_latency_us",
                                         "layer_overhead_us", "decode_collective_us", "prefill_layer_overhead_us",
                                         "int8_reduce_cpu_us", "train_layer_overhead_us",
                                         "train_micro_batch_overhead_us", "pipeline_p2p_op_cpu_us",
                                         "pipeline_p2p_op_cpu_shared_us")},
                                     "optimizer_ns_per_param": (None, 1e-4, 1e7, "nanoseconds"),
                                     "host_cores": (None, 0.01, 1e5, "cores"),
                                     "external_threads": (None, 0.0, 1e6, "threads"),
                                     "external_groups": (None, 0.01, 1e6, "scheduling groups"),
                                     "threads_per_rank": (None, 1, 1e5, "threads"),
                                     "machine_ranks": (None, 0, 1e7, "ranks")})


def check_plausible(values: dict, where: str | None = None) -> None:
    """Raise ValueError for the first of ``values`` (a :data:`PLAUSIBLE_DEVICE` field -> the number given, or None:
    not given) outside its range, naming its flag (``where`` None) or ``where: field`` (a device file), the value and
    the range. Only finite numbers > 0 are checked: the flags' own checks refuse the others in their words, or give
    them a meaning (``--hbm-gbps 0``: not modelled; a latency of 0; a calibrated file's 0: not measured)."""
    for field, v in values.items():
        if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v)):
            continue
        flag, lo, hi, unit = PLAUSIBLE_DEVICE[field]
        if not lo <= v <= hi:
            name = f"{where}: {field}" if where is not None else flag or field
            raise ValueError(f"{name} {v:.12g}: outside the plausible {lo:g}-{hi:g} {unit}; check the value and its "
                             f"unit")
