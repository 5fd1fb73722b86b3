"""``--quantize bf16`` (tensorpar/decode/bf16_weights.py, quantize.store_bf16): an fp32 model whose decoder Linears
and LM head are stored in bf16 and computed in fp32 equals transformers' fp32 model with those weights rounded to
bf16, at tp 1 and 2, lean path (its row step included) and module path; the fp32 weights are freed; the GEMV's
bf16-weight / fp32-activation entry equals ``F.linear`` on the widened weight; ``--dtype bfloat16`` is refused."""
import argparse

import pytest
import torch

from tensorpar.decode import bf16_weights, fused, gemv_kernel
from tensorpar.generate import SamplingConfig, generate_tokens
from tests._ranks import run_tp
from tests.decode.test_generate import ARCHS, make_model_folder, prompts

N_NEW = 10
#: fp32 against fp32 with the same (bf16-valued) weights: only the order of the sums differs (our GEMV, the fused
#: norms of the row step, oneDNN / MKL in the reference): 1e-5 of the largest logit, the row step test's bound
TOL = 1e-5
needs_gemv = pytest.mark.skipif(not gemv_kernel.available(),
                                reason="TENSORPAR_GEMV_KERNEL=0, neither AVX-512 BF16 nor AVX2 + FMA, or no compiler")


def rounded_reference(folder, ids, mask, n):
    """transformers' unsharded fp32 model with every decoder Linear and the LM head rounded to bf16 in plain
    PyTorch (``W.bfloat16().float()``): greedy tokens and the first row's all-position logits."""
    from transformers import AutoModelForCausalLM

    from tensorpar.decode.bf16_weights import quantize_reference_bf16
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    quantize_reference_bf16(model)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0, min_new_tokens=n)
        logits = model(ids[:1]).logits[0]
    return out[:, ids.shape[1]:], logits


def job_bf16(ctx, folder, ids, mask, n, min_in=None):
    from tensorpar import comm
    from tensorpar.decode import bf16_weights
    from tensorpar.decode.int8 import int8_weights
    from tensorpar.decode.lean import LeanDecoder
    from tensorpar.decode.quantize import apply_quantize, resident_weight_bytes
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.shm import disable_fast_collectives, enable_fast_collectives
    if ctx.tp.size > 1:
        enable_fast_collectives(ctx.tp, "on")
    default_min_in = bf16_weights.BLOCK_MIN_IN
    if min_in is not None:          # this worker only, restored below (the pool's workers serve later tests)
        bf16_weights.BLOCK_MIN_IN = min_in
    try:
        model, plan = build_parallel_model(folder, ctx.tp)
        before = resident_weight_bytes(model)
        apply_quantize(model, ctx.tp, "bf16")
        after = resident_weight_bytes(model)
        stored = [w for v in int8_weights(model).values() if isinstance(v, dict)
                  for w in v.values() if isinstance(w, bf16_weights.Bf16Weight)]
        blocked = sum(w.blocked for w in stored), len(stored)
        row_step = LeanDecoder(model, ctx.tp, max_batch=1, max_len=8).row_step is not None
        tokens = generate_tokens(model, ctx.tp, ids, mask, sampling=SamplingConfig(max_new_tokens=n),
                                 path="lean").tokens
        module = generate_tokens(model, ctx.tp, ids, mask, sampling=SamplingConfig(max_new_tokens=n),
                                 path="hf").tokens
        s = ids.shape[1]
        lean = LeanDecoder(model, ctx.tp, max_batch=1, max_len=s)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        local = lean.forward(ids[:1], torch.arange(s)[None], causal, length=s, start=0, last_only=False)[0]
        logits = comm.all_gather(local.contiguous(), ctx.tp, -1, plan.vocab)                  # [s, V]
        head = model.lm_head
        return dict(tokens=tokens, module=module, logits=logits, row_step=row_step, before=before, after=after,
                    freed="weight" not in head._parameters, head_weight=head.weight.dtype, blocked=blocked)
    finally:
        bf16_weights.BLOCK_MIN_IN = default_min_in
        if ctx.tp.size > 1:
            disable_fast_collectives(ctx.tp)


@pytest.mark.parametrize("tp,blocked", [(1, False), (1, True), pytest.param(2, False, marks=pytest.mark.slow),
                                        (2, True), pytest.param(3, True, marks=pytest.mark.slow),
                                        pytest.param(4, True, marks=pytest.mark.slow)])
