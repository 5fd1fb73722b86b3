"""The per-layer pieces of :class:`~tensorpar.decode.lean.LeanDecoder` that replace framework calls: RMSNorm in
fewer calls where a probe shows it bitwise equal (:func:`rms_norm_fn`), the in-place SiLU check, the 2-D matmul
without ``F.linear``'s dispatch (:func:`mm`), oneDNN-prepacked weights (:func:`pack`, :func:`packed_linear`), our
GEMV on the plain weights at a few rows (:func:`gemv_mm`, :func:`gemv_linear`), and the runs of query heads that
share a KV head (:func:`kv_runs`). No collectives.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tensorpar.decode import gemv_kernel
from tensorpar.decode.bf16_weights import Bf16Weight, bf16_linear


def rms_norm_fn(mod):
    """An RMSNorm bitwise equal to ``mod`` with fewer framework calls, or ``mod`` itself when a probe says it is not
    the families' formula ``weight * (x * rsqrt(mean(x^2) + eps))`` (normalised in fp32, the weight applied in the
    weight's dtype: transformers' ``LlamaRMSNorm``; ``x*x`` is ``pow(x, 2)``'s own kernel). Six calls, in place where
    possible, instead of the module call and its eight (``F.rms_norm``'s C++ decomposition measured slower: it
    copies twice)."""
    w = getattr(mod, "weight", None)
    eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or not isinstance(eps, float):
        return mod
    if w.dtype == torch.float32:
        def fn(x):
            return torch.mul(x, torch.mul(x, x).mean(-1, keepdim=True).add_(eps).rsqrt_()).mul_(w)
    else:
        def fn(x):
            h = x.float()
            return torch.mul(h, torch.mul(h, h).mean(-1, keepdim=True).add_(eps).rsqrt_()).to(w.dtype).mul_(w)
    #: ``(weight, eps)`` of this formula: what the fused norm of the row step reads (tensorpar.decode.fused)
    fn.rms_norm = (w, eps)
    g = torch.Generator().manual_seed(0)
    scale = torch.tensor([[0.01], [1.0], [30.0]])
    with torch.no_grad():
        for n in (3, 1):
            probe = (torch.randn(n, w.shape[0], generator=g) * scale[:n]).to(w.device, w.dtype)
            if not torch.equal(fn(probe), mod(probe)):
                return mod
    return fn


def is_silu(act, w: torch.Tensor) -> bool:
    """Whether ``act`` computes ``F.silu`` (checked on a probe in ``w``'s dtype): then it runs in place."""
    probe = torch.linspace(-8, 8, 64).to(w.device, w.dtype)
    with torch.no_grad():
        return torch.equal(act(probe), F.silu(probe))


def mm(x: torch.Tensor, wt: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``x [n, in] @ wt [in, out] (+ b)``: ``F.linear(x, wt.t(), b)``'s own call for 2-D input, without its dispatch."""
    return torch.mm(x, wt) if b is None else torch.addmm(b, x, wt)


def gemv_mm(x: torch.Tensor, wt: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """:func:`mm` (``x [n, in] @ wt [in, out] (+ b)``, ``wt`` the ``[in, out]`` view of a row-major ``[out, in]``
    weight) through our GEMV (:mod:`tensorpar.decode.gemv_kernel`, on ``wt.t()`` as it is) when ``n`` is at most
    :func:`~tensorpar.decode.gemv_kernel.max_rows` of its dtype, else :func:`mm`. ``wt`` may instead be a
    :class:`~tensorpar.decode.gemv_kernel.BlockedWeight`: our GEMV on its layout at any ``n``; or a bf16 model's
    :class:`~tensorpar.decode.bf16_weights.Bf16Weight`: :func:`~tensorpar.decode.bf16_weights.bf16_linear`."""
    if isinstance(wt, gemv_kernel.BlockedWeight):
        return gemv_kernel.blocked_linear(x, wt, b)
    if isinstance(wt, Bf16Weight):
        return bf16_linear(x, wt, b)
    if x.shape[0] <= gemv_kernel.max_rows(x.dtype):
        return gemv_kernel.linear(x, wt.t(), b)
    return mm(x, wt, b)


def gemv_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, w, b)`` (``x [..., in]``, ``w [out, in]`` row-major) through our GEMV when ``x`` has at most
    :func:`~tensorpar.decode.gemv_kernel.max_rows` rows of its dtype, else ``F.linear``; ``w`` may instead be a
    :class:`~tensorpar.decode.gemv_kernel.BlockedWeight` (any rows), or a bf16 model's blocked
    :class:`~tensorpar.decode.bf16_weights.Bf16Weight` (:func:`~tensorpar.decode.bf16_weights.bf16_linear`)."""
    k = x.shape[-1]
    if isinstance(w, Bf16Weight):
        return bf16_linear(x, w, b)
    if isinstance(w, gemv_kernel.BlockedWeight):
        return gemv_kernel.blocked_linear(x.reshape(-1, k), w, b).view(*x.shape[:-1], w.shape[0])
    if x.numel() <= gemv_kernel.max_rows(x.dtype) * k:
        return gemv_kernel.linear(x.reshape(-1, k), w, b).view(*x.shape[:-1], w.shape[0])
    return F.linear(x, w, b)


def packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, W, b)`` with ``w`` = :func:`pack` (W): oneDNN's matmul without its per-call weight reorder."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def can_pack(w: torch.Tensor) -> bool:
    """Whether :func:`pack` applies: a CPU weight with oneDNN available, fp32, or bf16 where oneDNN runs bf16
    (what ``F.linear`` calls there)."""
    if w.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(w: torch.Tensor, rows: int = 1) -> torch.Tensor:
    """``w`` ``[out, in]`` reordered into oneDNN's blocked layout (a new tensor of its own memory, read by
    :func:`packed_linear`; ``to_dense()`` gives ``w`` back bit for bit). :func:`tensorpar.decode.packed.pack_weights`
    makes it replace ``w``. ``rows``: the input rows a step runs at most (a decoder's ``max_batch``), from which
    oneDNN's batch-size hint is set: ``rows`` for fp32, at least 4 for bf16. A bf16 layout packed for one row
    differed from ``F.linear`` at 16 rows and more (a batch, a prefill) and ran 1.2-1.8x slower at 1-512 rows than
    one packed for the rows; packed for 4 or more it gave ``F.linear``'s bits (bench/results/pack-hint-xeon.md, Xeon
    with AMX, the 1.1B's shapes). fp32 is never bitwise ``F.linear`` (a probe checks its tolerance); packed for the
    rows it ran 0.90-0.94x the time of one row's layout at 4-64 rows."""
    hint = rows if w.dtype == torch.float32 else max(rows, 4)
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), hint)


def kv_runs(kv_index: list[int]) -> list[tuple[int, int, int]]:
    """``(kv_head, q_start, q_stop)`` for each run of consecutive local query heads that read one local KV head.

    ``kv_index``: per local query head, its local KV head (``HeadLayout.kv_index``), e.g. ``[0, 0, 0, 1, 1]`` ->
    ``[(0, 0, 3), (1, 3, 5)]``. In a decode step (one query per row) attention over each run with its KV head
    (``enable_gqa``) reads the cache views as they are and gives the result of attention over KV heads copied per
    query head (bitwise on an AVX-512 CPU, within a unit in the last place on an AVX2 one:
    tests/decode/test_lean.py), without the copies (``b x q_local x length x head_dim`` elements
    of keys and as many of values per layer and step, more than the layer's weights at a serving batch of 32). With several queries per row (prefill) CPU
    attention's result depends on the head count in its last bit, so prefill keeps the copies."""
    runs: list[tuple[int, int, int]] = []
    for h, j in enumerate(kv_index):
        if runs and runs[-1][0] == j and runs[-1][2] == h:
            runs[-1] = (j, runs[-1][1], h + 1)
        else:
            runs.append((j, h, h + 1))
    return runs
