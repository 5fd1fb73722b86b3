"""Step time and model FLOPs utilisation of a layout.

Model of one optimizer step (each assumption is a choice; docs/planner.md lists them with their sources):

* One layer, one micro-batch, on the busiest tensor-parallel rank (:func:`layer_times`):
  - matmuls: each of the layer's matmul shapes (flops.py) at ``matmul_efficiency x peak`` of the device, plus
    its output written once at ``hbm_gbps``, not overlapped (:func:`gemm_seconds`);
  - elementwise kernels (norms, dropout, GeLU, softmax, residual adds): memory-bandwidth bound. Their
    forward traffic is ``ELEMENTWISE_TRAFFIC`` bytes per byte the layer stores for backward (the
    Korthikanti et al. 2022 count of memory.py), at the device's ``hbm_gbps``; backward moves
    ``BACKWARD_TRAFFIC`` times that. Only when the device gives ``hbm_gbps``; otherwise folded into
    ``matmul_efficiency``;
  - TP collectives: forward ones on the critical path; the backward ones of Megatron kernels are
    overlapped with the weight-gradient matmuls (Korthikanti et al. 2022, section 6.2), tensorpar's are not;
    ``tp_overlap`` hides a further fraction of all of them;
  - backward = 2 x the forward matmuls and ``BACKWARD_TRAFFIC`` x its elementwise traffic; full
    recomputation re-runs the forward (with its collectives), selective recomputation the score matmuls
    and the softmax/dropout traffic on the score matrix.
* A device calibrated by ``tensorpar train --plan auto`` adds its measured fixed time per layer and micro-batch
  (``train_layer_overhead_us``: Python and framework work that no FLOP or byte count explains, which dominates
  small models on a CPU) and per micro-batch on the last stage (``train_micro_batch_overhead_us``); presets: 0.
* A calibrated device also gives the CPU of one pipeline send or receive (``pipeline_p2p_op_cpu_us``, the
  schedule's Python included; ``pipeline_p2p_op_cpu_shared_us`` when the host's ranks outnumber its cores; per
  micro-batch ``4 v`` of them on a stage, 2 fewer on the first and on the last stage, half in the forward), work
  of the stage, and the measured send/recv link of the pipeline's activations
  (``p2p_link_*``, the delay between stages); presets: 0 and the group's link.
* A device whose ranks share a host's CPU cores (``host_cores`` > 0: a CPU calibrated by ``tensorpar train --plan
  auto``) runs the schedule through :mod:`tensorpar.planner.sharing` (processor sharing of the cores among the
  runnable ranks' threads and other users'; a waiting stage frees its core) instead of the closed form below, and
  a device with a measured ``optimizer_ns_per_param`` costs the optimizer step with it. The presets have neither.
* A micro-batch on pipeline stage i takes ``T_i`` = its layers + the embedding (first stage) or output
  layer and loss (last stage) + the pipeline sends (not hidden).
* The pipeline runs at the pace of its slowest stage, ``T = max_i T_i``. 1F1B over m micro-batches takes
  ``(m + (p-1)/v) T``: the bubble is ``(p-1)/(v m)`` of the ideal time (Narayanan et al. 2021, section 2.2).
* Once per step, after the last backward: the per-step TP collectives, the data-parallel gradient
  reduction (hidden except a fraction ``1 - dp_overlap``; Megatron does not overlap it by default,
  Korthikanti et al. 2022 section 6.3) and the optimizer update, memory-bandwidth bound
  (``OPTIMIZER_TRAFFIC`` bytes per parameter the rank updates). Stages do this in parallel, so the
  slowest stage counts.

* Context parallelism (cp > 1): a rank runs ``s / cp`` positions through every matmul, its queries against the
  whole sequence's keys in attention (fused: no score matrix written), and the attention's traffic of
  :func:`tensorpar.planner.traffic.cp_collectives`: the ring's hops are in flight while a block is computed, so
  only what exceeds the attention's time (forward, backward) is exposed; all2all's all-to-alls are not hidden.
  Once per step the cp ranks' gradients are all-reduced. Reported as ``cp_comm``.

``mfu = model FLOPs per step / (step time x devices x peak)``, with model FLOPs excluding recomputation.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from tensorpar.planner.cluster import ClusterSpec
from tensorpar.planner.flops import (backward_gemms, layer_forward_flops, layer_gemms, model_flops,
                                     recompute_forward_flops)
from tensorpar.planner.layout import Assumptions, Layout, Workload
from tensorpar.planner.memory import cp_shape, layer_activation_terms, stage_expert_params, stage_params
from tensorpar.planner.model_spec import ModelSpec
from tensorpar.planner.partition import busiest_heads, max_ffn_columns, max_vocab_rows, stage_layers
from tensorpar.planner.traffic import (cp_exposed_seconds, cp_step_collectives, dp_collectives, ep_collectives,
                                      pipeline_sends, tied_embedding_collectives, tp_collectives, tp_step_collectives)

# Bytes the elementwise kernels of a layer's forward pass read and write, per byte the layer stores for
# backward. Every stored tensor is written once by the kernel that makes it and read by the next one;
# a LayerNorm or softmax reads its input twice (statistics, then normalisation), and the fused
# bias-dropout-add reads the residual. Fitted once, with the A100's matmul_efficiency (cluster.py), to
# Korthikanti et al. 2022, Table 4 (the 22B layer's forward and backward times in five configurations;
# sequence parallelism and selective recomputation change only this traffic and the score matmuls);
# see docs/planner.md, "Accuracy".
ELEMENTWISE_TRAFFIC = 2.3
# Backward traffic over forward traffic of an elementwise op: it reads its saved input and the output
# gradient and writes the input gradient (3 tensors against the forward's 2).
BACKWARD_TRAFFIC = 1.5
# Bytes an Adam step moves per parameter it updates: read and write the fp32 master weight, momentum and
# variance (24), read the gradient (``grad_bytes``), write the 16-bit weight (``param_bytes``), and read
# the gradient once more for the gradient norm (``grad_bytes``).
OPTIMIZER_STATE_TRAFFIC = 24


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step, split into the parts that add up to it."""

    compute: float
    tp_comm: float
    pp_comm: float
    bubble: float
    dp_comm: float
    optimizer: float = 0.0
    ep_comm: float = 0.0
    cp_comm: float = 0.0

    @property
    def total(self) -> float:
        return (self.compute + self.tp_comm + self.ep_comm + self.cp_comm + self.pp_comm + self.bubble + self.dp_comm
                + self.optimizer)

    def as_dict(self) -> dict:
        out = {"compute": self.compute, "tp_comm": self.tp_comm, "ep_comm": self.ep_comm, "pp_comm": self.pp_comm,
               "bubble": self.bubble, "dp_comm": self.dp_comm, "optimizer": self.optimizer}
        if self.cp_comm:
            out["cp_comm"] = self.cp_comm
        return out


