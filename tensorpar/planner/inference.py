"""Inference planning: for each tensor-parallel and pipeline degree, the memory per rank (weights and KV cache),
the time to first token and the per-token decode latency of a batch, and how many replicas the devices hold.

Model (one replica of ``tp x pp`` ranks, batch B, prompt P, N new tokens; all per rank, busiest rank):

* weights: the layers at the rank's heads and MLP columns, its vocabulary shards of the embedding and
  of the output layer (one shared copy when tied), the norms, at ``weight_bytes`` per parameter;
* KV cache: ``2 x layers x B x (P + N) x kv_heads_on_rank x head_dim x kv_bytes``. A rank holds every KV
  head its query heads read, so with tp > KV heads each KV head is replicated (its cache with it), and a
  GQA group split between two ranks has its KV head on both (:mod:`tensorpar.planner.partition`);
* prefill working set: the largest transient of one layer on the prompt (the rank's q/k/v and MLP
  interior for B x P tokens) and the last position's fp32 logits;
* time to first token (:mod:`tensorpar.planner.prefill`): the prompt's forward as ``generate`` times it: with
  measured prefill constants (a CPU rank) the layers' matmuls at the GEMM rates fitted at the model's shapes
  (weights read once + FLOPs of ``B x P`` rows), the prompt's attention, a per-layer framework overhead; without
  them the compute-bound lower bound (matmul FLOPs at ``matmul_efficiency x peak``, at least one read of the
  weights); plus two TP all-reduces of ``B x P x h`` per layer, the embedding's and the token pick (all-gather
  and broadcast);
* decode, per token: memory-bandwidth bound: the weights and the KV cache (at the mean context
  ``P + N/2``) read once at the decode read rate (or the matmuls, if slower), plus the step's TP collectives:
  two all-reduces of ``B x h`` per layer, one for the vocabulary-parallel embedding's lookup, and the greedy
  token pick (an all-gather of ``B x 2`` fp64 and a broadcast of ``B + 1`` int64), ``2 x layers + 3`` in all:
  at small batch these are latency, not bytes;
* decode read rate per rank (:func:`decode_read_gbps`): ``decode_read_gbps`` (one rank alone, one-row matmuls at
  the model's shapes; ``hbm_gbps`` when 0), capped by ``decode_read_host_gbps / ranks on the node`` where the
  node's ranks share one memory (a CPU host; all ``min(G, devices_per_node)`` of them decode at once);
* each decode collective costs the device's ``decode_collective_us`` where measured (its cost inside a decode
  step: latency, waiting for the slower rank, the reads it slows), else latency + bytes / bandwidth of the tp
  link;
* every layer of every forward pass also pays the device's ``layer_overhead_us`` (Python, framework and
  kernel launches; 0 unless measured, e.g. by ``bench/bench_plan_inference.py``: the lean decode path on the
  same model with 8-wide matrices);
* pipeline stages (``pp`` > 1, ``generate --pp``; only on a cluster of several nodes, where a stage can be a
  node): the layers cut as training cuts them (:func:`~tensorpar.planner.partition.stage_layers`), the
  embedding on the first stage and the head on the last (a tied head: on both); one micro-batch in flight, so
  a step runs the stages one after another: the reads, compute, tp collectives and overhead of the whole model
  (as at pp 1) plus ``pp - 1`` sends of the step's ``B x h`` hidden state (``T x h`` in prefill) over the
  pipeline's link (:meth:`ClusterSpec.p2p_link`) and one broadcast of the ``B + 1`` int64 tokens over the
  pipeline group; memory per rank is the busiest stage's;
* the links: a group that stays in a node uses the node's links; a tp group or a pipeline that spans nodes
  uses the inter-node link (``inter_node_gbps``, ``inter_node_latency_us``: :meth:`ClusterSpec.link`), each
  collective at its latency + bytes / bandwidth (a measured ``decode_collective_us`` is a node's own link and
  is not used across nodes). tp spans whole nodes when it leaves one (``tp`` a multiple of the ranks per node);
* ``tp_comm="int8"`` (``--tp-comm int8``): the ``2 x layers + 1`` all-reduces of partial sums are one all-gather
  of each rank's blockwise int8 partial (:func:`tensorpar.comm.compress.payload_bytes`, ~1.125 bytes per element):
  :func:`gather_latency` + ``(tp - 1) x payload / bandwidth`` + the device's ``int8_reduce_cpu_us`` (quantizing,
  dequantizing and summing, measured; 0 in the presets); the token pick and the pipeline's token broadcast are an
  all-gather and broadcasts too, at :func:`gather_latency` (an all-reduce's on a CPU host, half of it on a ring);
* throughput: ``replicas x B / decode seconds per token``, replicas = devices // (tp x pp).

The winner: among layouts that fit (and meet ``latency_target_ms`` per decoded token, when given), the
highest decode throughput; ties go to the lower latency. When a target is given and no fitting layout meets
it, the winner is the fastest fitting layout (lowest decode time per token), the closest to the target.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tensorpar.planner.cluster import ClusterSpec
from tensorpar.planner.enumerate import divisors
from tensorpar.planner.flops import layer_forward_flops, logit_forward_flops
from tensorpar.planner.memory import GIB
from tensorpar.planner.model_spec import ModelSpec
from tensorpar.planner.partition import busiest_heads, max_ffn_columns, max_vocab_rows, split_problems, stage_layers
from tensorpar.planner.prefill import prefill_seconds


@dataclass(frozen=True)
class InferenceWorkload:
    """``batch`` sequences of ``prompt_len`` prompt tokens, each generating ``max_new_tokens``."""

    batch: int
    prompt_len: int
    max_new_tokens: int
    weight_bytes: int = 2
    kv_bytes: int = 2
    latency_target_ms: float | None = None
    reserve_gib: float = 2.0
    tp_comm: str = "fp32"  # the tp all-reduce of partial sums: "fp32" (exact, at weight_bytes) or "int8"

    def __post_init__(self) -> None:
        if self.tp_comm not in ("fp32", "int8"):
            raise ValueError(f"--tp-comm ({self.tp_comm!r}) must be fp32 or int8")
        for knob, flag in (("batch", "--batch"), ("prompt_len", "--prompt-len"), ("max_new_tokens", "--max-new-tokens")):
            if getattr(self, knob) < 1:
                raise ValueError(f"{flag} ({getattr(self, knob)}) must be >= 1")
        if self.latency_target_ms is not None and not self.latency_target_ms > 0:
            raise ValueError(f"--latency-target-ms ({self.latency_target_ms}) must be > 0")
        if not 0 <= self.reserve_gib < float("inf"):
            raise ValueError(f"--reserve-gb {self.reserve_gib:.12g}: must be a finite number >= 0 (GiB per device kept "
                             f"off the model)")


@dataclass(frozen=True)
class InferencePlan:
    tp: int
    replicas: int
    weights: float  # bytes per rank
    kv_cache: float
    working_set: float
    usable: float
    ttft: float  # seconds
    decode: float  # seconds per token (one step for the whole batch)
    decode_memory: float  # parts of ``decode``: device-memory reads, compute, TP collectives, fixed overhead
    decode_compute: float
    decode_comm: float
    kv_heads_per_rank: int
    batch: int
    decode_overhead: float = 0.0  # layers x layer_overhead_us, seconds
    pp: int = 1
    decode_pp_comm: float = 0.0  # part of ``decode``: the pipeline's sends and token broadcast, seconds
    tp_across_nodes: bool = False
    pp_across_nodes: bool = False
    #: parts of ``ttft`` (seconds): matmul, attention, overhead, tp_comm, pp_comm (:func:`prefill_seconds`)
    ttft_parts: dict = field(default_factory=dict, compare=False)

    @property
    def name(self) -> str:
        """``tp=2`` or ``tp=2 pp=2``."""
        return f"tp={self.tp}" + (f" pp={self.pp}" if self.pp > 1 else "")

    @property
    def memory(self) -> float:
        return self.weights + self.kv_cache + self.working_set

    @property
    def fits(self) -> bool:
        return self.memory <= self.usable

    @property
    def tokens_per_s(self) -> float:
        return self.replicas * self.batch / self.decode

    def meets(self, target_ms: float | None) -> bool:
        return target_ms is None or self.decode * 1e3 <= target_ms

    def to_json(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "replicas": self.replicas, "fits": self.fits,
                "across_nodes": {"tp": self.tp_across_nodes, "pp": self.pp_across_nodes},
                "memory_gb": {k: round(v / GIB, 3) for k, v in (("weights", self.weights), ("kv_cache", self.kv_cache),
                                                                ("working_set", self.working_set),
                                                                ("total", self.memory))},
                "kv_heads_per_rank": self.kv_heads_per_rank, "ttft_ms": round(self.ttft * 1e3, 4),
                "ttft_breakdown_ms": {k: round(v * 1e3, 4) for k, v in self.ttft_parts.items()},
                "decode_ms_per_token": round(self.decode * 1e3, 4),
                "decode_breakdown_ms": {"memory": round(self.decode_memory * 1e3, 4),
                                        "compute": round(self.decode_compute * 1e3, 4),
                                        "tp_comm": round(self.decode_comm * 1e3, 4),
                                        "pp_comm": round(self.decode_pp_comm * 1e3, 4),
                                        "overhead": round(self.decode_overhead * 1e3, 4)},
                "tokens_per_s": round(self.tokens_per_s, 2)}


def weight_params_per_rank(model: ModelSpec, tp: int, pp: int = 1) -> float:
    """Parameters the busiest rank holds for inference: at ``pp`` = 1 the whole model's tp shard; at ``pp`` > 1 the
    busiest stage's (its layers, the embedding on the first stage, the head on the last, a tied one on both)."""
    heads = busiest_heads(model.num_heads, model.num_kv_heads, tp)
    layer = model.layer_params(heads.q, heads.kv, max_ffn_columns(model.ffn_hidden_size, tp))
    vocab = model.embedding_params(max_vocab_rows(model.vocab_size, tp))
    if pp == 1:
        return (model.num_layers * layer + vocab * (1 if model.tied_embeddings else 2)
                + model.learned_positions * model.hidden_size + model.norm_params())
    sizes = stage_layers(model.num_layers, pp)
    first = sizes[0] * layer + vocab + model.learned_positions * model.hidden_size
    last = sizes[-1] * layer + vocab + model.norm_params()  # the head (a tied head is a copy of the embedding)
    return max(first, last, *(n * layer for n in sizes[1:-1]))


