"""Which decoders the row step (:mod:`tensorpar.decode.row_step`) runs, and the weights, norms and embedding it reads:
:func:`why_not` and its per-piece checks. No collectives."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tensorpar.decode import fused, gemv_kernel
from tensorpar.decode.bf16_weights import Bf16Weight
from tensorpar.decode.gemv_kernel import BlockedWeight
from tensorpar.decode.int8 import Int8Weight
from tensorpar.decode.packed import PackedVocabParallelEmbedding, table_of
from tensorpar.decode.step_matmuls import _KERNELS

#: the compute dtypes the row step runs: fp32 (fp32 weights, or the int8 / bf16 weights of ``--quantize``), and bf16
#: models (``--dtype bfloat16``: bf16 weights, plain or blocked, or the int8 weights of ``--quantize int8``; their
#: activations rounded to bf16 where torch rounds them)
DTYPES = (torch.float32, torch.bfloat16)


def rows(dec, dtype: torch.dtype, fmt: str | None) -> int:
    """The most rows a row step of decoder ``dec`` computing in ``dtype`` on weights of format ``fmt`` runs:
    :data:`~tensorpar.decode.gemv_kernel.MAX_ROWS` (32), but for a bf16 model's bf16 weights of which some are plain
    (rows of fewer than 1024 inputs, :func:`tensorpar.decode.matmuls.use_blocked`) our plain GEMV's
    :func:`~tensorpar.decode.gemv_kernel.max_rows` (4). All held blocked, 32: ``vdpbf16ps`` on the blocked layout ran
    a layer's matmuls at 16 and 32 rows 1.09 and 1.03x as fast as oneDNN's prepacked bf16 GEMM
    (bench/results/gemv-bf16dp-epyc.md). The int8 kernel of a bf16 model: 32 (the general loop runs it at every row
    count, on the input widened to fp32)."""
    if fmt != "bf16" or dtype != torch.bfloat16:
        return gemv_kernel.MAX_ROWS
    ws = [w for L in dec.layers for w in (L.wqkv, L.wo, L.wgu, L.wd)] + ([dec.lm_w] if dec.last else [])
    if all(isinstance(w, Bf16Weight) and w.blocked for w in ws):
        return gemv_kernel.MAX_ROWS
    return gemv_kernel.max_rows(dtype)


def row_count(dec) -> int:
    """:func:`rows` of decoder ``dec`` on this rank (its compute dtype and weight format). Ranks whose bf16 weights
    block differently (an uneven or weighted split: one rank's rows long enough, another's not) get different
    counts; :class:`~tensorpar.decode.lean.LeanDecoder` takes the smallest over its ranks, else a step of 5-32 rows
    would run the row step on some ranks and the general loop on others (different collectives: a hang)."""
    ref = _reference_weight(dec)
    return rows(dec, ref.dtype, _format(ref))


def _norm(fn, dtype: torch.dtype = torch.float32):
    """``(weight, eps)`` of a norm callable the fused kernel can replace: the RMSNorm
    ``w * (x * rsqrt(mean(x^2) + eps))`` of a model computing in ``dtype`` (bf16: normalised in fp32, rounded to bf16,
    times the bf16 weight) that :func:`~tensorpar.decode.kernels.rms_norm_fn` found bitwise equal to the family's
    module (its ``rms_norm`` attribute); anything else (a module, Gemma's ``(1 + w)``, LayerNorm, a weight of
    another dtype) ``None``."""
    w, eps = getattr(fn, "rms_norm", (None, None))
    if w is None or not isinstance(eps, float) or w.dtype != dtype or not w.is_contiguous():
        return None
    return w, eps


def why_not(dec) -> str | None:
    """Why decoder ``dec`` (a :class:`~tensorpar.decode.lean.LeanDecoder`) cannot run its decode steps as a
    :class:`RowStep` (``None``: it can)."""
    if dec.tile is not None:
        return "deterministic mode"
    ref = _reference_weight(dec)
    if ref.device.type != "cpu":
        return "its weights are not on the CPU (the step's kernels are CPU kernels)"
    fmt, dt = _format(ref), ref.dtype
    if dt not in DTYPES:
        return "it computes in neither fp32 nor bf16"
    if dt == torch.bfloat16 and not ((dec.gemv and fmt == "bf16") or fmt == "int8"):     # not oneDNN's packed ones
        return f"a bf16 model whose weights our GEMV does not run (max_batch above {gemv_kernel.max_rows(dt)})"
    if not (dec.gemv or (fmt is not None and _KERNELS[fmt][0]())):     # more rows: in chunks (decode_chunks)
        return "it runs neither our GEMV (fp32 weights) nor our kernel of --quantize int8 / bf16"
    if dec.final_cap is not None or dec.lm_b is not None:
        return "logit soft-capping or an LM head bias"
    if not fused.available() or (dec.last and _norm(dec.norm, dt) is None):
        return "no fused kernels here, or the final norm is not the plain RMSNorm"
    for L in dec.layers:
        plain = (L.moe is None and L.post_attn is None and L.post_ff is None and L.bo is None and L.bd is None
                 and _bias(L.bqkv, dt) and _bias(L.bgu, dt) and L.gated and L.silu and L.qk_norm is None
                 and not L.interleaved and not L.parallel and L.sdpa is F.scaled_dot_product_attention)
        if not plain or _norm(L.ln1, dt) is None or _norm(L.ln2, dt) is None:
            return ("a layer that is not of the plain Llama shape (pre-RMSNorms, gated SiLU MLP, biases only on the "
                    "QKV and gate-up projections)")
        if any(_format(w) != fmt for w in (L.wqkv, L.wo, L.wgu, L.wd)):
            return "weights of several formats"
        if fmt == "bf16" and not all(_kernel_layout(w) for w in (L.wqkv, L.wo, L.wgu, L.wd)):
            return "bf16 weights in a layout our GEMV does not read"
    return None


def _kernel_layout(w) -> bool:
    """A bf16 weight our GEMV reads: a :class:`Bf16Weight`, or a plain bf16 CPU tensor held as the ``[in, out]`` view
    of a contiguous ``[out, in]`` one (the general loop's plain weights)."""
    return isinstance(w, Bf16Weight) or (w.dim() == 2 and w.t().is_contiguous() and w.device.type == "cpu")


def _bias(b, dtype: torch.dtype) -> bool:
    """Whether a column-parallel projection's bias ``b`` can go to the step's matmul kernel: none, or a contiguous
    ``[N]`` CPU tensor in the computing dtype (a bf16 one converted to fp32 once: exact)."""
    return b is None or (b.dtype == dtype and b.is_contiguous() and b.dim() == 1 and b.device.type == "cpu")


def _reference_weight(dec):
    """The weight whose format and dtype the step's matmuls share: the LM head's, or on a pipeline stage before the
    last (no LM head) its first layer's attention output projection."""
    return dec.lm_w if dec.last else dec.layers[0].wo


def _format(w) -> str | None:
    """``int8`` / ``bf16`` for the stored weights of ``--quantize`` (:class:`Int8Weight`, :class:`Bf16Weight`) and
    a bf16 model's weights (``bf16``: :class:`Bf16Weight` blocked, or plain bf16 tensors), ``None`` for fp32 weights
    (a plain tensor or a :class:`BlockedWeight`: both run our fp32 GEMV)."""
    if isinstance(w, Int8Weight):
        return "int8"
    bf16 = isinstance(w, Bf16Weight) or (isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16)
    return "bf16" if bf16 else None


def _embedding(emb):
    """``emb`` (the decoder's input embedding) when a row step may look its rows up itself (:meth:`RowStep._embed`):
    tensorpar's :class:`~tensorpar.layers.embedding.VocabParallelEmbedding` with a contiguous fp32 CPU table, no
    ``embed_scale`` and no sequence parallelism; else ``None`` (the module runs). A module with hooks (e.g. the
    collective fingerprints' call sites) runs itself too, checked at every step."""
    from tensorpar.layers.embedding import VocabParallelEmbedding

    if (type(emb) not in (VocabParallelEmbedding, PackedVocabParallelEmbedding) or emb.embed_scale is not None
            or emb.sequence_parallel):
        return None
    w = table_of(emb)
    if w.dtype != torch.float32 or not (isinstance(w, BlockedWeight) or w.is_contiguous()) or w.device.type != "cpu":
        return None
    return emb
