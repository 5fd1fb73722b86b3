"""Planning one tensor-parallel group over unequal devices (``tensorpar plan --devices a100-80gb:4,v100-32gb:4``).

Each device's speed is its matmul rate (``peak_tflops x matmul_efficiency``); the weights are those speeds and
every sharded dimension (query heads, MLP / expert columns, vocabulary rows) is split with them by the rule the
runtime uses, :func:`tensorpar.shard.split_sizes` (through :meth:`tensorpar.layers.attention.HeadLayout.make`
for heads, so the KV heads each rank holds, duplicates included, are the runtime's too). For each rank the
model counts the parameters it holds and the forward FLOPs per token it computes (``2 x`` its matrix
parameters, the attention scores left out), then:

- time per token of a split = ``max_r(flops_r / speed_r)`` (the ranks meet at every all-reduce, so the
  slowest sets the pace; collectives are not modelled here),
- the bound = ``total flops / sum(speeds)`` (the summed speed of the group), and the split's efficiency =
  bound / time,
- memory per rank = its parameters x ``bytes_per_param`` against the device's memory.

Even and weighted splits are reported side by side. Devices in one tp group should share a node (tp traffic
runs every layer); this model does not check links.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tensorpar.planner import cluster as cl
from tensorpar.planner.model_spec import ModelSpec
from tensorpar.shard import split_sizes

GIB = 2 ** 30


def parse_devices(text: str) -> list[cl.DeviceSpec]:
    """Devices of ``--devices``: ``NAME[:COUNT],...`` of presets (``a100-80gb:4,v100-32gb:4``), or a JSON list
    (inline or a ``.json`` file) whose items are preset names or objects with the fields of
    :class:`~tensorpar.planner.cluster.DeviceSpec` (at least ``name``, ``memory_gib``, ``peak_tflops``).

    Raises ValueError naming the entry and the presets."""
    text = text.strip()
    items: list = []
    if text.startswith("[") or text.endswith(".json"):
        try:
            items = json.loads(Path(text).read_text() if text.endswith(".json") else text)
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"--devices {text[:60]}: cannot read a JSON list of devices ({err})") from None
        if not isinstance(items, list) or not items:
            raise ValueError(f"--devices {text[:60]}: expected a non-empty JSON list of devices")
    else:
        for part in text.split(","):
            name, _, count = part.strip().partition(":")
            try:
                n = int(count) if count else 1
            except ValueError:
                n = 0
            if n < 1:
                raise ValueError(f"--devices entry {part.strip()!r}: the count after ':' must be a positive integer")
            items += [name] * n
    out = []
    for k, it in enumerate(items):
        if isinstance(it, str):
            if it not in cl.DEVICES:
                raise ValueError(f"--devices: {it!r} is not a device preset; use {', '.join(cl.DEVICES)}, or a JSON "
                                 f"list of objects with name, memory_gib and peak_tflops")
            out.append(cl.DEVICES[it])
        elif isinstance(it, dict):
            fields = {"intra_node_gbps": 1.0, "inter_node_gbps": 1.0, **it}
            out.append(cl.device_from_dict(fields, f"--devices item {k} ({str(it.get('name', '?'))[:30]})"))
        else:
            raise ValueError(f"--devices: {it!r} is neither a preset name nor a device object")
    return out


@dataclass(frozen=True)
class RankShare:
    device: str
    speed_tflops: float
    weight: float
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    params: int
    flops_per_token: float
    memory_gib: float
    capacity_gib: float

    @property
    def fits(self) -> bool:
        return self.memory_gib <= self.capacity_gib

    @property
    def seconds_per_token(self) -> float:
        return self.flops_per_token / (self.speed_tflops * 1e12)


@dataclass(frozen=True)
class SplitPlan:
    """One split of the model over the devices: per-rank shares, the time per token (the slowest rank), the
    summed-speed bound and the efficiency (bound / time)."""

    label: str
    ranks: tuple[RankShare, ...]
    bound_s: float

    @property
    def time_s(self) -> float:
        return max(r.seconds_per_token for r in self.ranks)

    @property
    def efficiency(self) -> float:
        return self.bound_s / self.time_s

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.ranks)

    def to_json(self) -> dict:
        return {"split": self.label, "time_per_token_s": self.time_s, "bound_s": self.bound_s,
                "efficiency": self.efficiency, "fits": self.fits,
                "ranks": [dict(vars(r), fits=r.fits, seconds_per_token=r.seconds_per_token) for r in self.ranks]}


def _shares(model: ModelSpec, devices, weights, bytes_per_param: float) -> list[RankShare]:
    from tensorpar.layers.attention import HeadLayout

    tp = len(devices)
    lay = HeadLayout.make(model.num_heads, model.num_kv_heads, model.head_dim, tp, split_weights=weights)
    ffn = split_sizes(model.ffn_hidden_size, tp, weights=weights, name="ffn_hidden_size")
    vocab = split_sizes(model.vocab_size, tp, weights=weights, name="vocab_size")
    shared = split_sizes(model.shared_ffn, tp, weights=weights, name="shared_ffn") if model.shared_ffn else [0] * tp
    h, hd, L = model.hidden_size, model.head_dim, model.num_layers
    mats = 3 if model.mlp == "swiglu" else 2
    experts = max(model.num_experts, 1)
    active = model.experts_per_token if model.num_experts else 1
    out = []
    for r, dev in enumerate(devices):
        q, kv = lay.local_heads(r), lay.local_kv_heads(r)
        attn = 2 * h * q * hd + 2 * h * kv * hd
        mlp_held = mats * h * ffn[r] * experts + 3 * h * shared[r]
        mlp_run = mats * h * ffn[r] * active + 3 * h * shared[r]
        emb = vocab[r] * h * (1 if model.tied_embeddings else 2)
        params = L * (attn + mlp_held + 2 * h) + emb + h
        flops = 2.0 * (L * (attn + mlp_run) + vocab[r] * h)
        speed = dev.peak_tflops * dev.matmul_efficiency
        out.append(RankShare(dev.name, speed, 1.0 if weights is None else float(weights[r]), q, kv, ffn[r],
                             vocab[r], params, flops, params * bytes_per_param / GIB, dev.memory_gib))
    return out


def plan_weighted(model: ModelSpec, devices: list[cl.DeviceSpec], *, bytes_per_param: float = 2.0
                  ) -> list[SplitPlan]:
    """The even and the speed-weighted split of ``model`` over one tp group of ``devices``.

    ``bytes_per_param``: 2 for bf16 inference weights; about 16 for mixed-precision Adam training (weights,
    gradients, fp32 master and two moments). Raises the ValueErrors of the split rule (too many ranks for
    the heads; weights that leave a rank no head, naming weights that work)."""
    speeds = [d.peak_tflops * d.matmul_efficiency for d in devices]
    weights = tuple(round(s / max(speeds), 3) for s in speeds)
    plans = []
    for label, w in (("even", None), ("weighted " + ",".join(f"{x:g}" for x in weights), weights)):
        ranks = _shares(model, devices, w, bytes_per_param)
        total = sum(r.flops_per_token for r in _shares(model, devices[:1], None, bytes_per_param))
        plans.append(SplitPlan(label, tuple(ranks), total / (sum(speeds) * 1e12)))
    return plans


def report(model: ModelSpec, plans: list[SplitPlan], bytes_per_param: float) -> list[str]:
    lines = [f"{model.name} over one tp group of {len(plans[0].ranks)} devices "
             f"({', '.join(r.device for r in plans[0].ranks)}), {bytes_per_param:g} bytes/param; compute only "
             f"(collectives not modelled): time per token = the slowest rank; bound = summed speed"]
    for p in plans:
        lines.append(f"\n{p.label}: {p.time_s * 1e3:.3f} ms/token (forward), bound {p.bound_s * 1e3:.3f} ms, "
                     f"efficiency {p.efficiency:.0%}{'' if p.fits else ', DOES NOT FIT in memory'}")
        lines.append(f"  {'rank':>4} {'device':<12} {'TFLOP/s':>8} {'weight':>6} {'heads':>5} {'kv':>3} {'ffn':>6} "
                     f"{'vocab':>7} {'GiB':>7} {'of':>6} {'ms/token':>9}")
        for i, r in enumerate(p.ranks):
            lines.append(f"  {i:>4} {r.device:<12} {r.speed_tflops:>8.1f} {r.weight:>6g} {r.heads:>5} {r.kv_heads:>3} "
                         f"{r.ffn:>6} {r.vocab:>7} {r.memory_gib:>7.2f} {r.capacity_gib:>6.1f} "
                         f"{r.seconds_per_token * 1e3:>9.3f}" + ("" if r.fits else "  too big"))
    return lines