def kv_cache_bytes(model: ModelSpec, tp: int, batch: int, tokens: int, kv_bytes: int = 2, layers: int | None = None
                   ) -> float:
    """K and V of ``layers`` layers (default: every layer) for ``batch x tokens`` positions, for the KV heads the
    busiest rank holds."""
    kv = busiest_heads(model.num_heads, model.num_kv_heads, tp).kv
    return 2 * (model.num_layers if layers is None else layers) * batch * tokens * kv * model.head_dim * kv_bytes


def decode_matrices(model: ModelSpec, tp: int) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """``(out, in)`` shapes of the busiest rank's matmul weights that one decode step reads: per layer the fused
    QKV ``((q + 2 kv) x head_dim, h)``, the attention output ``(h, q x head_dim)``, the fused gate-up (or up)
    ``((mlp_matrices - 1) x f, h)`` and the down projection ``(h, f)`` (``f``: the rank's active MLP columns), as
    :class:`tensorpar.decode.lean.LeanDecoder` runs them; and the LM head's vocabulary shard ``(V_r, h)``."""
    heads = busiest_heads(model.num_heads, model.num_kv_heads, tp)
    f = int(model.active_ffn(max_ffn_columns(model.ffn_hidden_size, tp)))
    h, d = model.hidden_size, model.head_dim
    layer = [((heads.q + 2 * heads.kv) * d, h), (h, heads.q * d), ((model.mlp_matrices - 1) * f, h), (h, f)]
    return layer, (max_vocab_rows(model.vocab_size, tp), h)


