"""Per-device memory of a layout: weights, gradients, optimizer states and stored activations.

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4: count every tensor autograd keeps for the backward pass, at ``e`` bytes per element
(2 in bf16) and 1 byte per dropout-mask element. For a GPT layer run by Megatron kernels this gives
their Table 2 exactly, per layer and micro-batch (s sequence, b micro-batch, h hidden, a heads, t tp)::

    no parallelism                  sbh (34 + 5as/h)
    tensor parallel                 sbh (10 + 24/t + 5as/(ht))
    tensor + sequence parallel      sbh (34/t + 5as/(ht))
    ... + selective recomputation   sbh (34/t)            (the 5as/h score term is recomputed)
    full recomputation              2sbh (/t with sequence parallelism)

The same counting, applied to other architectures (SwiGLU, RMSNorm, grouped-query attention) and to
Hugging Face modeling code, is checked against autograd's saved tensors in tests/planner/test_planner_activations.py.

Pipeline parallelism (section 4.3): under 1F1B the first stage holds ``p`` micro-batches in flight, so it
stores the activations of ``L`` layers; interleaving over ``v`` chunks raises that to ``L (1 + (p-1)/(pv))``.
Embedding and output-layer terms (section 4.4): the embedding dropout mask (first stage), and the final
norm input, output-layer input and fp32 logits, ``4sbh/t (1 + V/h)`` with sequence parallelism (last stage).

Context parallelism (``cp`` > 1, tensorpar's ``--cp``): each rank runs the whole model on ``s / cp`` positions, so
every term above is that of a sequence ``s / cp`` long (the logits, rotary tables and embedding included), and
attention is ring or all2all, neither of which stores a score matrix: its terms are the fused kernel's (q, k, v,
output, log-sum-exp per head and row), whatever ``attention`` says, plus a copy of the output (and under all2all
K and V at the query heads; :func:`cp_attention_extra_bytes`). So the
activations of a rank at cp are a little over ``1/cp`` of cp = 1's with a fused kernel (less than that with eager
attention at cp = 1).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from tensorpar.planner.layout import Assumptions, Layout, Workload
from tensorpar.planner.model_spec import ModelSpec
from tensorpar.planner.partition import RankHeads, busiest_heads, max_ffn_columns, max_vocab_rows, stage_layers

GIB = 2 ** 30


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes held by the busiest device of a layout (the pipeline stage needing the most memory)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    stage: int
    activation_terms: dict = field(default_factory=dict, compare=False)

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations

    def gib(self) -> dict:
        """The breakdown in GiB, rounded for reports."""
        parts = {"weights": self.weights, "gradients": self.gradients, "optimizer": self.optimizer,
                 "activations": self.activations, "total": self.total}
        return {k: round(v / GIB, 3) for k, v in parts.items()}


def _norm_bytes_per_element(model: ModelSpec, e: int) -> int:
    """Bytes a norm layer stores per input element. Fused LayerNorm/RMSNorm kernels and torch's
    layer_norm keep the input (e); Hugging Face's RMSNorm also keeps an fp32 copy of the input and the
    normalised result (4 + e; in fp32 the "copy" is the input itself)."""
    return 4 + e if (model.kernels == "hf" and model.norm == "rmsnorm") else e


def _norm_stats_bytes(model: ModelSpec, tokens: float) -> float:
    """Hugging Face's RMSNorm keeps the fp32 inverse root-mean-square, 4 bytes per token."""
    return 4 * tokens if (model.kernels == "hf" and model.norm == "rmsnorm") else 0.0


