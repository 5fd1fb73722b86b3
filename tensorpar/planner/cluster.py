"""The machine a plan runs on: device memory and speed, and the two network tiers (inside a node and
between nodes). Presets use vendor datasheet numbers; ``tensorpar plan --calibrate`` measures the
machine it runs on instead.

Units: memory in GiB (2**30 bytes, as ``nvidia-smi`` and ``torch.cuda`` report), compute in dense
16-bit TFLOP/s (1e12 FLOP/s), bandwidth in GB/s (1e9 bytes/s) *per device and per direction*, latency
in microseconds.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import MappingProxyType

from tensorpar.planner.plausible import PLAUSIBLE_DEVICE, check_plausible  # noqa: F401  (cl.check_plausible)


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator and its links, per device."""

    name: str
    memory_gib: float
    peak_tflops: float  # dense bf16/fp16 matmul peak
    intra_node_gbps: float  # NVLink-class bandwidth, per direction
    inter_node_gbps: float  # network bandwidth available to this device (its share of the node's NICs)
    intra_node_latency_us: float = 10.0
    inter_node_latency_us: float = 20.0
    # Fraction of peak that a layer's matmuls reach. With hbm_gbps set, the elementwise kernels between
    # them are costed separately (memory-bandwidth bound); without it they are folded in here.
    matmul_efficiency: float = 0.6
    hbm_gbps: float = 0.0  # device-memory bandwidth, GB/s; 0: elementwise kernels and optimizer not modelled
    # This machine's local link, as ``tensorpar plan --calibrate`` measures it (processes on one host over
    # loopback). When set, every group uses it, and the NVLink / inter-node fields may be 0 (not measured).
    local_link_gbps: float = 0.0
    local_link_latency_us: float = 0.0
    local_link_label: str = ""
    # Fixed time per layer per forward pass that no byte or FLOP count explains (Python, framework, kernel
    # launches), microseconds; used by inference planning. 0: not modelled (the presets: unmeasured).
    layer_overhead_us: float = 0.0
    # Decode (inference planning; tensorpar.planner.calibrate.measure_decode_reads): the rate, GB/s, at which one
    # rank alone reads weights through a decode step's one-row matmuls (GEMV), below the copy bandwidth on a CPU
    # (shape-dependent: measure at the model's shapes); 0: hbm_gbps. ``decode_read_host_gbps``: the host's total
    # rate when its ranks read at once (they share its memory); 0: each device reads its own memory (a GPU).
    decode_read_gbps: float = 0.0
    decode_read_host_gbps: float = 0.0
    # What one small (latency-bound) tensor-parallel collective adds to a decode step, measured inside the step
    # (its latency, the wait for the slower rank, the reads it slows), microseconds; 0: the tp link's latency
    # + bytes / bandwidth.
    decode_collective_us: float = 0.0
    # Prefill (time to first token; tensorpar.planner.calibrate.prefill): one rank alone with its threads_per_rank
    # threads, the layers' matmuls over T prompt tokens take ``weights / prefill_read_gbps + flops(T) /
    # prefill_tflops`` (fitted from two token counts at the model's shapes); the prompt's attention runs at
    # ``prefill_attention_tflops``; ``prefill_layer_overhead_us``: fixed time per layer of a prefill forward (Python,
    # framework: more calls than a decode step's). 0 (prefill_tflops): the compute-bound lower bound
    # (``matmul_efficiency x peak``, at least one read of the weights at hbm_gbps) and ``layer_overhead_us``.
    prefill_read_gbps: float = 0.0
    prefill_tflops: float = 0.0
    prefill_attention_tflops: float = 0.0
    prefill_layer_overhead_us: float = 0.0
    # CPU time of one ``--tp-comm int8`` all-reduce's own work (quantizing the partial, dequantizing and summing the
    # gathered ones) at a decode step's ``[1, h]``, microseconds (tensorpar.planner.calibrate.decode.
    # measure_int8_reduce); 0: not modelled.
    int8_reduce_cpu_us: float = 0.0
    # The same for training, measured by ``tensorpar train --plan auto``'s calibration: fixed time per layer per
    # micro-batch for its forward and backward together, and per micro-batch for the embedding, LM head and loss
    # (charged to the last stage), microseconds. 0: not modelled (the presets).
    train_layer_overhead_us: float = 0.0
    train_micro_batch_overhead_us: float = 0.0
    # Ranks that share a host's CPU cores (tensorpar.planner.sharing). 0: every device computes on its own (a
    # GPU; the presets). With host_cores > 0 the rates above are one rank's *alone* on the host (threads_per_rank
    # threads, each on a core of its own), and a rank's speed is scaled by the share of a core that each of its
    # threads gets while the other runnable threads (the node's busy ranks' threads and ``external_threads``,
    # other users' runnable threads) compete for the ``host_cores`` cores: processor sharing.
    host_cores: float = 0.0
    threads_per_rank: int = 1
    external_threads: float = 0.0
    # Scheduling groups (Linux autogroup sessions or cgroups) that hold the external threads; 0: the kernel shares
    # the cores thread by thread. With groups, the ranks (one launch, one group) get an equal share of the cores
    # with each other group (tensorpar.planner.sharing.thread_share).
    external_groups: float = 0.0
    # Ranks of the run that share the ``host_cores`` where several nodes of the cluster are one machine (hosts that
    # are network namespaces or containers of it: tensorpar.launch.machine_ranks); 0: a node's own ranks
    # (``devices_per_node``). The links between those nodes stay the inter-node link.
    machine_ranks: int = 0
    # Measured seconds of the optimizer step per parameter updated (torch's AdamW on this device), nanoseconds;
    # 0: the memory-bound traffic model of cost.optimizer_seconds (the presets).
    optimizer_ns_per_param: float = 0.0
    # The tensor-parallel group's own measured link, where it uses another backend than the other groups (e.g.
    # shared-memory collectives on one host while pipeline and data-parallel groups use gloo); 0: the local
    # link (or the NVLink / inter-node fields) as for every group.
    tp_link_gbps: float = 0.0
    tp_link_latency_us: float = 0.0
    tp_link_label: str = ""
    # Point-to-point (send/recv) link of the pipeline's activations and gradients where measured (``--calibrate``:
    # gloo ping-pong between 2 local ranks, tensorpar.planner.calibrate.measure_pipeline); 0: the group's link as
    # for collectives (the presets).
    p2p_link_gbps: float = 0.0
    p2p_link_latency_us: float = 0.0
    # CPU time of one send or receive of the pipeline schedule (torch.distributed.pipelining over gloo: the
    # schedule's Python, gloo's threads, the kernel's loopback), microseconds, measured by ``--calibrate`` on a
    # 2-stage pipeline of trivial stages (tensorpar.planner.calibrate.measure_pipeline); 0: not modelled (presets).
    pipeline_p2p_op_cpu_us: float = 0.0
    # The same measured with twice as many ranks as cores (a rank whose peer is not running waits longer in gloo and
    # spends more CPU per operation); used when a host's ranks' threads outnumber host_cores. 0: the value above.
    pipeline_p2p_op_cpu_shared_us: float = 0.0

    def __post_init__(self) -> None:
        links = ("intra_node_gbps", "inter_node_gbps")
        for knob in ("memory_gib", "peak_tflops", *links):
            if knob in links and self.local_link_gbps > 0 and getattr(self, knob) == 0:
                continue  # not measured; the local link is used instead
            if not 0 < getattr(self, knob) < float("inf"):
                raise ValueError(f"device {knob} ({getattr(self, knob)!r}) must be a finite number > 0")
        for knob in ("layer_overhead_us", "decode_read_gbps", "decode_read_host_gbps", "decode_collective_us",
                     "prefill_read_gbps", "prefill_tflops", "prefill_attention_tflops", "prefill_layer_overhead_us",
                     "int8_reduce_cpu_us",
                     "train_layer_overhead_us", "train_micro_batch_overhead_us", "host_cores",
                     "external_threads", "external_groups", "optimizer_ns_per_param", "tp_link_gbps",
                     "tp_link_latency_us", "p2p_link_gbps", "p2p_link_latency_us",
                     "pipeline_p2p_op_cpu_us", "pipeline_p2p_op_cpu_shared_us"):
            if not 0 <= getattr(self, knob) < float("inf"):
                raise ValueError(f"device {knob} ({getattr(self, knob)!r}) must be a finite number >= 0")
        if not (isinstance(self.machine_ranks, int) and self.machine_ranks >= 0):
            raise ValueError(f"device machine_ranks ({self.machine_ranks!r}) must be an integer >= 0")
        if not (isinstance(self.threads_per_rank, int) and self.threads_per_rank >= 1):
            raise ValueError(f"device threads_per_rank ({self.threads_per_rank!r}) must be an integer >= 1")
        if self.local_link_gbps < 0 or self.local_link_latency_us < 0:
            raise ValueError(f"device local_link_gbps ({self.local_link_gbps!r}) and local_link_latency_us "
                             f"({self.local_link_latency_us!r}) must be >= 0")
        if not 0 < self.matmul_efficiency <= 1:
            raise ValueError(f"device matmul_efficiency ({self.matmul_efficiency!r}) must be in (0, 1]")
        if not 0 <= self.hbm_gbps < float("inf"):
            raise ValueError(f"device hbm_gbps ({self.hbm_gbps!r}) must be a finite number >= 0 (0: not modelled)")
        for knob in ("intra_node_latency_us", "inter_node_latency_us"):
            if not 0 <= getattr(self, knob) < float("inf"):
                raise ValueError(f"device {knob} ({getattr(self, knob)!r}) must be a finite number >= 0")


