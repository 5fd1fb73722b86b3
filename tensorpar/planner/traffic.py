"""The collectives a layout issues, with their sizes, so that their bytes can be both timed and checked
against a communication counter.

Sizes are those of the *full* tensor a collective produces (all-reduce, all-gather) or consumes
(reduce-scatter). Bytes each rank sends under the ring algorithm ("wire bytes") for a group of g ranks
and a full tensor of B bytes: all-reduce ``2 (g-1)/g B``, all-gather and reduce-scatter ``(g-1)/g B``.

Tensor parallelism, per layer and micro-batch of b sequences of s tokens (Shoeybi et al. 2019, section 3;
Korthikanti et al. 2022, section 4.2.2): the forward pass all-reduces the outputs of the attention and MLP
blocks and the backward pass the gradients of their inputs, four all-reduces of bsh elements, so each rank
sends ``4 * 2 (t-1)/t * bsh = 8 bsh (t-1)/t`` elements. Sequence parallelism replaces each all-reduce by a
reduce-scatter and an all-gather of the same total size. Megatron also re-gathers the two saved sequence
shards in backward (two more all-gathers), which is what lets it store ``34/t`` rather than ``10 + 24/t``;
it overlaps them with the input-gradient matmul, so they are marked ``hidden``: counted in bytes, not in
time. tensorpar does the same (:func:`tensorpar.layers.linear.column_parallel_linears`).

tests/planner/test_planner_calibration.py checks these lists against tensorpar's collective counter, exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from tensorpar.planner.layout import Assumptions, Layout, Workload
from tensorpar.planner.model_spec import ModelSpec
from tensorpar.planner.partition import busiest_heads, kv_heads_duplicated, max_vocab_rows

_RING_FACTOR = {"all_reduce": lambda g: 2 * (g - 1) / g, "all_gather": lambda g: (g - 1) / g,
                "reduce_scatter": lambda g: (g - 1) / g, "all_to_all": lambda g: (g - 1) / g, "send": lambda g: 1.0}


@dataclass(frozen=True)
class Collective:
    """``calls`` collectives of one kind over a group of ``group`` ranks, each on a full tensor of
    ``elements`` elements of ``bytes_per_element`` bytes."""

    kind: str
    site: str
    calls: float
    elements: float
    bytes_per_element: int
    group: int
    hidden: bool = False  # overlapped with computation: counted in bytes, not in time

    @property
    def payload_bytes(self) -> float:
        return self.calls * self.elements * self.bytes_per_element

    @property
    def wire_bytes(self) -> float:
        """Bytes each rank sends for all ``calls`` under the ring algorithm."""
        return _RING_FACTOR[self.kind](self.group) * self.payload_bytes

    def seconds(self, bandwidth: float, latency: float) -> float:
        """alpha-beta time of all calls: ``calls * latency + wire_bytes / bandwidth``."""
        return self.calls * latency + self.wire_bytes / bandwidth


def tp_collectives(model: ModelSpec, layout: Layout, work: Workload, assume: Assumptions, *,
                   layers: int, first_stage: bool, last_stage: bool) -> list[Collective]:
    """Tensor-parallel collectives of one micro-batch on one pipeline stage (empty at tp=1).

    Layers: as in the module docstring; full recomputation re-runs the forward collectives. Under sequence
    parallelism both Megatron and tensorpar re-gather the saved sequence shards in backward.

    Outside the layers, Megatron (``kernels="megatron"``): the vocabulary-parallel embedding sums its
    partial lookups (all-reduce; reduce-scatter under sequence parallelism, all-gather in backward); the
    output layer's input is copied to every rank (all-reduce of its gradient in backward; all-gather
    forward, reduce-scatter backward and the re-gather under sequence parallelism); the cross-entropy
    all-reduces three fp32 values per token (max logit, sum of exponentials, target logit).

    tensorpar (``kernels="hf"``): the embedding always all-reduces, and under sequence parallelism the
    first block splits its input (all-gather of the gradient in backward); the output layer as above;
    the cross-entropy all-reduces the max logit and then three fp32 sums per token
    in one call.
    """
    t = layout.tp
    if t == 1:
        return []
    tokens = layout.micro_batch * work.seq_len
    bsh = tokens * model.hidden_size
    e, sp, megatron = assume.activation_bytes, layout.sequence_parallel, model.kernels == "megatron"
    rerun = 1 if layout.recompute == "full" else 0
    out: list[Collective] = []

    def add(kind: str, site: str, calls: float, elements: float = bsh, nbytes: int = e, hidden: bool = False) -> None:
        if calls:
            out.append(Collective(kind, site, calls, elements, nbytes, t, hidden))

    if sp:
        add("all_gather", "layer forward", 2 * layers * (1 + rerun))
        add("reduce_scatter", "layer forward", 2 * layers * (1 + rerun))
        add("reduce_scatter", "layer backward", 2 * layers)
        add("all_gather", "layer backward", 2 * layers)
        add("all_gather", "layer backward: re-gather saved shards", 2 * layers, hidden=True)
    else:
        add("all_reduce", "layer forward", 2 * layers * (1 + rerun))
        add("all_reduce", "layer backward", 2 * layers)
    if first_stage:
        if sp and megatron:
            add("reduce_scatter", "embedding forward", 1)
            add("all_gather", "embedding backward", 1)
        else:
            add("all_reduce", "embedding forward", 1)
            if sp:
                add("all_gather", "sequence split backward", 1)
    if last_stage:
        if sp:
            add("all_gather", "output layer forward", 1)
            add("reduce_scatter", "output layer backward", 1)
            add("all_gather", "output layer backward: re-gather saved shard", 1, hidden=True)
        else:
            add("all_reduce", "output layer backward", 1)
        if megatron:
            add("all_reduce", "cross-entropy forward", 3, tokens, 4)
        else:
            add("all_reduce", "cross-entropy forward: max", 1, tokens, 4)
            add("all_reduce", "cross-entropy forward: sums", 1, 3 * tokens, 4)
    return out


def tp_step_collectives(model: ModelSpec, layout: Layout, assume: Assumptions, *, layers: int,
                        last_stage: bool) -> list[Collective]:
    """Tensor-parallel collectives once per step, after the last backward (empty at tp=1).

    * Sequence parallelism: the gradients of norm weights (and row-parallel biases), which saw only a
      sequence shard, are summed over tp in one flattened all-reduce (Korthikanti et al. 2022, 4.2.2).
    * tensorpar with a KV head held by several ranks (a straddling GQA group, or tp > KV heads): the
      full-shape gradient of each k/v projection is all-reduced (one call per parameter).
    * Gradient clipping: one fp32 all-reduce of the sharded parameters' sum of squares.
    """
    t = layout.tp
    if t == 1:
        return []
    g = assume.grad_bytes
    out = []
    if layout.sequence_parallel:
        per_layer = 2 * model.norm_params() + (2 * model.hidden_size if model.bias else 0)
        elements = layers * per_layer + (model.norm_params() if last_stage else 0)
        out.append(Collective("all_reduce", "sequence-parallel norm gradients", 1, elements, g, t))
    if model.kernels == "hf" and layers and kv_heads_duplicated(model.num_heads, model.num_kv_heads, t):
        kv_rows = model.num_kv_heads * model.head_dim
        out.append(Collective("all_reduce", "duplicated KV head gradients", 2 * layers,
                              kv_rows * model.hidden_size, g, t))
        if model.bias:
            out.append(Collective("all_reduce", "duplicated KV head bias gradients", 2 * layers, kv_rows, g, t))
    out.append(Collective("all_reduce", "gradient norm", 1, 1, 4, t))
    return out


def layer_tp_wire_elements(micro_batch: int, seq: int, hidden: int, tp: int) -> float:
    """The per-layer, per-micro-batch TP traffic of the issue statement: ``8 bsh (t-1)/t`` elements each
    rank sends (four ring all-reduces of bsh elements, forward and backward)."""
    return 8 * micro_batch * seq * hidden * (tp - 1) / tp


def pipeline_sends(model: ModelSpec, layout: Layout, work: Workload, assume: Assumptions) -> list[Collective]:
    """Point-to-point traffic of one stage per micro-batch: the activation forward and its gradient
    backward across each of the stage's ``v`` chunk boundaries. Megatron's scatter/gather optimisation
    (Narayanan et al. 2021, section 4.1) sends ``1/t`` of the [s, b, h] tensor from each TP rank; tensorpar
    (``kernels="hf"``) sends each TP rank's whole [b, s, h] hidden state to its counterpart on the next stage
    (:mod:`tensorpar.pipeline.stages`), ``1/t`` of it only under sequence parallelism ([b, s/t, h])."""
    if layout.pp == 1:
        return []
    split = layout.tp if model.kernels == "megatron" or layout.sequence_parallel else 1
    elements = layout.micro_batch * work.seq_len * model.hidden_size / split
    return [Collective("send", "pipeline activations and gradients", 2 * layout.virtual_stages, elements,
                       assume.activation_bytes, 2)]


def ep_collectives(model: ModelSpec, layout: Layout, work: Workload, assume: Assumptions, *,
                   layers: int) -> list[Collective]:
    """Expert-parallel all-to-alls of one micro-batch on one stage (empty unless ep > 1).

    Per MoE layer the forward pass dispatches each token's hidden state to its top-k experts and combines
    the results (two all-to-alls of ``tokens x k x capacity_factor x h`` elements), and the backward pass
    does the same for the gradients; full recomputation repeats the forward two. Each rank keeps ``1/ep``
    of what it dispatches (Lepikhin et al. 2020, GShard; Fedus et al. 2021, Switch Transformer).
    """
    if layout.ep == 1 or not model.is_moe:
        return []
    tokens = layout.micro_batch * work.seq_len / (layout.tp if layout.sequence_parallel else 1)
    elements = tokens * model.experts_per_token * assume.capacity_factor * model.hidden_size
    rerun = 1 if layout.recompute == "full" else 0
    return [Collective("all_to_all", "expert dispatch and combine forward", 2 * layers * (1 + rerun), elements,
                       assume.activation_bytes, layout.ep),
            Collective("all_to_all", "expert dispatch and combine backward", 2 * layers, elements,
                       assume.activation_bytes, layout.ep)]


def dp_collectives(stage_params: float, layout: Layout, assume: Assumptions, expert_params: float = 0.0) -> list[Collective]:
    """Data-parallel traffic of one device per step.

    Plain data parallelism all-reduces the gradients, ``2 (d-1)/d`` x the gradient bytes on the wire.
    The distributed optimizer (ZeRO stage 1, Rajbhandari et al. 2020) reduce-scatters the gradients and
    all-gathers the updated weights, ``(d-1)/d`` x each. Routed-expert parameters (``expert_params`` of
    ``stage_params``) are reduced over the ``dp / ep`` replicas that hold the same experts.
    """
    out = []
    groups = ((stage_params - expert_params, layout.dp, ""), (expert_params, layout.dp // layout.ep, "expert "))
    for params, d, what in groups:
        if d == 1 or not params:
            continue
        if layout.distributed_optimizer:
            out += [Collective("reduce_scatter", f"{what}gradients", 1, params, assume.grad_bytes, d),
                    Collective("all_gather", f"updated {what}weights", 1, params, assume.param_bytes, d)]
        else:
            out.append(Collective("all_reduce", f"{what}gradients", 1, params, assume.grad_bytes, d))
    return out


def tied_embedding_collectives(model: ModelSpec, layout: Layout, assume: Assumptions) -> list[Collective]:
    """With pipeline parallelism and tied embeddings, the first and last stages all-reduce the gradient
    of their two copies of the embedding shard once per step (as Megatron does)."""
    if not (model.tied_embeddings and layout.pp > 1):
        return []
    rows = model.embedding_params(max_vocab_rows(model.vocab_size, layout.tp))
    return [Collective("all_reduce", "tied embedding gradients", 1, rows, assume.grad_bytes, 2)]


def cp_collectives(model: ModelSpec, layout: Layout, work: Workload, assume: Assumptions, *,
                   layers: int) -> list[Collective]:
    """Context-parallel traffic of one micro-batch on one stage's ``layers`` (empty at cp = 1), as
    :mod:`tensorpar.layers.ring_attention` sends it. ``b`` sequences, ``s_l = s / cp`` positions per rank, ``kv``
    and ``h`` the tp rank's KV and query heads of size ``d``; a block is ``[2, b, kv, s_l, d]`` (K and V), fp32.

    * ring, per layer: forward ``cp - 1`` hops of the K/V block (each rank sends ``(cp-1)/cp`` of the whole
      sequence's K and V); backward the K/V blocks again (``cp - 1`` hops) and each block's ``[dK, dV]`` ``cp``
      hops behind it (home to its owner): ``2 (cp-1)/cp`` of K and V per layer over forward and backward, plus
      the gradients. Full recomputation repeats the forward hops. Every hop is in flight while a block is
      computed (step_cost hides it behind the attention's time).
    * all2all (Ulysses), per layer: forward q, k, v into the head split and the output back (four all-to-alls of
      ``[b, h, s_l, d]``, k and v at ``kv`` heads unless cp does not divide them, then repeated to ``h``),
      backward the inverse four; in the activation dtype. Not overlapped.
    """
    c = layout.cp
    if c == 1:
        return []
    heads = busiest_heads(model.num_heads, model.num_kv_heads, layout.tp)
    local = layout.micro_batch * work.seq_len // c * model.head_dim    # b s_l d
    rerun = 1 if layout.recompute == "full" else 0
    if layout.cp_mode == "ring":
        block = 2 * local * heads.kv
        return [Collective("send", "ring key/value blocks forward", (c - 1) * layers * (1 + rerun), block, 4, c),
                Collective("send", "ring key/value blocks backward", (c - 1) * layers, block, 4, c),
                Collective("send", "ring key/value gradients backward", c * layers, block, 4, c)]
    kv = heads.kv if heads.kv % c == 0 else heads.q
    e = assume.activation_bytes
    out = []
    for what, calls in (("forward", layers * (1 + rerun)), ("backward", layers)):
        out += [Collective("all_to_all", f"all2all q and output {what}", 2 * calls, local * heads.q, e, c),
                Collective("all_to_all", f"all2all k and v {what}", 2 * calls, local * kv, e, c)]
    return out


def cp_exposed_seconds(model: ModelSpec, layout: Layout, cluster, work: Workload, assume: Assumptions,
                       forward_attention: float, backward_attention: float) -> tuple[float, float]:
    """Exposed seconds of one layer's context-parallel traffic, forward and backward (recomputation's forward
    hops not included): the ring's hops minus the attention time they overlap, all2all's in full. A cp group is
    ``cp`` ranks ``tp`` apart (rank grid ``(dp, pp, cp, tp)``); ``cluster`` a
    :class:`~tensorpar.planner.cluster.ClusterSpec`."""
    if layout.cp == 1:
        return 0.0, 0.0
    calls = cp_collectives(model, replace(layout, recompute="none"), work, assume, layers=1)
    bandwidth, latency = cluster.link(layout.tp * layout.cp)
    fwd = sum(c.seconds(bandwidth, latency) for c in calls if "forward" in c.site)
    bwd = sum(c.seconds(bandwidth, latency) for c in calls if "backward" in c.site)
    if layout.cp_mode == "ring":
        return max(0.0, fwd - forward_attention), max(0.0, bwd - backward_attention)
    return fwd, bwd


def cp_step_collectives(stage_params: float, layout: Layout, assume: Assumptions) -> list[Collective]:
    """Once per step at cp > 1: the cp ranks' gradients (each from its positions) summed by one all-reduce."""
    if layout.cp == 1 or not stage_params:
        return []
    return [Collective("all_reduce", "cp gradients", 1, stage_params, assume.grad_bytes, layout.cp)]