def layer_activation_terms(model: ModelSpec, heads: RankHeads, *, micro_batch: int, seq_len: int, tp: int,
                           sequence_parallel: bool, recompute: str, assume: Assumptions) -> dict[str, float]:
    """Bytes one layer stores for one micro-batch on a rank holding ``heads``, by tensor.

    Replicated regions (norms, residual dropout) are split ``tp`` ways under sequence parallelism. The
    inputs of the column-parallel linears are split too: Megatron kernels and tensorpar
    (:func:`tensorpar.layers.linear.column_parallel_linears`) keep the sequence shard and all-gather it
    again in backward (Korthikanti et al. 2022, section 4.2.2). The attention and MLP interiors are split by heads and ffn
    columns. Eager attention stores the score matrix; a fused kernel ("sdpa") a logsumexp per head and
    row. K and V are stored at the rank's query-head count when eager HF attention repeats grouped KV
    heads, or when a GQA group straddles ranks (tensorpar then gathers KV heads per query head); with a
    fused kernel and uniform local groups they stay compact (sdpa's ``enable_gqa``).
    """
    e, s, b, h, d = assume.activation_bytes, seq_len, micro_batch, model.hidden_size, model.head_dim
    tokens = b * s
    split = tp if sequence_parallel else 1
    rep = tokens * h / split  # elements of one replicated [s, b, h] tensor on this rank
    if recompute == "full":  # only the layer input is kept; the layer is re-run in backward
        return {"layer input (checkpoint)": e * rep}

    hf = model.kernels == "hf"
    linear_in = rep  # input of the column-parallel linears, as saved: the sequence shard under SP
    ffn = max_ffn_columns(model.ffn_hidden_size, tp)
    mlp_tensors = 2 if model.mlp == "gelu" else (4 if hf else 3)
    if hf:  # HF eager repeats KV heads; sdpa broadcasts them (enable_gqa) unless tensorpar gathered them per head
        kv_width = heads.kv if (assume.attention != "eager" and heads.uniform) else heads.q
    else:
        kv_width = heads.q if assume.attention == "eager" else heads.kv
    terms = {
        "norm inputs": 2 * (_norm_bytes_per_element(model, e) * rep + _norm_stats_bytes(model, tokens / split)),
        "attention input": e * linear_in,
        "mlp input": e * linear_in,
        "q, k, v": e * tokens * d * (heads.q + 2 * kv_width),
        "attention output": e * tokens * d * heads.q,
        # GeLU: fc1 output and GeLU output; SwiGLU: gate and up outputs (+ silu output and product in HF)
        "mlp interior": mlp_tensors * e * tokens * model.active_ffn(ffn),
    }
    if model.dropout:
        terms["residual dropout masks"] = 2 * rep
    if hf and heads.kv < heads.q and not heads.uniform:  # tensorpar's per-head KV gather keeps its int64 index
        terms["kv expansion index"] = 2 * 8 * heads.q
    if assume.attention == "eager":
        softmax = (4 + (e if e != 4 else 0)) if hf else e  # HF: fp32 softmax, then a copy in e bytes
        dropout = (1 + e) if model.dropout else 0  # mask and dropped-out probabilities
        if recompute != "selective":
            terms["attention scores"] = (softmax + dropout) * b * heads.q * s * s
    else:
        terms["attention logsumexp"] = 4 * b * heads.q * s
    return terms


def embedding_activation_bytes(model: ModelSpec, *, micro_batch: int, seq_len: int, tp: int,
                               sequence_parallel: bool, assume: Assumptions) -> dict[str, float]:
    """First-stage bytes per micro-batch outside the layers: the token ids the embedding keeps and the
    embedding dropout mask (Korthikanti section 4.4, sbh/t with sequence parallelism)."""
    tokens = micro_batch * seq_len
    terms = {"token ids": 8 * tokens} if model.kernels == "hf" else {}
    if model.dropout:
        terms["embedding dropout mask"] = tokens * model.hidden_size / (tp if sequence_parallel else 1)
    return terms


def output_activation_bytes(model: ModelSpec, *, micro_batch: int, seq_len: int, tp: int,
                            sequence_parallel: bool, assume: Assumptions) -> dict[str, float]:
    """Last-stage bytes per micro-batch after the layers: final norm input, output-layer input and the
    fp32 softmax kept by the vocabulary-parallel cross-entropy, 4sbh/t (1 + V/h) in Korthikanti section
    4.4 (with sequence parallelism). tensorpar's cross-entropy also keeps per-token target indices (int64)
    and two boolean masks; its output layer, like Megatron's, keeps the sequence shard of its input."""
    e, tokens = assume.activation_bytes, micro_batch * seq_len
    split = tp if sequence_parallel else 1
    rep = tokens * model.hidden_size / split
    hf = model.kernels == "hf"
    terms = {
        "final norm input": _norm_bytes_per_element(model, e) * rep + _norm_stats_bytes(model, tokens / split),
        "output layer input": e * rep,
        "logits (fp32)": 4 * tokens * max_vocab_rows(model.vocab_size, tp),
    }
    if hf:
        terms["cross-entropy targets"] = (8 + 2) * tokens
    return terms


def cp_shape(layout: Layout, work: Workload, assume: Assumptions) -> tuple[int, Assumptions]:
    """``(positions per rank, assumptions)`` of a layout's activations: ``seq_len / cp`` and, at cp > 1, a fused
    attention (ring and all2all keep no scores)."""
    if layout.cp == 1:
        return work.seq_len, assume
    return work.seq_len // layout.cp, replace(assume, attention="sdpa")


