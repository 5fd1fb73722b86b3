"""Which matmul kernel a :class:`~tensorpar.decode.lean.LeanDecoder` runs: our GEMV on the plain weights at a few
rows (:func:`use_gemv`), or oneDNN on weights prepacked once (:func:`use_packed`); else ``torch.mm`` /
``F.linear`` as the decoder set them. Each sets the decoder's ``lin`` (the layers') and ``linear`` (the LM head's)
and, for packing, the layers' weight fields. No collectives."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tensorpar.decode import gemv_kernel
from tensorpar.decode.kernels import gemv_linear, gemv_mm, pack, packed_linear
from tensorpar.decode.packed import pack_plan, pack_weights
from tensorpar.decode.prepare import decoder_parts


def use_gemv(dec) -> bool:
    """Run the matmuls of steps of at most :func:`~tensorpar.decode.gemv_kernel.max_rows` rows (decode, up to
    32 rows in fp32) through our GEMV on the plain weights, the rest (prefill) through ``torch.mm`` / ``F.linear``
    on the same weights: nothing packed, nothing converted. Where it pays against oneDNN's prepacked GEMM is
    measured per row count at :data:`~tensorpar.decode.gemv_kernel.MAX_ROWS`; the caller takes it only for
    decoders of ``max_batch`` <= that. Taken when
    the kernel runs here
    (:func:`~tensorpar.decode.gemv_kernel.supports` every weight: CPU, fp32 or bf16, contiguous) and a probe
    is within the kernel's tolerance of ``F.linear`` (fp32: 1e-5 relative, the order of the fp32 sums; bf16:
    one bf16 rounding, 2^-8 relative)."""
    ws = [w for L in dec.layers for *_, w, _ in L.packs] + ([dec.lm_w] if dec.last else [])
    if not ws or not all(isinstance(w, torch.Tensor) and gemv_kernel.supports(w) for w in ws):
        return False
    w = ws[0]
    probe = torch.randn(1, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)
    with torch.no_grad():
        got, want = gemv_kernel.gemv(probe, w, None).float(), F.linear(probe, w).float()
    tol = 1e-5 if w.dtype == torch.float32 else 2.0 ** -8
    if not torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max())):
        return False
    dec.lin, dec.linear = gemv_mm, gemv_linear
    return True

def use_packed(dec, model) -> None:
    """Run the matmuls on oneDNN-packed weights that replace the plain ones on the modules
    (:func:`~tensorpar.decode.packed.pack_weights`; a tied LM head stays plain: the embedding reads it). bf16:
    only if a probe shows them bitwise equal to ``F.linear`` on this machine (else keep the plain weights).
    fp32: oneDNN's kernels differ from ``torch.mm``'s (MKL) in the order of their sums, a few units in the last
    place (the probe checks 1e-5 relative), and ran 1.4x (one row) to 1.8x (32 rows) faster at the decode
    shapes of SmolLM2 on an idle machine (bench/results/matmul_pack.md). Nothing is packed when a weight's
    module is not a plain column/row-parallel Linear (:func:`~tensorpar.decode.packed.pack_plan`)."""
    w = dec.layers[0].packs[0][3]
    probe = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)
    with torch.no_grad():
        got = packed_linear(probe, pack(w, dec.max_batch), None)
        want = F.linear(probe, w)
    same = (torch.equal(got, want) if w.dtype != torch.float32
            else torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())))
    if not same:
        dec.packed = False
        return
    del w
    tied = model.lm_head._parameters.get("weight") is decoder_parts(model)[0]._parameters.get("weight")
    fields = [(L, field, id(w)) for L in dec.layers for field, _, _, w, _ in L.packs]
    head = None if tied or not dec.last else id(dec.lm_w)     # not the last pipeline stage: no LM head
    try:
        plan = pack_plan(model, {i for *_, i in fields} | ({head} if head is not None else set()))
    except ValueError:                      # a weight outside a plain parallel Linear: keep them all plain
        dec.packed = False
        return
    for L in dec.layers:       # drop the [in, out] views first, so each plain matrix is freed as it is packed
        for field, *_ in L.packs:
            setattr(L, field, None)
        L.packs = []
    lm_w, dec.lm_w = dec.lm_w, None
    packed = pack_weights(model, plan, dec.max_batch)
    for L, field, i in fields:
        setattr(L, field, packed[i])
    dec.lin = packed_linear
    if head is None:                        # tied to the embedding: the plain table, F.linear (or no head)
        dec.lm_w = lm_w
    else:
        dec.lm_w, dec.linear = packed[head], packed_linear