def test_bf16_weights_equal_rounded_fp32_model(pools, tmp_path, tp, blocked):
    """Greedy tokens of the lean path (the row step decoding: batch 1, where our GEMV and the fused kernels run; else
    the general loop on ``chunked_linear``) and of the module path equal those of the fp32 reference with
    bf16-rounded weights, prompt logits within TOL of its largest; tp=2 (9 query heads split 5 / 4, shared memory)
    as tp=1. The fp32 weights are freed (the head has no ``weight`` parameter; its
    ``weight`` reads as fp32) and the Linears' bytes halve. ``blocked``: every weight whose row views allow it held
    in the bf16 blocked layout (``BLOCK_MIN_IN`` 0 on the ranks; here o_proj, down_proj and the tied LM head,
    which the embedding looks up; the fused QKV and gate-up, whose views start at rows 36 / 40 (tp=1) or 20 / 20
    (tp=2), stay plain: both kinds in one step); tp=3 (3 query heads a rank) and tp=4 (uneven: 3 / 2 / 2 / 2 heads,
    a vocabulary of 53 split 14 / 13 / 13 / 13) in the slow set."""
    folder = str(make_model_folder(tmp_path / "llama", "llama"))
    ids, mask = prompts(ARCHS["llama"]["vocab_size"])
    want, want_logits = rounded_reference(folder, ids, mask, N_NEW)
    for r, got in enumerate(run_tp(pools, tp, job_bf16, folder, ids, mask, N_NEW, 0 if blocked else None)):
        n_blocked, n_stored = got["blocked"]
        if not gemv_kernel.available():
            assert n_blocked == 0
        elif blocked:
            assert 0 < n_blocked < n_stored, f"rank {r}: {n_blocked} of {n_stored} weights blocked"
        else:
            assert n_blocked == 0, f"rank {r}: the tiny model's rows are below BLOCK_MIN_IN"
        assert got["row_step"] == (fused.available() and gemv_kernel.available()), \
            f"rank {r}: the row step does not run the bf16 weights"
        assert torch.equal(got["tokens"], want), f"tp={tp} rank {r}: lean {got['tokens']} != reference {want}"
        assert torch.equal(got["module"], want), f"tp={tp} rank {r}: module path {got['module']} != {want}"
        err = (got["logits"] - want_logits).abs().max().item()
        assert err <= TOL * want_logits.abs().max().item(), f"tp={tp}: logits differ by {err}"
        assert got["freed"] and got["head_weight"] == torch.float32
        assert got["after"] < 0.75 * got["before"], (got["before"], got["after"])


@needs_gemv
@pytest.mark.parametrize("m,k,n", [(1, 288, 300), (2, 36, 53), (3, 100, 17), (13, 70, 64), (32, 33, 97),
                                   (100, 64, 70)])