# Datasheet numbers, except matmul_efficiency. Latencies are order-of-magnitude NCCL small-message figures.
# matmul_efficiency (A100): fitted, together with cost.ELEMENTWISE_TRAFFIC, to the one-layer timings of
# Korthikanti et al. 2022, Table 4 (22B model, tp 8, five configurations, forward and backward); every
# other published run of docs/planner.md "Accuracy" is then predicted with these values, not fitted.
# H100/H200 reuse the A100 value (no published per-layer timings to fit them to): treat their
# predictions as unvalidated.
A100_MATMUL_EFFICIENCY = 0.665
DEVICES = MappingProxyType({
    # A100 SXM4 80GB: 312 TFLOP/s bf16 dense; HBM2e 2039 GB/s; NVLink3 600 GB/s total = 300 GB/s per
    # direction; DGX A100: eight 200 Gb/s HDR InfiniBand NICs, one per GPU = 25 GB/s.
    "a100-80gb": DeviceSpec("a100-80gb", 80.0, 312.0, 300.0, 25.0,
                            matmul_efficiency=A100_MATMUL_EFFICIENCY, hbm_gbps=2039.0),
    # H100 SXM5 80GB: 989 TFLOP/s bf16 dense; HBM3 3350 GB/s; NVLink4 900 GB/s total = 450 GB/s per
    # direction; DGX H100: eight 400 Gb/s NDR NICs = 50 GB/s per GPU. 81559 MiB usable = 79.6 GiB.
    "h100-80gb": DeviceSpec("h100-80gb", 79.6, 989.0, 450.0, 50.0,
                            matmul_efficiency=A100_MATMUL_EFFICIENCY, hbm_gbps=3350.0),
    # H200 SXM 141GB: same compute and links as H100; HBM3e 4800 GB/s; 143771 MiB usable = 140.4 GiB.
    "h200": DeviceSpec("h200", 140.4, 989.0, 450.0, 50.0,
                       matmul_efficiency=A100_MATMUL_EFFICIENCY, hbm_gbps=4800.0),
    # For mixed groups (tensorpar plan --devices); same efficiency assumption, unvalidated.
    # V100 SXM2 32GB: 125 TFLOP/s fp16 tensor cores; HBM2 900 GB/s; NVLink2 300 GB/s total = 150 per
    # direction; DGX-1: 100 Gb/s EDR InfiniBand per two GPUs ~ 6.25 GB/s per GPU.
    "v100-32gb": DeviceSpec("v100-32gb", 32.0, 125.0, 150.0, 6.25,
                            matmul_efficiency=A100_MATMUL_EFFICIENCY, hbm_gbps=900.0),
    # L4 24GB: 121 TFLOP/s fp16 dense (242 with sparsity); GDDR6 300 GB/s; PCIe Gen4 x16 ~ 32 GB/s per
    # direction, no NVLink; 100 Gb/s Ethernet assumed = 12.5 GB/s.
    "l4": DeviceSpec("l4", 22.5, 121.0, 32.0, 12.5, matmul_efficiency=A100_MATMUL_EFFICIENCY, hbm_gbps=300.0),
})