@dataclass(frozen=True)
class Cost:
    step: StepTime
    model_flops: float  # whole cluster, per step, without recomputation
    num_devices: int
    peak_tflops: float
    bottleneck_stage: int

    @property
    def tflops_per_device(self) -> float:
        return self.model_flops / self.step.total / self.num_devices / 1e12

    @property
    def mfu(self) -> float:
        return self.tflops_per_device / self.peak_tflops


@dataclass(frozen=True)
class LayerTime:
    """Seconds of one layer on one micro-batch (busiest TP rank): ``compute`` (matmuls and elementwise
    kernels) and exposed ``tp_comm`` of the forward pass, of the backward pass, and of recomputation."""

    forward_compute: float
    forward_tp: float
    backward_compute: float
    backward_tp: float
    recompute_compute: float
    recompute_tp: float
    forward_ep: float = 0.0  # expert-parallel all-to-alls (forward; backward with recomputation)
    backward_ep: float = 0.0
    forward_cp: float = 0.0  # context-parallel attention traffic, exposed (backward: with recomputation's)
    backward_cp: float = 0.0

    @property
    def forward(self) -> float:
        return self.forward_compute + self.forward_tp + self.forward_ep + self.forward_cp

    @property
    def backward(self) -> float:
        """Backward including recomputation (as Korthikanti et al. 2022, Table 4 reports it)."""
        return (self.backward_compute + self.backward_tp + self.recompute_compute + self.recompute_tp
                + self.backward_ep + self.backward_cp)

    @property
    def cp(self) -> float:
        return self.forward_cp + self.backward_cp

    @property
    def ep(self) -> float:
        return self.forward_ep + self.backward_ep

    @property
    def total(self) -> float:
        return self.forward + self.backward

    @property
    def compute(self) -> float:
        return self.forward_compute + self.backward_compute + self.recompute_compute

    @property
    def tp(self) -> float:
        return self.forward_tp + self.backward_tp + self.recompute_tp


def _collective_seconds(collectives, cluster: ClusterSpec, span: int, group: str = "", per_node: int = 1) -> float:
    bandwidth, latency = cluster.link(span, group, per_node)
    return sum(c.seconds(bandwidth, latency) for c in collectives if not c.hidden)


