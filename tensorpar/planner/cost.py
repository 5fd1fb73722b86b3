"""Step time and model FLOPs utilisation of a layout.

Model of one optimizer step (each assumption is a choice; docs/planner.md lists them):

* A micro-batch on pipeline stage i takes ``T_i = compute_i + exposed TP communication_i + p2p_i``;
  compute is the stage's executed matmul FLOPs (forward, 2x backward, recomputation; see flops.py) at
  ``efficiency`` x peak, on its busiest tensor-parallel rank.
* The pipeline runs at the pace of its slowest stage, ``T = max_i T_i``. 1F1B over m micro-batches takes
  ``(m + (p-1)/v) T``: the bubble is ``(p-1)/(v m)`` of the ideal time (Narayanan et al. 2021, section 2.2).
* TP collectives are on the critical path except a fraction ``tp_overlap`` (and the backward re-gather of
  sequence parallelism, which Megatron overlaps with the input-gradient matmul); pipeline sends are not
  hidden.
* Once per step, after the last backward: the per-step TP collectives (sequence-parallel norm
  gradients, duplicated KV-head gradients, the gradient norm) and the data-parallel gradient reduction
  (hidden except a fraction ``1 - dp_overlap``); stages do this in parallel, so the slowest stage counts.
* The optimizer update itself, embedding lookups and other bandwidth-bound work outside the matmuls are
  folded into ``efficiency``.

``mfu = model FLOPs per step / (step time x devices x peak)``, with model FLOPs excluding recomputation.
"""
from __future__ import annotations

from dataclasses import dataclass

from tensorpar.planner.cluster import ClusterSpec
from tensorpar.planner.flops import layer_forward_flops, logit_forward_flops, model_flops, recompute_forward_flops
from tensorpar.planner.layout import Assumptions, Layout, Workload
from tensorpar.planner.memory import stage_params
from tensorpar.planner.model_spec import ModelSpec
from tensorpar.planner.partition import busiest_heads, max_vocab_rows, stage_layers
from tensorpar.planner.traffic import (dp_collectives, pipeline_sends, tied_embedding_collectives, tp_collectives,
                                      tp_step_collectives)


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step, split into the parts that add up to it."""

    compute: float
    tp_comm: float
    pp_comm: float
    bubble: float
    dp_comm: float

    @property
    def total(self) -> float:
        return self.compute + self.tp_comm + self.pp_comm + self.bubble + self.dp_comm

    def as_dict(self) -> dict:
        return {"compute": self.compute, "tp_comm": self.tp_comm, "pp_comm": self.pp_comm,
                "bubble": self.bubble, "dp_comm": self.dp_comm}


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


def _collective_seconds(collectives, cluster: ClusterSpec, span: int) -> float:
    bandwidth, latency = cluster.link(span)
    return sum(c.seconds(bandwidth, latency) for c in collectives if not c.hidden)


def step_cost(model: ModelSpec, layout: Layout, cluster: ClusterSpec, work: Workload, assume: Assumptions) -> Cost:
    """Step time of ``layout``. Ranks form tensorpar's grid ``arange(N).view(dp, pp, tp)``: a TP group is
    ``tp`` consecutive ranks, a pipeline spans ``tp * pp`` and a DP group all ``N`` ranks; a group whose
    span fits in a node uses the intra-node links (see :meth:`ClusterSpec.link`)."""
    t, p, d, v = layout.tp, layout.pp, layout.dp, layout.virtual_stages
    m = layout.num_micro_batches(work.global_batch)
    tokens = layout.micro_batch * work.seq_len
    heads = busiest_heads(model.num_heads, model.num_kv_heads, t)
    layer = layer_forward_flops(model, heads, model.ffn_hidden_size / t, tokens, work.seq_len)
    layer_flops = 3 * (layer["linear"] + layer["attention"]) + recompute_forward_flops(
        layer, layout.recompute, assume.attention)
    logits_flops = 3 * logit_forward_flops(model, max_vocab_rows(model.vocab_size, t), tokens)
    flop_rate = cluster.device.peak_tflops * 1e12 * assume.efficiency
    p2p = _collective_seconds(pipeline_sends(model, layout, work, assume), cluster, t * p)
    tied = _collective_seconds(tied_embedding_collectives(model, layout, assume), cluster, t * p)

    def stage_times(layers: int, params: int, first: bool, last: bool) -> tuple[tuple, tuple]:
        compute = (layers * layer_flops + (logits_flops if last else 0.0)) / flop_rate
        tp = _collective_seconds(
            tp_collectives(model, layout, work, assume, layers=layers, first_stage=first, last_stage=last),
            cluster, t) * (1 - assume.tp_overlap)
        tp_once = _collective_seconds(tp_step_collectives(model, layout, assume, layers=layers, last_stage=last),
                                      cluster, t) * (1 - assume.tp_overlap)
        dp = (_collective_seconds(dp_collectives(params, layout, assume), cluster, t * p * d)
              + (tied if first or last else 0.0)) * (1 - assume.dp_overlap)
        return (compute + tp + p2p, compute, tp), (tp_once + dp, tp_once, dp)

    seen: dict[tuple, tuple] = {}  # stages of equal shape cost the same; a 64-stage pipeline has ~3 shapes
    per_stage, after_backward = [], []
    for i, (layers, params) in enumerate(zip(stage_layers(model.num_layers, p, v), stage_params(model, layout))):
        key = (layers, params, i == 0, i == p - 1)
        if key not in seen:
            seen[key] = stage_times(*key)
        per_stage.append(seen[key][0])
        after_backward.append(seen[key][1])
    slowest = max(range(p), key=lambda i: (per_stage[i][0], -i))
    micro, compute, tp = per_stage[slowest]
    _, tp_once, dp = max(after_backward)
    step = StepTime(compute=m * compute, tp_comm=m * tp + tp_once, pp_comm=m * p2p,
                    bubble=(p - 1) / v * micro, dp_comm=dp)
    return Cost(step=step, model_flops=model_flops(model, work.global_batch * work.seq_len, work.seq_len),
                num_devices=layout.num_devices, peak_tflops=cluster.device.peak_tflops, bottleneck_stage=slowest)
