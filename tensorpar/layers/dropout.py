"""Dropout whose masks are the same at every tensor-parallel degree.

Megatron-LM keeps two RNG streams (a "default" one equal on all tp ranks for replicated regions, a
"model-parallel" one seeded per rank for sharded regions); with per-rank seeds the gathered mask of a
sharded region depends on tp, so tp = 1 and tp = 2 train differently. Here no mask comes from the global
RNG. Each is drawn from a ``torch.Generator`` seeded by a hash of ``(seed, step, micro-step, layer,
site, unit)`` (:class:`DropoutRNG`), so

* replicated regions (a block's output ``[b, s, h]``, identical on every rank): every rank seeds the same
  generator and draws the same full mask;
* sequence-parallel regions (``[b, s_r, h]``): the full ``[b, s, h]`` mask is drawn and the rank keeps its
  sequence slice, so the gathered mask is the tp = 1 mask (the draw is repeated on each rank: cheap next
  to the matmuls, and it needs no communication);
* sharded regions (attention probabilities ``[b, heads_r, s, s]``): one generator per *global* head index;
  a rank draws the masks of its own heads only, so the gathered mask is the tp = 1 mask;
* recomputation in backward draws the same masks again (the key does not change within a step), and a
  data loader or anything else that consumes global random numbers on some ranks cannot desynchronise
  the ranks.

The same holds whichever loop trains the model: :func:`tensorpar.hf.apply.parallelize` replaces every
``nn.Dropout`` by a :class:`KeyedDropout` (keyed by its module name) and gives attention modules the
head-keyed kernel; each training-mode forward of the root model advances the generator's forward count
(:meth:`DropoutRNG.next_forward`), so successive forwards of a user's own loop draw new masks while a
recomputed block (which is not a root forward) draws the same ones.
"""
from __future__ import annotations

import hashlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from tensorpar.comm import Group


class DropoutRNG:
    """Keyed generators for dropout masks; the trainer sets the step before each forward.

    Attributes:
        seed: the run's seed. step, micro: the optimiser step and micro-batch being computed.
    """

    def __init__(self, seed: int):
        self.seed = int(seed)
        self.step = 0
        self.micro = 0
        self.forward = 0

    def set_step(self, step: int, micro: int = 0) -> None:
        """Key the next masks by optimiser step and micro-batch (the trainer's way); resets the forward count."""
        self.step, self.micro, self.forward = int(step), int(micro), 0

    def next_forward(self) -> None:
        """Called before each training-mode forward of the root model: the next masks are new ones."""
        self.forward += 1

    def generator(self, device: torch.device, *key) -> torch.Generator:
        """A fresh generator on ``device`` seeded from ``(seed, step, micro, forward, *key)`` (same on every platform)."""
        text = ":".join(str(k) for k in (self.seed, self.step, self.micro, self.forward, *key))
        s = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)
        return torch.Generator(device=device).manual_seed(s)


def keep_mask(gen: torch.Generator, shape, p: float, device) -> torch.Tensor:
    """Bernoulli(1 - p) keep mask of ``shape`` (bool), drawn from ``gen``."""
    return torch.rand(shape, generator=gen, device=device) >= p


class KeyedDropout(nn.Module):
    """Dropout whose mask is drawn from a generator keyed by ``key`` (a module name, or layer and site).

    Shapes: any ``[b, s, ...]`` replicated over tp (every rank draws the same mask), or ``[b, s_r, ...]``
    with ``sequence_parallel`` (``s_r = s / tp``, the even split of
    :func:`tensorpar.comm.scatter_to_sequence_region`: the full mask is drawn and the rank keeps its slice).
    With a context-parallel group ``cp`` (set by :func:`install_dropout`) the rank holds the positions
    :func:`tensorpar.layers.ring_attention.cp_positions` of the ``cp`` times longer sequence (then its
    sequence-parallel slice of them): the mask of the whole sequence is drawn and those positions are kept, so
    the masks are the same at every cp. No collectives. Identity in eval.
    """

    def __init__(self, p: float, rng: DropoutRNG, key, tp: Group, *, sequence_parallel: bool = False):
        super().__init__()
        self.p, self.rng, self.key = p, rng, key if isinstance(key, tuple) else (key,)
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.cp: Group | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        full = list(x.shape)
        cp = self.cp.size if self.cp is not None else 1
        if self.sequence_parallel:
            full[1] = x.shape[1] * self.tp.size
        full[1] *= cp
        mask = keep_mask(self.rng.generator(x.device, *self.key), full, self.p, x.device)
        if cp > 1:
            from tensorpar.layers.ring_attention import cp_positions
            mask = mask.index_select(1, cp_positions(full[1], cp, self.cp.rank, device=x.device))
        if self.sequence_parallel:
            mask = mask.narrow(1, self.tp.rank * x.shape[1], x.shape[1])
        return x * mask.to(x.dtype) / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, key={self.key}, sequence_parallel={self.sequence_parallel}"