def _elementwise_seconds(nbytes: float, cluster: ClusterSpec) -> float:
    hbm = cluster.device.hbm_gbps
    return ELEMENTWISE_TRAFFIC * nbytes / (hbm * 1e9) if hbm else 0.0


def gemm_seconds(gemms, cluster: ClusterSpec, assume: Assumptions, write_output: bool = True) -> float:
    """Time of matmuls ``(m, k, n, count)`` (:func:`tensorpar.planner.flops.layer_gemms`): ``2 m k n`` FLOPs at
    ``matmul_efficiency x peak``, plus the ``m x n`` output written once to device memory at ``hbm_gbps``
    (``assume.activation_bytes`` per element), which is not overlapped with the products.

    Why the write is not hidden: a matmul kernel computes each output tile in a main loop over ``k`` and then
    writes the tile out (the epilogue); that SM computes nothing while it writes. The main loop does ``2 k`` FLOPs
    per output element at the SM's share of the peak, the epilogue moves ``activation_bytes`` per element at its
    share of the memory bandwidth, so a matmul runs ``k / (k + k0)`` of its main-loop rate, ``k0 = matmul_efficiency
    x peak / hbm_gbps x activation_bytes / 2`` (102 on an A100). That is why larger layers reach a
    larger share of peak: a wider model has a longer ``k`` per output element (``h``, ``4h/t``, the tokens of a
    micro-batch); a tensor-parallel split that leaves ``k = h/t = 768`` (the attention output projection of the
    22B model at tp 8) runs 12 % below the main-loop rate, a 1T model's ``3200`` 3 %. ``write_output=False``: a fused
    kernel that keeps its products on chip (FlashAttention's scores). No write term without ``hbm_gbps``.
    """
    device = cluster.device
    rate = device.peak_tflops * 1e12 * assume.matmul_efficiency(device)
    hbm = device.hbm_gbps * 1e9
    total = 0.0
    for m, k, n, count in gemms:
        write = assume.activation_bytes * m * n / hbm if write_output and hbm else 0.0
        total += count * (2 * m * k * n / rate + write)
    return total


def layer_times(model: ModelSpec, layout: Layout, cluster: ClusterSpec, work: Workload,
                assume: Assumptions) -> LayerTime:
    """Forward, backward and recomputation time of one layer on one micro-batch (see module docstring)."""
    t = layout.tp
    seq, assume = cp_shape(layout, work, assume)   # positions per rank (s / cp); fused attention at cp > 1
    local = Workload(work.global_batch, seq)
    tokens = layout.micro_batch * seq
    heads = busiest_heads(model.num_heads, model.num_kv_heads, t)
    ffn = max_ffn_columns(model.ffn_hidden_size, t)
    flops = layer_forward_flops(model, heads, ffn, tokens, work.seq_len)   # local queries against every key
    gemms = layer_gemms(model, heads, ffn, tokens, work.seq_len, cp=layout.cp)
    rate = cluster.device.peak_tflops * 1e12 * assume.matmul_efficiency(cluster.device)
    shape = dict(micro_batch=layout.micro_batch, seq_len=seq, tp=t,
                 sequence_parallel=layout.sequence_parallel, assume=assume)
    stored = sum(layer_activation_terms(model, heads, recompute="none", **shape).values())
    kept = sum(layer_activation_terms(model, heads, recompute="selective", **shape).values())
    eager = assume.attention == "eager"  # a fused (sdpa) kernel never writes the scores out
    forward_attention = gemm_seconds(gemms["attention"], cluster, assume, eager)
    forward_matmul = gemm_seconds(gemms["linear"], cluster, assume) + forward_attention
    backward_matmul = (gemm_seconds(backward_gemms(gemms["linear"]), cluster, assume)
                       + gemm_seconds(backward_gemms(gemms["attention"]), cluster, assume, eager))
    forward_ew = _elementwise_seconds(stored, cluster)
    sdpa_extra = recompute_forward_flops(flops, "none", assume.attention) / rate  # fused-kernel backward

    collectives = tp_collectives(model, replace(layout, recompute="none"), local, assume, layers=1,
                                 first_stage=False, last_stage=False)
    keep = 1 - assume.tp_overlap
    fwd_tp = keep * _collective_seconds([c for c in collectives if c.site == "layer forward"], cluster, t, "tp")
    bwd = [c for c in collectives if c.site == "layer backward"]
    bwd_tp = 0.0 if model.kernels == "megatron" else keep * _collective_seconds(bwd, cluster, t, "tp")

    ep_calls = ep_collectives(model, layout, local, assume, layers=1)
    span = t * layout.pp * layout.ep  # an expert-parallel group: ep dp replicas of the same (pp, tp) rank
    fwd_ep = _collective_seconds([c for c in ep_calls if "backward" not in c.site], cluster, span)
    bwd_ep = _collective_seconds([c for c in ep_calls if "backward" in c.site], cluster, span)
    fwd_cp, bwd_cp = cp_exposed_seconds(model, layout, cluster, work, assume, forward_attention,
                                        gemm_seconds(backward_gemms(gemms["attention"]), cluster, assume, eager)
                                        + sdpa_extra)
    rec_compute = rec_tp = 0.0
    if layout.recompute == "full":
        rec_compute, rec_tp = forward_matmul + forward_ew, fwd_tp + fwd_cp
    elif layout.recompute == "selective":
        rec_compute = forward_attention + _elementwise_seconds(stored - kept, cluster)
    # fixed per-layer time (Python, framework, kernel launches) where calibrated: a third forward, two backward
    overhead = cluster.device.train_layer_overhead_us * 1e-6
    if layout.recompute == "full":
        rec_compute += overhead / 3
    return LayerTime(forward_compute=forward_matmul + forward_ew + overhead / 3, forward_tp=fwd_tp,
                     backward_compute=backward_matmul + sdpa_extra + BACKWARD_TRAFFIC * forward_ew
                     + 2 * overhead / 3,
                     backward_tp=bwd_tp, recompute_compute=rec_compute, recompute_tp=rec_tp,
                     forward_ep=fwd_ep / (2 if layout.recompute == "full" else 1),
                     backward_ep=bwd_ep + (fwd_ep / 2 if layout.recompute == "full" else 0.0),
                     forward_cp=fwd_cp, backward_cp=bwd_cp)


