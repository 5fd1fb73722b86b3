"""Matmul FLOPs of a training step, after Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", eq. 3.

One layer's forward pass on B sequences of s tokens does ``24 B s h^2 + 4 B s^2 h`` FLOPs in a GPT
(QKV, attention output and two MLP matmuls; the two score matmuls), and the logit layer ``2 B s V h``.
Backward costs twice the forward, full recomputation adds one more layer forward, hence eq. 3::

    F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h))

:func:`layer_forward_flops` generalises the layer term to grouped-query attention, SwiGLU and the
per-rank shapes of uneven head splits; for a GPT it reduces to the expression above (tested).
"""
from __future__ import annotations

from tensorpar.planner.model_spec import ModelSpec
from tensorpar.planner.partition import RankHeads


def narayanan_eq3(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Eq. 3 of Narayanan et al. 2021: FLOPs per step of a GPT with full activation recomputation."""
    return 96 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def layer_forward_flops(model: ModelSpec, heads: RankHeads, ffn: float, tokens: float, seq: int) -> dict[str, float]:
    """Forward matmul FLOPs of one layer on ``tokens`` tokens (sequences of ``seq``) for a rank holding
    ``heads`` and ``ffn`` MLP columns: 2 FLOPs per multiply-add of every linear, plus the two score
    matmuls QK^T and PV, 2 * tokens * seq * (q d) each (causal masking not discounted, as in eq. 3).
    A mixture of experts runs each token through its top-k experts and the shared expert
    (:meth:`ModelSpec.active_ffn`) after the router's ``h x num_experts`` matmul."""
    h, d = model.hidden_size, model.head_dim
    return {
        "linear": 2 * tokens * (h * d * (heads.q + 2 * heads.kv) + heads.q * d * h
                                + model.mlp_matrices * h * model.active_ffn(ffn) + h * model.num_experts),
        "attention": 4 * tokens * seq * heads.q * d,
    }


Gemm = tuple  # (m, k, n, count): ``count`` products of an [m, k] by a [k, n] matrix, 2 m k n FLOPs each


def layer_gemms(model: ModelSpec, heads: RankHeads, ffn: float, tokens: float, seq: int,
                cp: int = 1) -> dict[str, list]:
    """The forward matmuls of one layer on ``tokens`` tokens (sequences of ``seq``) as shapes ``(m, k, n,
    count)``, whose FLOPs add up to :func:`layer_forward_flops`. ``"linear"``: QKV, attention output, the MLP's
    up (and gate) and down projections of the rank's ``ffn`` columns (a mixture of experts: the router and its
    active columns, as one product of ``tokens`` rows), all with ``m = tokens``. ``"attention"``: per sequence and
    query head, the scores ``[s, d] x [d, s]`` and ``[s, s] x [s, d]``; at context-parallel degree ``cp`` a rank
    holds ``s / cp`` queries of each sequence (``tokens`` is then ``b s / cp``): ``[s/cp, d] x [d, s]`` and
    ``[s/cp, s] x [s, d]``."""
    h, d = model.hidden_size, model.head_dim
    f = model.active_ffn(ffn)
    linear = [(tokens, h, d * (heads.q + 2 * heads.kv), 1), (tokens, heads.q * d, h, 1),
              (tokens, h, f, model.mlp_matrices - 1), (tokens, f, h, 1)]
    if model.num_experts:
        linear.append((tokens, h, model.num_experts, 1))
    rows = seq // cp                                  # queries of a sequence on this rank
    per_head = tokens / rows * heads.q
    return {"linear": linear, "attention": [(rows, d, seq, per_head), (rows, seq, d, per_head)]}


def backward_gemms(gemms: list) -> list:
    """The matmuls of the backward pass of ``gemms``: for ``Y = X W`` (``[m, k] x [k, n]``) the input gradient
    ``dY W^T`` (``[m, n] x [n, k]``) and the weight gradient ``X^T dY`` (``[k, m] x [m, n]``): 2x the FLOPs."""
    out = []
    for m, k, n, count in gemms:
        out += [(m, n, k, count), (k, m, n, count)]
    return out


def logit_forward_flops(model: ModelSpec, vocab_rows: int, tokens: float) -> float:
    """Output layer: 2 * tokens * h * V (per rank: its ``vocab_rows``)."""
    return 2 * tokens * model.hidden_size * vocab_rows


def recompute_forward_flops(layer: dict[str, float], recompute: str, attention: str) -> float:
    """Forward FLOPs re-executed during backward, per layer.

    full: the whole layer forward again (the 96 rather than 72 of eq. 3). selective: the score matmuls
    (Korthikanti et al. 2022, section 5). A fused "sdpa" attention kernel recomputes the scores inside its
    backward: 5 score-sized matmuls instead of 4, the 2.5x-forward backward that Dao 2023
    (FlashAttention-2) counts in its benchmarks, i.e. half an attention forward more.
    """
    extra = 0.5 * layer["attention"] if attention == "sdpa" else 0.0
    if recompute == "full":
        return extra + layer["linear"] + layer["attention"]
    if recompute == "selective":
        return extra + layer["attention"]
    return extra


def model_flops(model: ModelSpec, tokens: float, seq: int) -> float:
    """Model FLOPs of a training step on ``tokens`` tokens: forward + backward (3x forward), no
    recomputation, whole model. This is the numerator of model FLOPs utilisation (MFU)."""
    full = RankHeads(model.num_heads, model.num_kv_heads)
    layer = layer_forward_flops(model, full, model.ffn_hidden_size, tokens, seq)
    forward = model.num_layers * (layer["linear"] + layer["attention"])
    return 3 * (forward + logit_forward_flops(model, model.vocab_size, tokens))