def test_bf16w_blocked_gemv(m, k, n):
    """The bf16 blocked layout (``block_bf16``): exact round trip; within 1e-5 relative of ``F.linear`` on the
    widened weight; bitwise the fp32 blocked layout's result on the same (widened) weights (the same fma order);
    each row's outputs bitwise those it gets alone; the into-buffer entry gives the same bits; row lookups
    and 32-aligned row views read the plain weight's rows."""
    from tensorpar.decode.bf16_weights import Bf16Weight
    g = torch.Generator().manual_seed(m * k + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g)
    p = bf16_weights.block_bf16(w)
    assert p.shape == (-(-n // 32), k + k % 2, 32) and torch.equal(bf16_weights.unblock_bf16(p, n, k), w)
    got = gemv_kernel.bf16w_blocked_linear(x, p, n, bias, k)
    want = torch.nn.functional.linear(x, w.float(), bias)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    fp32 = gemv_kernel.blocked_linear(x, gemv_kernel.BlockedWeight(gemv_kernel.block(w.float()), n), bias)
    assert torch.equal(got, fp32)
    alone = torch.cat([gemv_kernel.bf16w_blocked_linear(x[i:i + 1], p, n, bias, k) for i in range(m)])
    assert torch.equal(got, alone)
    y = torch.empty(m, n)
    gemv_kernel.bf16w_blocked_linear_into(gemv_kernel.bf16w_into_args(x, p, y, bias=bias, n=n, k=k))
    assert torch.equal(y, got)
    bw = Bf16Weight(p, torch.float32, n, k if k % 2 else None)
    idx = torch.tensor([0, n - 1, n // 2])
    assert torch.equal(bw.rows(idx), w[idx].float()) and torch.equal(bw.dequantize(), w.float())
    for start in range(0, n, 32):
        rows = min(n - start, 45)
        view = bw.narrow(start, rows)
        assert torch.equal(view.dequantize(), w[start:start + rows].float())
        assert torch.equal(view.linear(x), gemv_kernel.bf16w_blocked_linear(x, p, n, None, k)[:, start:start + rows])
        lo = start + min(3, rows)
        assert torch.equal(bw.row_chunk(lo, start + rows), w[lo:start + rows])
    assert torch.equal(bw.row_chunk(5, n), w[5:])
    if n > 32:
        with pytest.raises(ValueError, match="multiple of 32"):
            bw.narrow(5, 3)


@needs_gemv
@pytest.mark.parametrize("blocked", [False, True])
def test_bf16_weight_refuses_what_it_cannot_hold(monkeypatch, blocked):
    """Ids outside the table (past the last row into the blocked layout's zero padding, negative ones) raise
    IndexError as the fp32 embedding does; row ranges past the weight and inputs of the wrong width raise
    ValueError (before: a 37-wide input against a 36-wide plain weight ran, a far wider one crashed); an empty
    weight is never blocked."""
    from tensorpar.decode import bf16_weights
    monkeypatch.setattr(bf16_weights, "BLOCK_MIN_IN", 0 if blocked else 10 ** 9)
    w = bf16_weights.to_bf16(torch.randn(100, 36))
    assert w.blocked == blocked and w.shape == (100, 36)
    assert torch.equal(w.rows(torch.tensor([0, 99])), w.dequantize()[[0, 99]])
    for bad in (100, 127, 128, -1):
        with pytest.raises(IndexError, match="^token id out of range: the embedding has 100 rows on this rank$"):
            w.rows(torch.tensor([3, bad]))
    for start, stop in ((90, 110), (-1, 5), (10, 5)):
        with pytest.raises(ValueError, match=r"must lie within \[0, 100\]"):
            w.row_chunk(start, stop)
    with pytest.raises(ValueError, match=r"must lie within \[0, 100\]"):
        w.narrow(64, 50)
    for x in (torch.randn(3, 37), torch.randn(36), torch.randn(1, 3, 36)):
        with pytest.raises(ValueError, match="^gemv bf16w into: "):
            (gemv_kernel.bf16w_blocked_linear(x, w.w, w.n, None) if blocked
             else gemv_kernel.bf16w_linear(x, w.w, None))
    assert not bf16_weights.to_bf16(torch.randn(5, 0)).blocked


@needs_gemv
@pytest.mark.parametrize("m,k,n", [(1, 288, 300), (2, 36, 53), (3, 100, 17)])
def test_bf16w_gemv_equals_widened_linear(m, k, n):
    """bf16 weights, fp32 input and output (no rounding to bf16): within 1e-5 relative of ``F.linear`` on the
    weight widened to fp32 (the same products, summed in another order); odd K takes the kernel's masked tail;
    the into-buffer entry gives the same bits."""
    from tensorpar.decode.bf16_weights import bf16_linear, to_bf16
    g = torch.Generator().manual_seed(m * k + n)
    x, w = torch.randn(m, k, generator=g), to_bf16(torch.randn(n, k, generator=g))
    bias = torch.randn(n, generator=g)
    want = torch.nn.functional.linear(x, w.w.float(), bias)
    got = bf16_linear(x, w, bias)
    assert got.dtype == torch.float32
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    y = torch.empty(m, n)
    gemv_kernel.bf16w_linear_into(gemv_kernel.bf16w_into_args(x, w.w, y))
    assert torch.equal(y, gemv_kernel.bf16w_linear(x, w.w, None))


def test_bf16_refused_for_a_bf16_model(tmp_path):
    """``--quantize bf16`` with ``--dtype bfloat16``: one line naming both and what works, in the launching process
    (check_quantize, from --dtype) and on the ranks (store_bf16, from the model), by the same rule."""
    from transformers import AutoConfig

    from tensorpar.decode.quantize import check_quantize, store_bf16
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.parallel import ParallelContext
    msg = (r"^--quantize bf16 with --dtype bfloat16: the weights are not fp32 "
           r"\(use --dtype float32, or --quantize none\)$")       # one short line (review)
    cfg = AutoConfig.for_model("llama")
    with pytest.raises(ValueError, match=msg):
        check_quantize("bf16", cfg, argparse.Namespace(sequence_parallel=False), "bfloat16")
    check_quantize("bf16", cfg, argparse.Namespace(sequence_parallel=False), "float32")
    ctx = ParallelContext.single()
    model, _ = build_parallel_model(make_model_folder(tmp_path / "llama", "llama"), ctx.tp, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=msg):
        store_bf16(model, ctx.tp)


@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("m,k,n,bias", [(3, 300, 1100, False), (17, 576, 1000, True), (512, 96, 1100, True)])
def test_bf16_linear_batch_equals_widened_linear(monkeypatch, m, k, n, bias, blocked):
    """More rows than the row step's (3, 17: our GEMV where it runs; 512: the chunks, our GEMV on the blocked
    layout; a 3-D input at 17), and the
    chunked path at every M (here 2**16 weights a chunk, so 1100, 1000 and 1100 outputs leave a partial last
    chunk): ``F.linear(x, W.float(), bias)`` up to the order of the fp32 sums. The GEMV sums in its own order; the
    BLAS picks its kernel by the GEMM's shape (a narrow last chunk, 3 rows); each output is still one K-long fp32
    sum, so each lies within ``K * eps * (|x| @ |W|^T + |bias|)`` of the exact sum and within twice that of the
    other (measured for the chunks: bitwise equal at full chunks, within 4e-7 of the largest output otherwise).
    ``blocked``: the weight in the bf16 blocked layout (the chunks then whole blocks, converted from it)."""
    from tensorpar.decode import bf16_weights
    if blocked and not gemv_kernel.available():
        pytest.skip("no GEMV kernel here: nothing is blocked")
    monkeypatch.setattr(bf16_weights, "_CHUNK_ELEMS", 2 ** 16)
    monkeypatch.setattr(bf16_weights, "BLOCK_MIN_IN", 0 if blocked else 10 ** 9)
    g = torch.Generator().manual_seed(m * k + n)
    shape = (m, k) if m != 17 else (1, m, k)
    x, w = torch.randn(*shape, generator=g), bf16_weights.to_bf16(torch.randn(n, k, generator=g))
    b = torch.randn(n, generator=g) if bias else None
    assert w.blocked == blocked
    wf = w.dequantize()
    want = torch.nn.functional.linear(x, wf, b)
    bound = 2 * k * torch.finfo(torch.float32).eps * torch.nn.functional.linear(
        x.abs(), wf.abs(), None if b is None else b.abs())
    got = bf16_weights.bf16_linear(x, w, b)
    chunked = bf16_weights.chunked_linear(x.reshape(m, k), w, b).view(want.shape)
    for y in (got, chunked):
        assert y.shape == want.shape and y.dtype == torch.float32
        assert ((y - want).abs() <= bound).all()


@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("m", [8, 64])
def test_bf16_linear_batch_transient_memory_bounded(monkeypatch, m, blocked):
    """At 8 rows (our GEMV where it runs) and 64 (the chunks) the most memory ``bf16_linear`` holds beyond its
    inputs is its output plus one chunk buffer (``_CHUNK_ELEMS`` fp32 weights), not the weight converted to fp32
    (2 MB here, what ``F.linear(x, W.float())`` allocated per call): live bytes summed over the profiler's
    allocations."""
    from tensorpar.decode import bf16_weights
    chunk = 2 ** 16
    monkeypatch.setattr(bf16_weights, "_CHUNK_ELEMS", chunk, raising=False)
    monkeypatch.setattr(bf16_weights, "BLOCK_MIN_IN", 0 if blocked else 10 ** 9)
    x, w = torch.randn(m, 512), bf16_weights.to_bf16(torch.randn(1024, 512))
    with torch.autograd.profiler.profile(profile_memory=True) as prof:
        y = bf16_weights.bf16_linear(x, w)
    live = peak = 0
    for e in prof.function_events:
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    assert 0 < peak <= y.numel() * 4 + chunk * 4, f"peak transient {peak} bytes; the fp32 weight is {1024 * 512 * 4}"