class HiddenDropout(KeyedDropout):
    """Dropout on a block's attention or MLP output, before the residual add (Megatron's "hidden dropout"),
    keyed by ``(layer_idx, site)``. Shapes: ``[b, s, h]`` replicated, or ``[b, s_r, h]`` with
    ``sequence_parallel``. No collectives."""

    def __init__(self, p: float, rng: DropoutRNG, layer_idx: int, site: str, tp: Group, *,
                 sequence_parallel: bool = False):
        super().__init__(p, rng, (layer_idx, site), tp, sequence_parallel=sequence_parallel)
        self.layer_idx, self.site = layer_idx, site


class HeadKeyedAttention:
    """Attention kernel with dropout masks keyed by global head index; set as ``TPAttention.attention_fn``.

    Call signature of transformers' attention functions: ``(module, q, k, v, attention_mask, dropout,
    scaling, **kw)`` with ``q`` ``[b, heads_r, s, d]`` and ``k, v`` either expanded to the local query heads
    or ``[b, kv_r, s_kv, d]`` with each KV head serving ``heads_r / kv_r`` consecutive query heads (the
    uniform-group case of :class:`~tensorpar.hf.modules.TPAttention`); returns ``([b, s, heads_r, d], None)``.
    Softmax in fp32. With ``dropout == 0`` (or in eval) it is plain causal attention. Head ``j`` of rank
    ``r`` is global head ``module.layout.q_heads.range(r)[0] + j``.
    """

    def __init__(self, rng: DropoutRNG):
        self.rng = rng

    def __call__(self, module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
        b, nh, s, d = query.shape
        if key.shape[1] != nh:  # grouped KV heads: give each query head its KV head
            key = key.repeat_interleave(nh // key.shape[1], dim=1)
            value = value.repeat_interleave(nh // value.shape[1], dim=1)
        s_kv = key.shape[2]
        scaling = d ** -0.5 if scaling is None else scaling
        scores = torch.matmul(query, key.transpose(2, 3)) * scaling                       # [b, h_r, s, s_kv]
        if attention_mask is None:
            causal = torch.ones(s, s_kv, dtype=torch.bool, device=query.device).tril(s_kv - s)
            scores = scores.masked_fill(~causal, float("-inf"))
        elif attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32)
        if dropout > 0 and module.training:
            first = module.layout.q_heads.range(module.tp.rank)[0]
            masks = [keep_mask(self.rng.generator(query.device, module.layer_idx, "attn_probs", first + j),
                               (b, s, s_kv), dropout, query.device) for j in range(nh)]
            probs = probs * torch.stack(masks, dim=1) / (1.0 - dropout)
        out = torch.matmul(probs.to(value.dtype), value)                                  # [b, h_r, s, d]
        return out.transpose(1, 2).contiguous(), None


def install_dropout(model: nn.Module, rng: DropoutRNG, *, attention_dropout: float, hidden_dropout: float,
                    cp: Group | None = None) -> None:
    """Set the training loop's dropout on a model sharded by :func:`tensorpar.hf.apply.parallelize`.

    Blocks and their attention and MLP modules are found through the model's plan (``model.tensorpar_plan``),
    not through an attribute path. Attention dropout uses the head-keyed kernel (in training only; eval runs
    the configured kernel, e.g. SDPA); hidden dropout adds a :class:`HiddenDropout` after each attention and
    MLP output. The model's keyed generator becomes ``rng``. ``cp``: the context-parallel group (each rank holds
    ``s / cp`` positions): every keyed dropout draws the whole sequence's mask and keeps its positions.

    Raises:
        ValueError: ``attention_dropout > 0`` with a ``cp`` of more than one rank (not implemented).
    """
    if cp is not None and cp.size > 1 and attention_dropout > 0:
        raise ValueError(f"cp={cp.size}: does not run with attention_dropout={attention_dropout}; use "
                         f"attention_dropout=0 or cp=1")
    plan = model.tensorpar_plan
    model.tensorpar_dropout_rng = rng
    for m in model.modules():  # dropouts that parallelize keyed already now draw from this run's generator
        if isinstance(m, KeyedDropout):
            m.rng = rng
    all_attn = plan.modules(model, "attention")
    all_mlp = plan.modules(model, "gated_mlp") + plan.modules(model, "mlp")
    for i, (bname, _) in enumerate(plan.block_modules(model)):
        attn = [m for n, m in all_attn if n.startswith(bname + ".")]
        mlp = [m for n, m in all_mlp if n.startswith(bname + ".")]
        for a in attn:
            a.attention_dropout = attention_dropout
            a.attention_fn = HeadKeyedAttention(rng) if attention_dropout > 0 else None
        if hidden_dropout > 0:
            for site, mods in (("attn_out", attn), ("mlp_out", mlp)):
                for m in mods:
                    m.output_dropout = HiddenDropout(hidden_dropout, rng, i, site, m.tp,
                                                     sequence_parallel=getattr(m, "sequence_parallel", False))
    for m in model.modules():
        if isinstance(m, KeyedDropout):
            m.cp = cp if cp is not None and cp.size > 1 else None
