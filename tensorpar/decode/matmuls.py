"""Which matmul kernel a :class:`~tensorpar.decode.lean.LeanDecoder` runs: our GEMV on the plain weights at a few
rows (:func:`use_gemv`), or oneDNN on weights prepacked once (:func:`use_packed`); else ``torch.mm`` /
``F.linear`` as the decoder set them. Each sets the decoder's ``lin`` (the layers') and ``linear`` (the LM head's)
and, for packing, the layers' weight fields. No collectives."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tensorpar.decode import gemv_kernel
from tensorpar.decode import bf16_weights
from tensorpar.decode.bf16_weights import Bf16Weight, bf16_linear
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
    packed = _replace(dec, model, lambda w: True, lambda w, rows: pack(w, rows), tied=False)
    if packed is None:
        dec.packed = False
        return
    dec.lin = packed_linear
    if packed:
        dec.linear = packed_linear


def use_blocked(dec, model, every: bool = False) -> bool:
    """After :func:`use_gemv`: hold the matmul weights in our GEMV's blocked layout (blocks of
    :data:`~tensorpar.decode.gemv_kernel.BLOCK` output rows, the last one zero-padded), which replaces the plain
    one on the modules as oneDNN's does in :func:`use_packed` (one copy; ``weight`` converts back on access,
    exactly). fp32: :class:`~tensorpar.decode.gemv_kernel.BlockedWeight`, run at every row count through it
    (prefill too: no plain weight is left for ``torch.mm``). bf16 (``--dtype bfloat16``): the bf16 blocked layout
    of ``--quantize bf16`` (:class:`~tensorpar.decode.bf16_weights.Bf16Weight`, compute dtype bf16), for weights
    of at least :data:`~tensorpar.decode.bf16_weights.BLOCK_MIN_IN` inputs (shorter rows read faster plain), run
    by :func:`~tensorpar.decode.bf16_weights.bf16_linear` at any row count (``vdpbf16ps`` on pairs of inputs). A
    tied LM head's table too: the input embedding then looks its rows up in the blocked layout
    (:class:`~tensorpar.decode.packed.PackedVocabParallelEmbedding`).
    ``every`` (a bf16 decoder of more than 4 rows): bf16 weights of any row length too, so that every matmul runs
    our GEMV and the row step its 32 rows (short rows read 0.82-0.89x as fast blocked at one row, but above 4 rows
    the plain ones would run oneDNN). Taken only if a probe of every row count the kernel runs (the 1-13 rows its
    micro-kernels split into) is within the kernel's tolerance of ``F.linear`` (fp32: 1e-5 relative, the order of
    the fp32 sums; bf16: one bf16 rounding, 2^-8 relative) and each probe row's outputs are bitwise those it gets
    alone. Why: the blocked layout streams each block of 32 output rows as one sequence and computes the step's
    rows as output vectors (no horizontal sums): fp32 1.02-1.62x our GEMV on the plain weight at one row,
    1.36-1.85x at 4 and 1.35x at 32 (bench/results/gemv-blocked-epyc.md, SmolLM2's and the 1.1B's tp=2 shapes);
    bf16 see :func:`~tensorpar.decode.bf16_weights.bf16_linear`. Returns whether any weight was blocked."""
    def which(w) -> bool:
        return _blockable(w, 0 if every else None)
    w = next((w for L in dec.layers for *_, w, _ in L.packs if which(w)), None)
    if w is None:
        return False
    rows = 13                   # the micro-kernels' 12 rows and one more (fp32 and bf16 alike)
    tol = 1e-5 if w.dtype == torch.float32 else 2.0 ** -8
    probe = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)
    with torch.no_grad():
        bw = _blocked(w, 0)
        run = gemv_kernel.blocked_linear if w.dtype == torch.float32 else bf16_linear
        got, want = run(probe, bw, None), F.linear(probe, w)
        alone = torch.cat([run(probe[i:i + 1], bw, None) for i in range(rows)])
    del bw
    got, want = got.float(), want.float()
    close = torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max()))
    if not (torch.equal(got, alone.float()) and close):
        return False
    del w
    # dec.lin / dec.linear stay gemv_mm / gemv_linear: they take a BlockedWeight and a Bf16Weight too
    return _replace(dec, model, which, _blocked, tied=True) is not None


def blocks_every_matmul(dec, dtype: torch.dtype) -> bool:
    """Whether :func:`use_blocked` would hold every matmul weight of ``dec`` (its layers', and the LM head's on the
    last stage) of a model computing in ``dtype`` in a blocked layout our GEMV runs at any row count, given ``every``
    (rows of any length): fp32 always (what is not blockable runs ``torch.mm``), bf16 where each is a plain CPU
    matrix our kernel runs (a weight left plain would run ``F.linear`` on plain bf16 weights above 4 rows, slower
    than oneDNN's prepacked ones)."""
    if dtype == torch.float32:
        return True
    ws = [w for L in dec.layers for *_, w, _ in L.packs] + ([dec.lm_w] if dec.last else [])
    return dtype == torch.bfloat16 and all(_blockable(w, 0) for w in ws)


def _blockable(w, min_in: int | None = None) -> bool:
    """Whether :func:`use_blocked` blocks ``w``: fp32 as :func:`~tensorpar.decode.gemv_kernel.blockable` says; bf16
    the same checks and at least ``min_in`` inputs (default :data:`~tensorpar.decode.bf16_weights.BLOCK_MIN_IN`)."""
    if isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16:
        return (w.dim() == 2 and w.device.type == "cpu" and w.is_contiguous() and w.shape[0] > 0
                and w.shape[1] >= max(1, bf16_weights.BLOCK_MIN_IN if min_in is None else min_in)
                and gemv_kernel.available())
    return gemv_kernel.blockable(w)


def _blocked(w: torch.Tensor, rows: int):
    if w.dtype == torch.bfloat16:
        return bf16_weights.blocked(w, torch.bfloat16)
    return gemv_kernel.BlockedWeight(gemv_kernel.block(w), w.shape[0])


def _replace(dec, model, which, packer, tied: bool):
    """Replace the layers' weights for which ``which(w)`` holds (and the LM head's: untied, or with ``tied`` one
    tied to the input embedding, whose module then looks its rows up in the packed form) with ``packer(w, rows)``
    on the modules (:func:`~tensorpar.decode.packed.pack_weights`) and in ``dec``'s fields. Returns whether the LM head was replaced, or ``None`` where nothing was (a weight
    outside a plain parallel Linear, :func:`~tensorpar.decode.packed.pack_plan`)."""
    is_tied = model.lm_head._parameters.get("weight") is decoder_parts(model)[0]._parameters.get("weight")
    fields = [(L, field, id(w)) for L in dec.layers for field, _, _, w, _ in L.packs if which(w)]
    skip = (is_tied and not tied) or not dec.last or not which(dec.lm_w)          # not the last stage: no head
    head = None if skip else id(dec.lm_w)
    ids = {i for *_, i in fields} | ({head} if head is not None else set())
    if not ids:
        return None
    try:
        plan = pack_plan(model, ids)
    except ValueError:                      # a weight outside a plain parallel Linear: keep them all plain
        return None
    for L in dec.layers:       # drop the [in, out] views first, so each plain matrix is freed as it is packed
        keep = [pk for pk in L.packs if id(pk[3]) not in ids]
        for field, _, _, w, _ in L.packs:
            if id(w) in ids:
                setattr(L, field, None)
        L.packs = keep
    lm_w = dec.lm_w
    if head is not None:
        dec.lm_w = None
    del lm_w
    packed = pack_weights(model, plan, dec.max_batch, packer)
    for L, field, i in fields:
        setattr(L, field, packed[i])
    if head is not None:
        dec.lm_w = packed[head]
    return head is not None
