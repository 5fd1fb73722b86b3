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

    def set_step(self, step: int, micro: int = 0) -> None:
        self.step, self.micro = int(step), int(micro)

    def generator(self, device: torch.device, *key) -> torch.Generator:
        """A fresh generator on ``device`` seeded from ``(seed, step, micro, *key)`` (same on every platform)."""
        text = ":".join(str(k) for k in (self.seed, self.step, self.micro, *key))
        s = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)
        return torch.Generator(device=device).manual_seed(s)


def keep_mask(gen: torch.Generator, shape, p: float, device) -> torch.Tensor:
    """Bernoulli(1 - p) keep mask of ``shape`` (bool), drawn from ``gen``."""
    return torch.rand(shape, generator=gen, device=device) >= p


class HiddenDropout(nn.Module):
    """Dropout on a block's attention or MLP output, before the residual add (Megatron's "hidden dropout").

    Shapes: ``[b, s, h]`` replicated, or ``[b, s_r, h]`` with ``sequence_parallel`` (``s_r = s / tp``, the
    even split that :func:`tensorpar.comm.scatter_to_sequence_region` makes). No collectives.
    """

    def __init__(self, p: float, rng: DropoutRNG, layer_idx: int, site: str, tp: Group, *,
                 sequence_parallel: bool = False):
        super().__init__()
        self.p, self.rng, self.layer_idx, self.site = p, rng, layer_idx, site
        self.tp, self.sequence_parallel = tp, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        b, s_local, h = x.shape
        full = (b, s_local * self.tp.size if self.sequence_parallel else s_local, h)
        mask = keep_mask(self.rng.generator(x.device, self.layer_idx, self.site), full, self.p, x.device)
        if self.sequence_parallel:
            mask = mask.narrow(1, self.tp.rank * s_local, s_local)          # [b, s_r, h]
        return x * mask.to(x.dtype) / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, layer={self.layer_idx}, site={self.site}, sequence_parallel={self.sequence_parallel}"


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


def install_dropout(model: nn.Module, rng: DropoutRNG, *, attention_dropout: float, hidden_dropout: float) -> None:
    """Give every block of a model sharded by :func:`tensorpar.hf.apply.parallelize` tp-invariant dropout.

    Attention dropout replaces the attention kernel only when it is on (the default kernel, SDPA, is
    faster); hidden dropout adds a :class:`HiddenDropout` after each attention and MLP output.
    """
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        attn.attention_dropout = attention_dropout
        if attention_dropout > 0:
            attn.attention_fn = HeadKeyedAttention(rng)
        if hidden_dropout > 0:
            sp = attn.sequence_parallel
            attn.output_dropout = HiddenDropout(hidden_dropout, rng, i, "attn_out", attn.tp, sequence_parallel=sp)
            mlp.output_dropout = HiddenDropout(hidden_dropout, rng, i, "mlp_out", mlp.tp, sequence_parallel=sp)
