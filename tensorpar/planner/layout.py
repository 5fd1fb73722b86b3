"""A parallel layout (the thing the planner chooses), the workload it runs, the assumptions it is costed
under, and the rules that make a layout valid for a model on a cluster.

The rules live here once; enumeration, ``--evaluate`` and the explanations all use :func:`problems`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from tensorpar.planner.cluster import ClusterSpec
from tensorpar.planner.model_spec import ModelSpec
from tensorpar.planner.partition import busiest_heads, split_problems

RECOMPUTE = ("none", "selective", "full")
CP_MODES = ("ring", "all2all")
ATTENTION = ("eager", "sdpa")


@dataclass(frozen=True, order=True)
class Layout:
    """tp x pp x cp x dp devices (for a mixture of experts, ``ep`` of the dp replicas share out the experts);
    each data-parallel replica runs ``global_batch / (dp * micro_batch)``
    micro-batches of ``micro_batch`` sequences per step through a 1F1B pipeline schedule
    (interleaved over ``virtual_stages`` model chunks per stage when > 1). ``cp`` > 1: every sequence split over
    cp ranks (each holds ``seq_len / cp`` positions), attention across them by ``cp_mode`` ("ring": key/value
    blocks passed round; "all2all": Ulysses, heads exchanged for positions); tensorpar's ``--cp``/``--cp-mode``."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    sequence_parallel: bool = False
    recompute: str = "none"
    distributed_optimizer: bool = False
    virtual_stages: int = 1
    ep: int = 1  # expert parallelism (mixture of experts): experts split over ep of the dp replicas
    cp: int = 1  # context parallelism: every sequence split over cp ranks
    cp_mode: str = "ring"

    @property
    def num_devices(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def num_micro_batches(self, global_batch: int) -> int:
        """m: micro-batches per data-parallel replica per step."""
        return global_batch // (self.dp * self.micro_batch)

    def to_dict(self) -> dict:
        return asdict(self)

    def short(self) -> str:
        parts = [f"tp={self.tp}", f"pp={self.pp}", f"dp={self.dp}", f"mb={self.micro_batch}",
                 f"sp={'on' if self.sequence_parallel else 'off'}", f"recompute={self.recompute}",
                 f"distopt={'on' if self.distributed_optimizer else 'off'}"]
        if self.virtual_stages > 1:
            parts.append(f"v={self.virtual_stages}")
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if self.cp > 1:
            parts.append(f"cp={self.cp} {self.cp_mode}")
        return " ".join(parts)


@dataclass(frozen=True)
class Workload:
    """``global_batch`` sequences of ``seq_len`` tokens per optimizer step."""

    global_batch: int
    seq_len: int

    def __post_init__(self) -> None:
        for knob, flag in (("global_batch", "--global-batch"), ("seq_len", "--seq")):
            if getattr(self, knob) < 1:
                raise ValueError(f"{flag} ({getattr(self, knob)}) must be >= 1")


@dataclass(frozen=True)
class Assumptions:
    """How a layout is costed. Byte sizes per element; fractions in [0, 1].

    Defaults: bf16 weights, gradients and activations; mixed-precision Adam keeping an fp32 master copy,
    momentum and variance (12 bytes per parameter), which with 2-byte weights and gradients makes the
    16 bytes per parameter of Rajbhandari et al. 2020 (ZeRO), section 3.1. ``grad_bytes=4`` gives
    Megatron's fp32 main gradients (18 bytes per parameter).

    ``efficiency``: fraction of peak FLOP/s that a micro-batch's matmuls achieve; ``None`` takes the
    device's ``matmul_efficiency`` (see :mod:`tensorpar.planner.cluster`). ``tp_overlap``/``dp_overlap``:
    fraction of tensor-/data-parallel communication hidden behind compute (0: all of it is on the critical path). ``reserve_gib``: device memory not
    available to the model (CUDA context, communication buffers, allocator fragmentation).
    """

    activation_bytes: int = 2
    param_bytes: int = 2
    grad_bytes: int = 2
    optimizer_bytes: int = 12
    attention: str = "eager"
    efficiency: float | None = None
    tp_overlap: float = 0.0
    dp_overlap: float = 0.0
    reserve_gib: float = 4.0
    allow_cross_node_tp: bool = False
    max_micro_batch: int = 8
    virtual_stages: tuple[int, ...] = (1,)
    capacity_factor: float = 1.0  # mixture of experts: dispatched tokens per expert / its balanced share
    context_parallel: tuple[int, ...] = (1,)  # cp degrees the search tries (tensorpar plan --cp 1,2,4)

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION:
            raise ValueError(f"--attention ({self.attention!r}) must be one of {', '.join(ATTENTION)}")
        if self.efficiency is not None and not 0 < self.efficiency <= 1:
            raise ValueError(f"--efficiency ({self.efficiency}) must be in (0, 1]; measure it with --calibrate")
        for knob in ("tp_overlap", "dp_overlap"):
            if not 0 <= getattr(self, knob) <= 1:
                raise ValueError(f"--{knob.replace('_', '-')} ({getattr(self, knob)}) must be in [0, 1]")
        for knob in ("activation_bytes", "param_bytes", "grad_bytes"):
            if getattr(self, knob) not in (2, 4):
                raise ValueError(f"{knob} ({getattr(self, knob)}) must be 2 (bf16/fp16) or 4 (fp32)")
        if not 0 <= self.reserve_gib < float("inf"):
            raise ValueError(f"--reserve-gb {self.reserve_gib:.12g}: must be a finite number >= 0 (GiB per device kept "
                             f"off the model)")
        if self.max_micro_batch < 1:
            raise ValueError(f"--max-micro-batch ({self.max_micro_batch}) must be >= 1")
        if not self.capacity_factor > 0:
            raise ValueError(f"--capacity-factor ({self.capacity_factor}) must be > 0 (1: no padding)")
        if not self.virtual_stages or min(self.virtual_stages) < 1:
            raise ValueError(f"--virtual-stages {','.join(map(str, self.virtual_stages))} must list integers >= 1")
        if not self.context_parallel or min(self.context_parallel) < 1:
            raise ValueError(f"--cp {','.join(map(str, self.context_parallel))} must list integers >= 1, e.g. 1,2,4")

    def matmul_efficiency(self, device) -> float:
        """``efficiency`` if given, else the device's ``matmul_efficiency``."""
        return device.matmul_efficiency if self.efficiency is None else self.efficiency


@dataclass(frozen=True)
class Problem:
    """Why a layout is invalid: ``rule`` is a stable key for grouping, ``message`` names the fix."""

    rule: str
    message: str


def problems(layout: Layout, model: ModelSpec, cluster: ClusterSpec, work: Workload,
             assume: Assumptions) -> list[Problem]:
    """Every rule ``layout`` breaks (empty when valid). Memory is checked separately."""
    t, p, d, b, v = layout.tp, layout.pp, layout.dp, layout.micro_batch, layout.virtual_stages
    out = []

    def bad(rule: str, message: str) -> None:
        out.append(Problem(rule, message))

    for knob in ("tp", "pp", "dp", "micro_batch", "virtual_stages", "ep", "cp"):
        if getattr(layout, knob) < 1:
            bad("positive", f"{knob} ({getattr(layout, knob)}) must be >= 1")
    if out:
        return out
    c = layout.cp
    if layout.num_devices != cluster.num_devices:
        cp_text = (" x cp", f" x {c}") if c > 1 else ("", "")
        bad("devices", f"tp x pp{cp_text[0]} x dp = {t} x {p}{cp_text[1]} x {d} = {layout.num_devices} must equal "
                       f"--gpus ({cluster.num_devices}); try dp={cluster.num_devices // (t * p * c) or 1}")
    # The runtime's split rules (tensorpar.shard.split_sizes, as HeadLayout and the parallel linears use them).
    for message in split_problems(model.num_heads, model.num_kv_heads, model.ffn_hidden_size, model.vocab_size, t):
        bad("tp>heads" if "heads" in message else "split", f"tp ({t}) for {model.name}: {message}")
    if not assume.allow_cross_node_tp and (t > cluster.devices_per_node or cluster.devices_per_node % t):
        bad("tp-node", f"tp ({t}) must divide --gpus-per-node ({cluster.devices_per_node}) so that each "
                       "tensor-parallel group stays inside a node (or pass --allow-cross-node-tp)")
    if p * v > model.num_layers:
        bad("pp>layers", f"pp x virtual_stages ({p} x {v}) exceeds the {model.num_layers} layers; "
                         "every pipeline chunk needs a layer")
    if work.global_batch % (d * b):
        bad("batch", f"dp x micro_batch ({d} x {b}) must divide --global-batch ({work.global_batch})")
    elif v > 1 and layout.num_micro_batches(work.global_batch) % p:
        bad("interleave", f"interleaving (virtual_stages={v}) needs the {layout.num_micro_batches(work.global_batch)} "
                          f"micro-batches per step to be a multiple of pp ({p})")
    if v > 1 and p == 1:
        bad("interleave", f"virtual_stages ({v}) > 1 needs pp > 1")
    if layout.sequence_parallel and t == 1:
        bad("no-op", "sequence_parallel has no effect at tp=1; set sequence_parallel=false")
    if layout.sequence_parallel and work.seq_len % t:
        bad("seq%tp", f"sequence parallelism needs tp ({t}) to divide --seq ({work.seq_len})")
    if layout.recompute not in RECOMPUTE:
        bad("recompute", f"recompute ({layout.recompute!r}) must be one of {', '.join(RECOMPUTE)}")
    elif layout.recompute == "selective" and assume.attention == "sdpa":
        bad("no-op", "recompute=selective has no effect with --attention sdpa (a fused attention kernel "
                     "stores no score matrix); use recompute=none")
    if layout.ep > 1:
        if not model.is_moe:
            bad("no-op", f"ep ({layout.ep}) needs a mixture-of-experts model; {model.name} is dense; set ep=1")
        elif model.num_experts % layout.ep:
            bad("ep", f"ep ({layout.ep}) must divide the {model.num_experts} experts of {model.name}")
        if d % layout.ep:
            bad("ep", f"ep ({layout.ep}) must divide dp ({d}): expert-parallel groups are made of dp replicas")
    out += [Problem(rule, message) for rule, message in cp_problems(layout, model, work, assume)]
    if layout.distributed_optimizer and d == 1:
        bad("no-op", "distributed_optimizer has no effect at dp=1; set distributed_optimizer=false")
    return out


def cp_problems(layout: Layout, model: ModelSpec, work: Workload, assume: Assumptions) -> list[tuple[str, str]]:
    """``(rule, message)`` for each context-parallel rule ``layout`` breaks: tensorpar's
    (:func:`tensorpar.train.config.check_cp_layout`, :func:`tensorpar.layers.ring_attention.check_all2all_heads`)."""
    c, t = layout.cp, layout.tp
    out = []
    if layout.cp_mode not in CP_MODES:
        out.append(("cp_mode", f"cp_mode ({layout.cp_mode!r}) must be one of {', '.join(CP_MODES)}"))
    if c == 1:
        return out
    n = 2 * c * (t if layout.sequence_parallel else 1)
    if work.seq_len % n:
        out.append(("seq%cp", f"cp ({c}) needs --seq ({work.seq_len}) divisible by 2 x cp"
                              f"{' x tp' if layout.sequence_parallel else ''} = {n} (two chunks per cp rank)"))
    if layout.ep > 1:
        out.append(("cp-ep", f"cp ({c}) does not run with ep ({layout.ep}) in tensorpar; use cp=1 or ep=1"))
    if layout.recompute == "selective":
        out.append(("no-op", "recompute=selective has no effect at cp > 1 (ring and all2all attention store no "
                             "score matrix); use recompute=none"))
    if layout.cp_mode == "all2all":
        heads = busiest_heads(model.num_heads, model.num_kv_heads, t).q
        if heads % c:
            out.append(("all2all", f"cp_mode=all2all needs the query heads of each tp rank ({heads} at tp={t}) "
                                   f"divisible by cp ({c}); use cp_mode=ring"))
    return out


_BOOL = {"1": True, "true": True, "on": True, "yes": True, "0": False, "false": False, "off": False, "no": False}


def parse_layout(text: str, num_devices: int) -> Layout:
    """``"tp=8,pp=4,dp=32,micro_batch=2,sequence_parallel=on,recompute=selective"`` -> Layout.

    tp and pp are required; dp defaults to ``num_devices / (tp * pp)``, micro_batch to 1, the switches to off.
    Raises ValueError (naming the item) for an empty spec, an unknown or repeated key, an integer below 1 or
    an unreadable switch.
    """
    names = {f.name: f for f in fields(Layout)}
    values: dict = {}
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise ValueError(f"--evaluate {text!r} is empty; give a layout such as tp=8,pp=1 (tp and pp required)")
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in names:
            raise ValueError(f"--evaluate item {item!r} is not key=value with key one of {', '.join(names)}")
        if key in values:
            raise ValueError(f"--evaluate {text}: {key} is given twice; give each key once, e.g. tp=8,pp=1")
        raw = raw.strip().lower()
        if names[key].type in ("int", int):
            if not raw.isdigit():
                raise ValueError(f"--evaluate {key}={raw}: must be a positive integer (>= 1)")
            if int(raw) < 1:
                raise ValueError(f"--evaluate {key}={raw}: must be >= 1 ({key}=1 when that dimension is not split, "
                                 f"e.g. tp=8,pp=1)")
            values[key] = int(raw)
        elif names[key].type in ("bool", bool):
            if raw not in _BOOL:
                raise ValueError(f"--evaluate {key} ({raw!r}) must be on/off, true/false or 1/0")
            values[key] = _BOOL[raw]
        else:
            values[key] = raw
    for required in ("tp", "pp"):
        if required not in values:
            raise ValueError(f"--evaluate needs {required}=N (got {text!r})")
    values.setdefault("dp", max(1, num_devices // (values["tp"] * values["pp"] * values.get("cp", 1))))
    values.setdefault("micro_batch", 1)
    return Layout(**values)