def cp_attention_extra_bytes(model: ModelSpec, heads: RankHeads, layout: Layout, *, micro_batch: int, seq_len: int,
                             assume: Assumptions) -> dict[str, float]:
    """What cp attention keeps beyond a fused kernel's terms, per layer (``seq_len``: positions per rank; measured by
    bench/bench_cp.py to the byte). Both modes keep their own output ``[b, h, s/cp, d]`` apart from the output
    projection's input (a fused kernel at cp = 1 writes its output in the layout the projection reads, so there the
    two are one tensor): fp32 in the ring, the activation dtype under all2all. all2all also keeps its two int64
    position orders of the whole sequence, and K and V repeated to the query heads when cp does not divide the KV
    heads (they are repeated before the exchange)."""
    if layout.cp == 1:
        return {}
    e, tokens, d = assume.activation_bytes, micro_batch * seq_len, model.head_dim
    if layout.cp_mode == "ring":
        return {"ring attention output (fp32)": 4 * tokens * d * heads.q}
    return {"all2all attention output": e * tokens * d * heads.q,
            "all2all repeated k, v": 2 * e * tokens * d * (heads.q - heads.kv) if heads.kv % layout.cp else 0.0,
            "all2all position orders": 2 * 8 * seq_len * layout.cp}


def rotary_bytes(model: ModelSpec, *, seq_len: int, assume: Assumptions) -> float:
    """HF computes cos and sin tables once per forward and every layer keeps them: 2 s d e bytes."""
    if model.kernels != "hf" or model.learned_positions:
        return 0.0
    return 2 * seq_len * model.head_dim * assume.activation_bytes


def in_flight(stage: int, pp: int, virtual_stages: int, num_micro_batches: int) -> float:
    """Micro-batches whose activations stage ``stage`` holds at its peak, in units of the stage's layers.

    1F1B (Narayanan et al. 2021, section 2.2.1): stage i runs ``p - i`` forwards before its first
    backward, so it holds ``min(p - i, m)`` micro-batches. Interleaved 1F1B (section 2.2.2, Megatron's
    warm-up of ``2 (p - i - 1) + (v - 1) p`` chunks): ``min(2 (p - i - 1) + (v - 1) p + 1, m v)`` chunks of
    ``1/v`` of the stage's layers; for the first stage that is ``p (1 + (p - 1)/(p v))``, Korthikanti's factor.
    """
    if virtual_stages == 1:
        return float(min(pp - stage, num_micro_batches))
    chunks = min(2 * (pp - stage - 1) + (virtual_stages - 1) * pp + 1, num_micro_batches * virtual_stages)
    return chunks / virtual_stages


def stage_params(model: ModelSpec, layout: Layout) -> list[int]:
    """Parameters held by the busiest tensor-parallel rank of each pipeline stage.

    Stage 0 adds the word embedding (its vocabulary shard) and any learned position table; the last stage
    adds the final norm and the output layer (its own weights, or with tied embeddings and pp > 1 the
    copy of the embedding that Megatron keeps there).
    """
    t, p = layout.tp, layout.pp
    heads = busiest_heads(model.num_heads, model.num_kv_heads, t)
    per_layer = model.layer_params(heads.q, heads.kv, max_ffn_columns(model.ffn_hidden_size, t), layout.ep)
    vocab = model.embedding_params(max_vocab_rows(model.vocab_size, t))
    out = []
    for i, layers in enumerate(stage_layers(model.num_layers, p, layout.virtual_stages)):
        params = layers * per_layer
        if i == 0:
            params += vocab + model.learned_positions * model.hidden_size
        if i == p - 1:
            params += model.norm_params() + (vocab if (not model.tied_embeddings or p > 1) else 0)
        out.append(params)
    return out


def stage_expert_params(model: ModelSpec, layout: Layout) -> list[float]:
    """Routed-expert parameters (part of :func:`stage_params`) of the busiest rank of each stage."""
    per_layer = model.expert_params(max_ffn_columns(model.ffn_hidden_size, layout.tp), layout.ep)
    return [layers * per_layer for layers in stage_layers(model.num_layers, layout.pp, layout.virtual_stages)]