@dataclass(frozen=True)
class ClusterSpec:
    """``num_devices`` identical devices, ``devices_per_node`` to a node."""

    device: DeviceSpec
    num_devices: int
    devices_per_node: int

    def __post_init__(self) -> None:
        if self.num_devices < 1:
            raise ValueError(f"--gpus ({self.num_devices}) must be >= 1")
        if self.devices_per_node < 1:
            raise ValueError(f"--gpus-per-node ({self.devices_per_node}) must be >= 1")
        if self.num_devices > self.devices_per_node and self.num_devices % self.devices_per_node:
            raise ValueError(
                f"--gpus ({self.num_devices}) is not a whole number of nodes of --gpus-per-node "
                f"({self.devices_per_node}); use a multiple of {self.devices_per_node}"
            )

    def link(self, span: int, group: str = "", per_node: int = 1) -> tuple[float, float]:
        """(bytes/s, seconds latency) of a collective over ranks ``span`` consecutive ranks apart at most.

        A group whose ranks fit in one node uses the intra-node links; a ring that leaves the node is
        limited by the inter-node network: ``per_node`` of the group's ranks share a node, each with its own
        NIC, and NCCL splits a collective over that many channels (rings), one NIC each, joined inside the
        node by the intra-node links; so the group gets ``per_node`` NICs' bandwidth, at most the intra-node
        link's. A data-parallel group at tp x pp = 1 has all 8 ranks of a DGX node (8 NICs, 200 GB/s); at
        tp x pp >= 8 one rank per node (one NIC, 25 GB/s). A device with a measured local link
        (``--calibrate``) uses that link for every group inside a node, except the tensor-parallel group
        (``group="tp"``) when the device has a measured ``tp_link_gbps`` of its own (another backend for that
        group); a group that leaves the node uses the inter-node link where the device gives one
        (``inter_node_gbps`` > 0, e.g. ``--inter-node-bw`` with ``--device-file``: the link between hosts), else
        the local link too (a calibration knows only its own host).
        """
        d = self.device
        inside = span <= self.devices_per_node
        if group == "tp" and d.tp_link_gbps > 0 and inside:
            return d.tp_link_gbps * 1e9, d.tp_link_latency_us * 1e-6
        if d.local_link_gbps > 0 and (inside or not d.inter_node_gbps > 0):
            return d.local_link_gbps * 1e9, d.local_link_latency_us * 1e-6  # a calibrated host: its measured link
        if inside:
            return d.intra_node_gbps * 1e9, d.intra_node_latency_us * 1e-6
        cap = d.intra_node_gbps or d.local_link_gbps or float("inf")  # a calibrated host's link inside the node
        nics = max(d.inter_node_gbps, min(d.inter_node_gbps * max(1, per_node), cap))  # at least one NIC's
        return nics * 1e9, d.inter_node_latency_us * 1e-6

    def crosses_nodes(self, span: int) -> bool:
        """Whether a group of ranks ``span`` consecutive ranks apart at most leaves a node (uses the inter-node
        link: :meth:`link`)."""
        return span > self.devices_per_node

    def p2p_link(self, span: int) -> tuple[float, float]:
        """(bytes/s, seconds latency) of a pipeline send between ranks ``span`` apart: the device's measured
        point-to-point link where it has one (inside a node, or with no inter-node link given), else :meth:`link`."""
        d = self.device
        bandwidth, latency = self.link(span)
        if self.crosses_nodes(span) and d.inter_node_gbps > 0:  # between hosts: the inter-node link
            return bandwidth, latency
        if d.p2p_link_latency_us > 0 or d.p2p_link_gbps > 0:  # measured; a bandwidth it could not resolve: the link's
            return (d.p2p_link_gbps * 1e9 if d.p2p_link_gbps > 0 else bandwidth), d.p2p_link_latency_us * 1e-6
        return bandwidth, latency

    def to_dict(self) -> dict:
        return {"device": asdict(self.device), "num_devices": self.num_devices,
                "devices_per_node": self.devices_per_node}