def decode_read_gbps(cluster: ClusterSpec, pp: int = 1) -> float:
    """GB/s at which one rank reads its weights in decode: the device's ``decode_read_gbps`` (``hbm_gbps`` when 0),
    at most ``decode_read_host_gbps`` shared by the node's ranks that read at once (``min(num_devices,
    devices_per_node)``, a ``1 / pp`` share of them with one micro-batch in flight through ``pp`` stages) where
    the node's ranks share one memory."""
    d = cluster.device
    alone = d.decode_read_gbps or d.hbm_gbps
    if d.decode_read_host_gbps > 0:
        return min(alone, d.decode_read_host_gbps / max(1, min(cluster.num_devices, cluster.devices_per_node) // pp))
    return alone


def decode_collectives(model: ModelSpec, tp: int) -> int:
    """TP collectives of one greedy decode step at tp > 1 (0 at tp = 1): two all-reduces per layer, the
    embedding's all-reduce, the token pick's all-gather and the token broadcast (``tensorpar.generate``)."""
    return 0 if tp == 1 else 2 * model.num_layers + 3


def gather_latency(latency: float, cluster: ClusterSpec) -> float:
    """The latency of an all-gather or a broadcast on a link whose all-reduce latency is ``latency``.

    On a CPU host (``cluster.device.host_cores`` > 0: tensorpar's own collectives carry a decode step's small
    messages, shared memory inside a host and the leaders' TCP mesh between hosts, ``tensorpar.comm.tcp``) an
    all-reduce is one exchange of the partial sums followed by a local sum, so an all-gather costs what it costs:
    ``latency``. Measured in a decode step between two namespace hosts (bench/results/link_rates.md, 16:22): an
    all-gather adds 114-197 us, an all-reduce 112-186 us (six rounds). Elsewhere (gloo's and NCCL's rings) half of
    it: a ring all-reduce is a reduce-scatter and an all-gather, ``2 (tp - 1)`` steps, the all-gather alone ``tp - 1``
    (gloo's broadcast, root to each, as many); gloo between the same hosts gave 1.8-2.0 ms per all-gather against
    3.2-3.7 ms per all-reduce (the link_rates.md of 06:37, in git history)."""
    return latency if cluster.device.host_cores > 0 else latency / 2


def _all_reduce_seconds(elements: float, nbytes: int, tp: int, cluster: ClusterSpec, tp_comm: str = "fp32") -> float:
    """One tp all-reduce of partial sums: a ring, ``2 (tp - 1) / tp x elements x nbytes`` over the tp link; with
    ``tp_comm="int8"`` one all-gather of every rank's compressed partial (``(tp - 1) x payload_bytes``, at
    :func:`gather_latency`) plus the device's ``int8_reduce_cpu_us`` (quantizing, dequantizing, summing)."""
    if tp == 1:
        return 0.0
    bandwidth, latency = cluster.link(tp, "tp")
    if tp_comm == "int8":
        from tensorpar.comm.compress import payload_bytes

        return (gather_latency(latency, cluster) + (tp - 1) * payload_bytes(int(elements)) / bandwidth
                + cluster.device.int8_reduce_cpu_us * 1e-6)
    return latency + 2 * (tp - 1) / tp * elements * nbytes / bandwidth


def pick_seconds(tp: int, batch: int, cluster: ClusterSpec) -> float:
    """The greedy token pick over the tp group: an all-gather of ``B x 2`` fp64 (``(tp - 1) x 16 B`` received per
    row) and a broadcast of ``B + 1`` int64, each at :func:`gather_latency` (0 at tp = 1)."""
    if tp == 1:
        return 0.0
    bandwidth, latency = cluster.link(tp, "tp")
    return 2 * gather_latency(latency, cluster) + ((tp - 1) * batch * 16 + (batch + 1) * 8) / bandwidth


def _decode_comm_seconds(model: ModelSpec, tp: int, cluster: ClusterSpec, batch: int, nbytes: int,
                         tp_comm: str = "fp32") -> float:
    """The TP collectives of one greedy decode step (:func:`decode_collectives`): the device's measured
    ``decode_collective_us`` each where it has one and the tp group stays in a node (or no inter-node link is
    given); else latency + bytes / bandwidth of the tp link: ``2 x layers + 1`` all-reduces of ``B x h`` at
    ``nbytes`` (``tp_comm``: :func:`_all_reduce_seconds`), the all-gather of ``B x 2`` fp64 (``(tp - 1) x 16 B``
    bytes received per row) and the broadcast of ``B + 1`` int64."""
    if tp == 1:
        return 0.0
    across = cluster.crosses_nodes(tp) and cluster.device.inter_node_gbps > 0
    if cluster.device.decode_collective_us > 0 and not across:
        return decode_collectives(model, tp) * cluster.device.decode_collective_us * 1e-6
    return ((2 * model.num_layers + 1) * _all_reduce_seconds(batch * model.hidden_size, nbytes, tp, cluster, tp_comm)
            + pick_seconds(tp, batch, cluster))


def _pipeline_seconds(tokens: int, batch: int, hidden: int, nbytes: int, tp: int, pp: int,
                      cluster: ClusterSpec) -> float:
    """One step's pipeline traffic (``generate --pp``): ``pp - 1`` sends of the ``tokens x h`` hidden state (tp rank
    r to tp rank r of the next stage, at the same time) over :meth:`ClusterSpec.p2p_link`, and the broadcast of the
    ``batch + 1`` int64 tokens from the last stage over the pipeline group (ranks ``tp`` apart, spanning
    ``tp x pp``; at :func:`gather_latency`)."""
    if pp == 1:
        return 0.0
    bandwidth, latency = cluster.p2p_link(tp * pp)
    sends = (pp - 1) * (latency + tokens * hidden * nbytes / bandwidth)
    bandwidth, latency = cluster.link(tp * pp)
    return sends + gather_latency(latency, cluster) + (batch + 1) * 8 / bandwidth


def plan_one(model: ModelSpec, tp: int, cluster: ClusterSpec, work: InferenceWorkload, pp: int = 1) -> InferencePlan:
    """The plan of ``tp x pp`` ranks per replica (module docstring)."""
    dev = cluster.device
    if not dev.hbm_gbps:
        raise ValueError(f"device {dev.name} has no hbm_gbps (device-memory bandwidth), which decode time needs; "
                         "give --hbm-gbps")
    heads = busiest_heads(model.num_heads, model.num_kv_heads, tp)
    ffn = max_ffn_columns(model.ffn_hidden_size, tp)
    b, p, n, e = work.batch, work.prompt_len, work.max_new_tokens, work.weight_bytes
    weights = weight_params_per_rank(model, tp, pp) * e
    read_weights = weight_params_per_rank(model, tp) * e  # the stages run one after another: every stage's reads
    kv_total = kv_cache_bytes(model, tp, b, p + n, work.kv_bytes, layers=max(stage_layers(model.num_layers, pp)))
    working = (b * p * (model.head_dim * (heads.q + 2 * heads.kv) + 3 * model.active_ffn(ffn) + 2 * model.hidden_size) * e
               + 4 * b * max_vocab_rows(model.vocab_size, tp) * (1 + (tp > 1)))
    rate = dev.peak_tflops * 1e12 * dev.matmul_efficiency
    vocab_rows = max_vocab_rows(model.vocab_size, tp)
    overhead = model.num_layers * dev.layer_overhead_us * 1e-6
    first = prefill_seconds(model, tp, cluster, b, p, e, work.tp_comm, pp)

    context = p + n / 2  # mean context length over the generated tokens
    decode_layer = layer_forward_flops(model, heads, ffn, b, context)
    decode_flops = model.num_layers * (decode_layer["linear"] + decode_layer["attention"]) + \
        logit_forward_flops(model, vocab_rows, b)
    read = decode_read_gbps(cluster, pp) * 1e9
    decode_memory = (read_weights + kv_cache_bytes(model, tp, b, context, work.kv_bytes)) / read
    decode_compute = decode_flops / rate
    decode_comm = _decode_comm_seconds(model, tp, cluster, b, e, work.tp_comm)
    decode_pp = _pipeline_seconds(b, b, model.hidden_size, e, tp, pp, cluster)
    decode = max(decode_memory, decode_compute) + decode_comm + decode_pp + overhead
    return InferencePlan(tp=tp, replicas=cluster.num_devices // (tp * pp), weights=weights, kv_cache=kv_total,
                         working_set=working, usable=(dev.memory_gib - work.reserve_gib) * GIB, ttft=first["total"],
                         decode=decode, decode_memory=decode_memory, decode_compute=decode_compute,
                         decode_comm=decode_comm, kv_heads_per_rank=heads.kv, batch=b, decode_overhead=overhead,
                         pp=pp, decode_pp_comm=decode_pp, tp_across_nodes=tp > 1 and cluster.crosses_nodes(tp),
                         pp_across_nodes=pp > 1 and cluster.crosses_nodes(tp * pp),
                         ttft_parts={k: v for k, v in first.items() if k != "total"})


def candidate_layouts(model: ModelSpec, cluster: ClusterSpec, one_replica: bool = False) -> list[tuple[int, int]]:
    """``(tp, pp)`` with ``tp x pp`` dividing the device count: tp inside a node (dividing its ranks) as
    :func:`candidate_tps`, and on a cluster of several nodes also tp over whole nodes (a multiple of the ranks per
    node) and pp up to the layers (stages across nodes); on one node pp stays 1 (it buys memory, not speed).
    ``one_replica``: only ``tp x pp`` = the device count (``generate --plan auto``: one replica of every rank); on
    one node pp > 1 only where tp alone cannot split the model."""
    n, per_node = cluster.num_devices, cluster.devices_per_node
    nodes = n > per_node
    out = []
    for t in divisors(n):
        inside = t <= per_node and per_node % t == 0
        if not (inside or (nodes and t % per_node == 0)):
            continue
        if split_problems(model.num_heads, model.num_kv_heads, model.ffn_hidden_size, model.vocab_size, t):
            continue
        out += [(t, p) for p in divisors(n // t) if (p == 1 or ((nodes or one_replica) and p <= model.num_layers))
                and (not one_replica or t * p == n)]
    if one_replica and not nodes and (n, 1) in out:
        return [(n, 1)]  # one node: stages only where tp alone cannot split the model
    return out


def candidate_tps(model: ModelSpec, cluster: ClusterSpec) -> list[int]:
    """tp values dividing the device count, inside a node, that the layers can split the model over."""
    return [t for t in divisors(cluster.num_devices)
            if t <= cluster.devices_per_node and cluster.devices_per_node % t == 0
            and not split_problems(model.num_heads, model.num_kv_heads, model.ffn_hidden_size, model.vocab_size, t)]


def plan_inference(model: ModelSpec, cluster: ClusterSpec, work: InferenceWorkload, one_replica: bool = False
                   ) -> list[InferencePlan]:
    """Every candidate layout (:func:`candidate_layouts`; ``one_replica``: of all the devices), best first: fitting
    and meeting the latency target, by throughput, then latency.
    When no fitting tp meets the target, the fitting ones are ranked by decode latency (fastest first)."""
    model.check_seq_len(work.prompt_len + work.max_new_tokens,
                        f"--prompt-len + --max-new-tokens ({work.prompt_len} + {work.max_new_tokens})")
    plans = [plan_one(model, t, cluster, work, p) for t, p in candidate_layouts(model, cluster, one_replica)]
    target = work.latency_target_ms
    if target is not None and not any(q.fits and q.meets(target) for q in plans):
        return sorted(plans, key=lambda q: (not q.fits, q.decode, -q.tokens_per_s, q.tp, q.pp))
    return sorted(plans, key=lambda q: (not q.fits, not q.meets(target), -q.tokens_per_s, q.decode, q.tp, q.pp))


def explain_inference(plans: list[InferencePlan], work: InferenceWorkload) -> list[str]:
    lines = []
    best = plans[0] if plans else None
    if best is None or not best.fits:
        small = min(plans, key=lambda q: q.memory) if plans else None
        lines.append("No tp fits" + (f": the smallest, {small.name}, needs {small.memory / GIB:.1f} GiB > "
                                     f"{small.usable / GIB:.1f} GiB usable" if small else "") + ".")
        return lines
    target = work.latency_target_ms
    if not best.meets(target):
        # plan_inference ranks by latency in this case: best is the fastest layout that fits
        lines.append(f"No tp meets {target:g} ms per token; picked the fastest that fits, {best.name} at "
                     f"{best.decode * 1e3:.2f} ms (rest ranked by latency).")
    bound = "device-memory reads" if best.decode_memory >= best.decode_compute else "compute"
    where = ", ".join(f"{k} across nodes" for k, v in (("tp", best.tp_across_nodes), ("pp", best.pp_across_nodes))
                      if v)
    lines.append(f"{best.name} x {best.replicas} replica{'s' if best.replicas != 1 else ''}{' (' + where + ')' if where else ''}: "
                 f"{best.tokens_per_s:.0f} tokens/s, "
                 f"{best.decode * 1e3:.2f} ms per token ({bound} {max(best.decode_memory, best.decode_compute) * 1e3:.2f}"
                 f" + TP all-reduces {best.decode_comm * 1e3:.2f}"
                 + (f" + pipeline sends {best.decode_pp_comm * 1e3:.2f}" if best.pp > 1 else "") + f"), first token {best.ttft * 1e3:.1f} ms; "
                 f"{best.memory / GIB:.1f} GiB per rank (weights {best.weights / GIB:.1f}, KV cache "
                 f"{best.kv_cache / GIB:.1f} with {best.kv_heads_per_rank} KV heads per rank).")
    for q in plans[1:]:
        if not q.fits:
            why = f"needs {q.memory / GIB:.1f} GiB > {q.usable / GIB:.1f} GiB usable"
        elif not q.meets(target):
            why = f"{q.decode * 1e3:.2f} ms per token misses the {target:g} ms target"
        else:
            why = f"{q.tokens_per_s:.0f} tokens/s at {q.decode * 1e3:.2f} ms per token"
        lines.append(f"{q.name}: {why}.")
    return lines