def optimizer_seconds(params: float, layout: Layout, cluster: ClusterSpec, assume: Assumptions,
                      expert_params: float = 0.0) -> float:
    """Adam update of the ``params`` a rank holds (with the distributed optimizer 1/dp of the dense ones and
    ``ep/dp`` of the ``expert_params`` among them): the device's measured ``optimizer_ns_per_param`` per
    parameter where it has one (a calibrated device), else ``OPTIMIZER_STATE_TRAFFIC + 2 grad_bytes +
    param_bytes`` bytes per parameter at the device-memory bandwidth; 0 when the device gives neither."""
    hbm = cluster.device.hbm_gbps
    measured = cluster.device.optimizer_ns_per_param
    if not hbm and not measured:
        return 0.0
    dense, expert = (layout.dp, layout.dp // layout.ep) if layout.distributed_optimizer else (1, 1)
    updated = (params - expert_params) / dense + expert_params / expert
    if measured:  # a calibrated device: torch's AdamW timed on it (tensorpar.planner.calibrate.measure_optimizer)
        return updated * measured * 1e-9
    per_param = OPTIMIZER_STATE_TRAFFIC + 2 * assume.grad_bytes + assume.param_bytes
    return updated * per_param / (hbm * 1e9)


def step_cost(model: ModelSpec, layout: Layout, cluster: ClusterSpec, work: Workload, assume: Assumptions) -> Cost:
    """Step time of ``layout``. Ranks form tensorpar's grid ``arange(N).view(dp, pp, tp)``: a TP group is
    ``tp`` consecutive ranks, a pipeline spans ``tp * pp`` and a DP group all ``N`` ranks; a group whose
    span fits in a node uses the intra-node links (see :meth:`ClusterSpec.link`)."""
    t, p, d, v = layout.tp, layout.pp, layout.dp, layout.virtual_stages
    m = layout.num_micro_batches(work.global_batch)
    local = Workload(work.global_batch, work.seq_len // layout.cp)   # a rank's positions at cp > 1
    tokens = layout.micro_batch * local.seq_len
    layer = layer_times(model, layout, cluster, work, assume)
    logits = [(tokens, model.hidden_size, max_vocab_rows(model.vocab_size, t), 1)]
    logits_seconds = gemm_seconds(logits + backward_gemms(logits), cluster, assume)  # forward + backward
    logits_seconds += cluster.device.train_micro_batch_overhead_us * 1e-6  # embedding, head, loss: fixed part
    bandwidth, latency = cluster.p2p_link(t * p)
    p2p = sum(c.seconds(bandwidth, latency) for c in pipeline_sends(model, layout, local, assume))
    # CPU of the schedule's sends and receives (a calibrated device; presets: 0): per micro-batch, each chunk
    # receives its activation and sends its input's gradient (not the model's first chunk), and sends its output
    # and receives the output's gradient (not the last chunk): 4 v operations, 2 fewer on the first and last stage
    dev = cluster.device
    from tensorpar.planner.sharing import core_sharing_ranks
    host_threads = core_sharing_ranks(cluster) * dev.threads_per_rank
    oversubscribed = dev.host_cores > 0 and host_threads > dev.host_cores and dev.pipeline_p2p_op_cpu_shared_us > 0
    op_cpu = (dev.pipeline_p2p_op_cpu_shared_us if oversubscribed else dev.pipeline_p2p_op_cpu_us) * 1e-6 \
        if p > 1 else 0.0
    tied = _collective_seconds(tied_embedding_collectives(model, layout, assume), cluster, t * p)
    keep = 1 - assume.tp_overlap
    # a DP group is every (t p)-th rank: that many of its ranks share a node, and their NICs (ClusterSpec.link)
    dp_per_node = max(1, min(d, cluster.devices_per_node // (t * p)))

    def stage_times(layers: int, params: int, experts: float, first: bool, last: bool) -> tuple[tuple, tuple]:
        schedule_overhead = op_cpu * (4 * v - 2 * first - 2 * last)
        compute = layers * layer.compute + (logits_seconds if last else 0.0) + schedule_overhead
        tp_edge = keep * _collective_seconds(
            tp_collectives(model, layout, local, assume, layers=0, first_stage=first, last_stage=last), cluster, t,
            "tp")
        tp = layers * layer.tp + tp_edge
        tp_once = _collective_seconds(tp_step_collectives(model, layout, assume, layers=layers, last_stage=last),
                                      cluster, t, "tp") * keep
        dp_calls = dp_collectives(params, layout, assume, experts)
        dp = (_collective_seconds(dp_calls, cluster, t * p * d, "dp", dp_per_node)
              + (tied if first or last else 0.0)) * (1 - assume.dp_overlap)
        opt = optimizer_seconds(params, layout, cluster, assume, experts)
        ep = layers * layer.ep
        cp = layers * layer.cp
        cp_once = _collective_seconds(cp_step_collectives(params, layout, assume), cluster, t * layout.cp)
        # forward part of one micro-batch (for the shared-core schedule): the layers' forwards, the logits' third
        # (forward of 1 + backward of 2), half of the embedding / output-layer collectives
        forward = (layers * layer.forward + (logits_seconds / 3 if last else 0.0) + tp_edge / 2
                   + schedule_overhead / 2)
        forward += layers * layer.forward_cp
        return ((compute + tp + ep + cp + p2p, compute, tp, ep, forward, cp),
                (tp_once + dp + opt + cp_once, tp_once, dp, opt, cp_once))

    seen: dict[tuple, tuple] = {}  # stages of equal shape cost the same; a 64-stage pipeline has ~3 shapes
    per_stage, after_backward = [], []
    shapes = zip(stage_layers(model.num_layers, p, v), stage_params(model, layout), stage_expert_params(model, layout))
    for i, (layers, params, experts) in enumerate(shapes):
        key = (layers, params, experts, i == 0, i == p - 1)
        if key not in seen:
            seen[key] = stage_times(*key)
        per_stage.append(seen[key][0])
        after_backward.append(seen[key][1])
    slowest = max(range(p), key=lambda i: (per_stage[i][0], -i))
    micro, compute, tp, ep, _, cp = per_stage[slowest]
    _, tp_once, dp, opt, cp_once = max(after_backward)
    if cluster.device.host_cores > 0:
        wire_tp = t > 1 and cluster.crosses_nodes(t) and cluster.device.inter_node_gbps > 0
        from tensorpar.planner.sharing import shared_core_step
        step = shared_core_step(per_stage, slowest, (tp_once, dp, opt, cp_once), p2p, layout, m, cluster, wire_tp)
    else:
        step = StepTime(compute=m * compute, tp_comm=m * tp + tp_once, pp_comm=m * p2p,
                        bubble=(p - 1) / v * micro, dp_comm=dp, optimizer=opt, ep_comm=m * ep,
                        cp_comm=m * cp + cp_once)
    return Cost(step=step, model_flops=model_flops(model, work.global_batch * work.seq_len, work.seq_len),
                num_devices=layout.num_devices, peak_tflops=cluster.device.peak_tflops, bottleneck_stage=slowest)