def device_preset(name: str) -> DeviceSpec:
    if name not in DEVICES:
        raise ValueError(f"--device {name!r} is not a preset; use one of {', '.join(DEVICES)}, or --device-file")
    return DEVICES[name]


def device_from_file(path: str | Path) -> DeviceSpec:
    """A device described by a JSON object with the fields of :class:`DeviceSpec` (for example the
    ``device`` object that ``tensorpar plan --calibrate --json`` prints)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--device-file {path}: cannot read a JSON device spec ({err})") from None
    data = data.get("device", data) if isinstance(data, dict) else data
    if not isinstance(data, dict):
        raise ValueError(f"--device-file {path}: a JSON {type(data).__name__}, not an object; expected the fields of "
                         f"DeviceSpec (e.g. the 'device' of tensorpar plan --calibrate --json)")
    return device_from_dict(data, f"--device-file {path}")


def device_from_dict(data: dict, where: str) -> DeviceSpec:
    """A :class:`DeviceSpec` from a JSON object's fields, with the one set of checks of a device given as data
    (``--device-file``, the objects of ``--devices``): numbers only (JSON's ``true`` is not 1, ``"8"`` not 8),
    :class:`DeviceSpec`'s own rules, then :data:`PLAUSIBLE_DEVICE`'s ranges. Raises ValueError naming ``where`` and
    the field."""
    for field, v in data.items():   # numbers only: JSON's true is not 1, "8" not 8, and 1e400 written as an integer
        if field in PLAUSIBLE_DEVICE and (isinstance(v, bool) or not isinstance(v, (int, float))
                                          or isinstance(v, int) and not -1e308 < v < 1e308):
            shown = json.dumps(v)
            raise ValueError(f"{where}: {field} {shown[:40] + ('...' if len(shown) > 40 else '')} is not a number; "
                             f"give a number in {PLAUSIBLE_DEVICE[field][3]}")
    try:
        device = DeviceSpec(**data)
    except TypeError as err:
        raise ValueError(f"{where}: {err}; expected the fields of DeviceSpec (numbers)") from None
    except ValueError as err:                   # DeviceSpec's own checks (nan, negative): name where it came from
        raise ValueError(f"{where}: {err}") from None
    check_plausible({f: getattr(device, f) for f in PLAUSIBLE_DEVICE}, where=where)
    return device


def override(device: DeviceSpec, **changes) -> DeviceSpec:
    """The device with the given fields replaced (``None`` values keep the preset)."""
    return replace(device, **{k: v for k, v in changes.items() if v is not None})


#: GB/s per rank that a link between hosts plausibly has: 0.01 (80 Mbit/s, below any data-centre or office
#: Ethernet) to 1000 (8 Tbit/s, above NVLink 5's 900 GB/s per direction, the fastest link that spans hosts today,
#: an NVL72 rack). A value outside is used as given, with one note: it is most often a unit slip (Gbit/s for GB/s)
PLAUSIBLE_INTER_NODE_GBPS = (0.01, 1000.0)


def inter_node_link(args, device: DeviceSpec | None = None, *, crosses_hosts: bool = True) -> dict:
    """The :class:`DeviceSpec` fields of the link between hosts that ``--inter-node-bw`` (GB/s per rank) and
    ``--inter-node-latency-us`` give (``{}``: none given): the one rule of ``tensorpar plan``, ``train --plan`` and
    ``generate --plan auto`` (launching process). ``device``: the device they override (a preset has a NIC of its
    own; ``None``: a calibrated host, which has none). ``crosses_hosts``: whether the ranks span hosts
    (:func:`spans_hosts`); where they do not, the flags change nothing and :func:`note_unused_link` says so in the
    one note.

    A bandwidth outside :data:`PLAUSIBLE_INTER_NODE_GBPS`, or more than 10x the link inside the node (``device``'s
    NVLink or measured local link), is used with one note on stderr (rank 0): check its unit; not where
    ``crosses_hosts`` is false (the value is unused there: one note, :func:`note_unused_link`'s, not two).

    Raises ValueError naming the flag: a bandwidth that is not a finite number > 0, a latency that is not a finite
    number >= 0, a latency without a bandwidth (neither ``--inter-node-bw`` nor the device's own link between nodes:
    the latency alone would price nothing).
    """
    import math
    import os

    bw, lat = getattr(args, "inter_node_bw", None), getattr(args, "inter_node_latency_us", None)
    if lat is not None and not (math.isfinite(lat) and lat >= 0):
        raise ValueError(f"--inter-node-latency-us {lat:g}: must be a finite number of microseconds >= 0")
    check_plausible({"inter_node_gbps": bw, "inter_node_latency_us": lat})
    if bw is None:
        if lat is not None and not (device is not None and device.inter_node_gbps > 0):
            what = f"device {device.name}" if device is not None else "this calibrated host"
            raise ValueError(f"--inter-node-latency-us {lat:g} needs --inter-node-bw (the link's bandwidth, GB/s per "
                             f"rank; 1 Gbit/s = 0.125): {what} has no link between hosts of its own")
        return {} if lat is None else {"inter_node_latency_us": lat}
    if not (math.isfinite(bw) and bw > 0):
        raise ValueError(f"--inter-node-bw {bw:g}: must be a finite number of GB/s > 0 (1 Gbit/s = 0.125)")
    low, high = PLAUSIBLE_INTER_NODE_GBPS
    inside = (device.intra_node_gbps or device.local_link_gbps) if device is not None else 0.0
    note = None
    if not low <= bw <= high:
        note = (f"outside {low:g}-{high:g} GB/s, the links between hosts that exist (80 Mbit/s Ethernet to an NVLink "
                f"rack)")
    elif inside > 0 and bw > 10 * inside:
        note = f"more than 10x the link inside a node ({inside:g} GB/s)"
    if note and crosses_hosts and os.environ.get("RANK", "0") == "0":
        from tensorpar.usage import note as say
        say(args, f"tensorpar: note: --inter-node-bw {bw:g} GB/s is {note}; used as given: is the unit right? (GB/s "
                  f"per rank; 1 Gbit/s = 0.125)")
    return {"inter_node_gbps": bw, **({} if lat is None else {"inter_node_latency_us": lat})}


def spans_hosts(ranks: int, per_host: int) -> bool:
    """Whether ``ranks`` ranks, ``per_host`` to a host, need more than one host (a group may cross the link)."""
    return ranks > per_host


def note_unused_link(args, ranks: int, per_host: int, what: str) -> bool:
    """One note on stderr (rank 0) when ``--inter-node-bw`` or ``--inter-node-latency-us`` is given but all
    ``ranks`` are on one host (not :func:`spans_hosts`): no group crosses the link between hosts, so the flag
    changes nothing; the note names the flags and their values (and is the only one: :func:`inter_node_link` then
    leaves out its unit note). Allowed, as ``--tp-comm int8`` on one host is
    (:func:`tensorpar.cli.check_launch_arguments`): the one rule of ``tensorpar plan`` (a cluster of one node),
    ``train --plan`` and ``generate``/``serve --plan auto`` (no torchrun across hosts). ``what``: where the ranks
    are, in words. Returns whether it noted."""
    import os

    given = [f"{f} {getattr(args, k):g}" for f, k in (("--inter-node-bw", "inter_node_bw"),
                                                     ("--inter-node-latency-us", "inter_node_latency_us"))
             if getattr(args, k, None) is not None]
    if not given or spans_hosts(ranks, per_host):
        return False
    if os.environ.get("RANK", "0") == "0":
        from tensorpar.usage import note
        note(args, f"tensorpar: note: {' and '.join(given)}: all {ranks} {what}: no group crosses the link between "
                   f"hosts, so it is not needed here")
    return True


def launch_hosts_words(local_launch: bool) -> str:
    """How :func:`note_unused_link` says where a launch's ranks are: started here, or by torchrun on one node."""
    return "ranks are on this host (" + ("no torchrun across hosts)" if local_launch else "torchrun with one node)")