class _Stages:
    """Per-stage memory of one layout; the per-layer and per-micro-batch terms are computed once."""

    def __init__(self, model: ModelSpec, layout: Layout, work: Workload, assume: Assumptions) -> None:
        t, self.p, self.v = layout.tp, layout.pp, layout.virtual_stages
        heads = busiest_heads(model.num_heads, model.num_kv_heads, t)
        self.m = layout.num_micro_batches(work.global_batch)
        seq, assume = cp_shape(layout, work, assume)   # positions per rank; fused attention at cp > 1
        shape = dict(micro_batch=layout.micro_batch, seq_len=seq, tp=t,
                     sequence_parallel=layout.sequence_parallel)
        self.per_layer = layer_activation_terms(model, heads, recompute=layout.recompute, assume=assume, **shape)
        if layout.recompute != "full":
            self.per_layer.update(cp_attention_extra_bytes(model, heads, layout, micro_batch=layout.micro_batch,
                                                           seq_len=seq, assume=assume))
        self.working_set = 0.0
        if layout.recompute == "full":  # one layer's activations are rebuilt at a time during backward
            self.working_set = sum(layer_activation_terms(model, heads, recompute="none", assume=assume,
                                                          **shape).values())
        self.first = embedding_activation_bytes(model, assume=assume, **shape)
        self.last = output_activation_bytes(model, assume=assume, **shape)
        self.rotary = rotary_bytes(model, seq_len=seq, assume=assume)
        self.layers = stage_layers(model.num_layers, self.p, self.v)
        self.params = stage_params(model, layout)
        self.experts = stage_expert_params(model, layout)
        # The distributed optimizer shards dense state over dp and expert state over the dp / ep replicas
        # that hold the same experts.
        dense_share, expert_share = ((layout.dp, layout.dp // layout.ep) if layout.distributed_optimizer else (1, 1))
        self.state_bytes = (assume.param_bytes, assume.grad_bytes)
        self.optimizer_shares = (assume.optimizer_bytes / dense_share, assume.optimizer_bytes / expert_share)
        self.sums = (sum(self.per_layer.values()), sum(self.first.values()), sum(self.last.values()))

    def total(self, i: int) -> float:
        flight = in_flight(i, self.p, self.v, self.m)
        layer, first, last = self.sums
        activations = (flight * (self.layers[i] * layer + self.rotary + (first if i == 0 else 0.0))
                       + self.working_set + (last if i == self.p - 1 else 0.0))
        return self.params[i] * sum(self.state_bytes) + self.optimizer(i) + activations

    def optimizer(self, i: int) -> float:
        dense, expert = self.optimizer_shares
        return (self.params[i] - self.experts[i]) * dense + self.experts[i] * expert

    def breakdown(self, i: int) -> MemoryBreakdown:
        flight = in_flight(i, self.p, self.v, self.m)
        terms = {name: flight * self.layers[i] * value for name, value in self.per_layer.items()}
        if self.working_set:
            terms["recompute working set"] = self.working_set
        if self.rotary:
            terms["rotary tables"] = flight * self.rotary
        if i == 0:
            terms.update({name: flight * value for name, value in self.first.items()})
        if i == self.p - 1:
            terms.update(self.last)  # 1F1B: the last stage finishes each micro-batch before the next
        w, g = (self.params[i] * b for b in self.state_bytes)
        o = self.optimizer(i)
        return MemoryBreakdown(weights=w, gradients=g, optimizer=o, activations=sum(terms.values()), stage=i,
                               activation_terms=terms)


def stage_memory(model: ModelSpec, layout: Layout, work: Workload, assume: Assumptions) -> list[MemoryBreakdown]:
    """Memory of the busiest tensor-parallel rank of every pipeline stage."""
    stages = _Stages(model, layout, work, assume)
    return [stages.breakdown(i) for i in range(layout.pp)]


def memory_per_device(model: ModelSpec, layout: Layout, work: Workload, assume: Assumptions) -> MemoryBreakdown:
    """The breakdown of the stage that needs the most memory (ties: the earliest stage)."""
    stages = _Stages(model, layout, work, assume)
    return stages.breakdown(max(range(layout.pp), key=lambda i: (stages.total(i), -i)))


def usable_bytes(memory_gib: float, assume: Assumptions) -> float:
    return (memory_gib - assume.reserve_gib) * GIB


def check_memory_left(memory_gib: float, reserve_gib: float, source: str, reserve_default: bool = False,
                      reserve_flag: str | None = "--reserve-gb") -> None:
    """Raise ValueError where a device's memory (``memory_gib``, GiB, given by ``source``: the flag or file that set
    it) is not more than the memory kept off the model (``reserve_gib``: ``reserve_flag``'s value, or a fixed reserve
    where ``reserve_flag`` is None): every layout would show negative usable memory (:func:`usable_bytes`)."""
    if memory_gib > reserve_gib:
        return
    r = f"{reserve_gib:.12g}"
    after = (f"{reserve_flag} {r}{' (its default)' if reserve_default else ''}" if reserve_flag
             else f"the {r} GiB per rank kept off the model")
    raise ValueError(f"{source} {memory_gib:.12g} GiB leaves no memory for the model after {after}; give more than "
                     f"{r} GiB per device" + (f" or a smaller {reserve_flag}" if reserve_flag else ""))
