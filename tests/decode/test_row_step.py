"""The lean path's one- and two-row decode step (tensorpar/decode/row_step.py) and its fused kernels
(tensorpar/decode/fused.py, csrc/step.cpp) against their references: the unfused torch ops, the general decode loop
of LeanDecoder.forward_segments, and transformers' greedy tokens at tp 1 and 2 (shared-memory and gloo
all-reduces)."""
import sys

import pytest
import torch

from tensorpar.decode import fused, gemv_kernel, q8_kernel
from tensorpar.decode.row_step import RowStep
from tensorpar.generate import SamplingConfig, generate_tokens
from tests._ranks import run_tp
from tests.decode.test_generate import ARCHS, hf_reference, make_model_folder, prompts

needs_kernels = pytest.mark.skipif(not (gemv_kernel.available() and fused.available()),
                                   reason="TENSORPAR_GEMV_KERNEL=0, neither AVX-512 BF16 nor AVX2 + FMA, no compiler")
#: the fused RMSNorm adds its sum of squares in another order than torch's ``mean`` (16 fp32 lanes): the sum then
#: differs by a few units in its last place, and the output, after rsqrt and two products, by at most ~4 units in
#: the last place of the largest output (2^-21 relative to it)
NORM_TOL = 2.0 ** -21


def _torch_norm(x, w, eps):
    """The families' fp32 RMSNorm as the lean path's torch ops compute it (tensorpar.decode.kernels.rms_norm_fn)."""
    return torch.mul(x, torch.mul(x, x).mean(-1, keepdim=True).add_(eps).rsqrt_()).mul_(w)


@needs_kernels
@pytest.mark.parametrize("rows,H,nparts", [(1, 576, 2), (2, 576, 2), (2, 37, 1), (1, 64, 3), (2, 100, 0)])
def test_add_rms_norm_equals_unfused(rows, H, nparts):
    """x += ((p0 + p1) + p2) is bitwise torch's ``x.add_(sum)`` with the sum in rank order (the shared-memory
    all-reduce's); the norm of the new x is within NORM_TOL of torch's formula (its sum of squares in another
    order)."""
    g = torch.Generator().manual_seed(rows * H + nparts)
    x = torch.randn(rows, H, generator=g) * 3
    parts = [torch.randn(rows, H, generator=g) for _ in range(nparts)]
    w, eps = torch.randn(H, generator=g), 1e-5
    want_x = x.clone()
    if parts:
        s = torch.add(parts[0], parts[1]) if nparts > 1 else parts[0]
        for p in parts[2:]:
            s = s.add_(p)
        want_x.add_(s)
    want = _torch_norm(want_x, w, eps)
    out = torch.empty(rows, H)
    fused.add_rms_norm(x, parts, w, eps, out)
    assert torch.equal(x, want_x)
    assert (out - want).abs().max() <= NORM_TOL * want.abs().max()


@needs_kernels
@pytest.mark.parametrize("rows,nq,nkv,d,rd", [(1, 5, 2, 64, 64), (2, 4, 1, 8, 8), (2, 3, 3, 16, 8)])
def test_rope_store_equals_rotate_and_copy(rows, nq, nkv, d, rd):
    """Rotary of the q and k heads and the K/V cache write in one call are bitwise the lean path's ``rotate`` and
    copies, full and partial rotary (rd < d), rows at different cache positions."""
    import ctypes

    from tensorpar.decode.block import rotate
    g = torch.Generator().manual_seed(rows * 100 + d)
    qkv = torch.randn(rows, (nq + 2 * nkv) * d, generator=g)
    cos, sin = torch.randn(rows, 1, rd, generator=g), torch.randn(rows, 1, rd, generator=g)
    half = rd // 2
    perm = torch.cat([torch.arange(half, rd), torch.arange(0, half)])
    kc, vc = torch.zeros(nkv, 3, 8, d), torch.zeros(nkv, 3, 8, d)          # [kv, blocks, block_size, d]
    at = [(2, 5), (0, 7)][:rows]                                             # (block, offset) of each row
    q_out = torch.empty(rows, nq, d)
    offs = (ctypes.c_int64 * rows)(*[(b * 8 + o) * d for b, o in at])
    fused.rope_store((qkv.data_ptr(), rows, nq, nkv, d, rd, cos.data_ptr(), sin.data_ptr(), q_out.data_ptr(),
                      kc.data_ptr(), vc.data_ptr(), kc.stride(0), offs))
    v3 = qkv.view(rows, nq + 2 * nkv, d)
    want = rotate(v3[:, :nq + nkv], cos, sin, perm)
    assert torch.equal(q_out, want[:, :nq])
    for r, (b, o) in enumerate(at):
        assert torch.equal(kc[:, b, o], want[r, nq:])
        assert torch.equal(vc[:, b, o], v3[r, nq + nkv:])


@needs_kernels
@pytest.mark.parametrize("rows,nq,kv_of,d,L,masked", [(1, 5, [0, 0, 0, 1, 1], 64, 37, False),
                                                      (2, 4, [0, 1, 1, 1], 64, 9, True),
                                                      (2, 6, [0, 0, 0, 1, 1, 1], 4, 20, True)])
def test_decode_attention_equals_sdpa(rows, nq, kv_of, d, L, masked):
    """One query per row over the cache, each query head reading its KV head in place (uneven splits and equal
    groups), rows in other blocks, a padding mask: within 1e-5 of the largest output of
    ``scaled_dot_product_attention`` on the KV heads copied per query head (the lean path's reference for uneven
    splits): the same products, summed in another order, ``expf`` for torch's exp."""
    import ctypes
    g = torch.Generator().manual_seed(rows * L + d)
    nkv, bs = max(kv_of) + 1, 40
    kc, vc = torch.randn(nkv, 4, bs, d, generator=g), torch.randn(nkv, 4, bs, d, generator=g)
    q = torch.randn(rows, nq, d, generator=g)
    blocks = [3, 1][:rows]
    mask = torch.ones(rows, 1, 1, L, dtype=torch.bool)
    if masked:
        mask[-1, ..., :3] = False                                          # a left-padded row
    out, scratch = torch.empty(rows, nq * d), torch.empty(bs)
    tables = (ctypes.c_int64 * rows)(*blocks)                           # one block per row (the static cache)
    fused.decode_attention((q.data_ptr(), rows, nq, d, kc.data_ptr(), vc.data_ptr(), kc.stride(0), tables, 1, bs, L,
                            mask.data_ptr() if masked else None, mask.stride(0), (ctypes.c_int64 * nq)(*kv_of),
                            d ** -0.5, scratch.data_ptr(), out.data_ptr()))
    idx = torch.tensor(kv_of)
    keys = kc[:, blocks, :L].transpose(0, 1).index_select(1, idx)                          # [rows, nq, L, d]
    vals = vc[:, blocks, :L].transpose(0, 1).index_select(1, idx)
    want = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), keys, vals,
                                                            attn_mask=mask if masked else None, scale=d ** -0.5)
    want = want.reshape(rows, nq * d)
    assert (out - want).abs().max() <= 1e-5 * want.abs().max()


@needs_kernels
@pytest.mark.parametrize("rows,f", [(1, 768), (2, 37)])
def test_silu_mul_equals_torch(rows, f):
    """silu(gate) * up of a gate-up row in one call: within 4 units in the last place of each of torch's
    ``F.silu(gate) * up`` (``expf`` for torch's vectorised exp, which may differ by an ulp)."""
    g = torch.Generator().manual_seed(rows * f)
    gu = torch.randn(rows, 2 * f, generator=g) * 4
    out = torch.empty(rows, f)
    fused.silu_mul((gu.data_ptr(), rows, f, out.data_ptr()))
    want = torch.nn.functional.silu(gu[:, :f]) * gu[:, f:]
    assert ((out - want).abs() <= 4 * torch.finfo(torch.float32).eps * want.abs() + 1e-30).all()


@needs_kernels
def test_program_runs_the_calls_it_replaces():
    """A program (one call from Python, csrc/step.cpp ``tp_run_at``) of a GEMV, SiLU and a second GEMV writes bitwise
    what the three calls write; an op of the wrong length is refused, and run_program refuses a program that stops
    at an exchange."""
    import ctypes
    g = torch.Generator().manual_seed(7)
    h, w1, w2 = torch.randn(2, 96, generator=g), torch.randn(2 * 40, 96, generator=g), torch.randn(96, 40, generator=g)
    outs = []
    for fused_call in (False, True):
        gu, a, y = torch.full((2, 80), float("nan")), torch.full((2, 40), float("nan")), torch.full((2, 96), 0.5)
        mm1, mm2 = gemv_kernel.into_args(h, w1, gu), gemv_kernel.into_args(a, w2, y)
        silu = (gu.data_ptr(), 2, 40, a.data_ptr())
        if fused_call:
            gemv = gemv_kernel.address("tp_gemv")
            prog = fused.program([(fused.OP_GEMV, gemv, *mm1), (fused.OP_SILU, *silu), (fused.OP_GEMV, gemv, *mm2)])
            step = (ctypes.c_int64 * fused.STEP_TABLES)()
            fused.run_program(ctypes.addressof(prog), ctypes.addressof(step))
        else:
            gemv_kernel.linear_into(mm1)
            fused.silu_mul(silu)
            gemv_kernel.linear_into(mm2)
        outs.append((gu, a, y))
    for x, z in zip(*outs):
        assert torch.equal(x, z)
    with pytest.raises(ValueError, match="words"):
        fused.program([(fused.OP_SILU, 0, 1, 2)])
    ctx = (ctypes.c_int64 * 20)()                       # mode 0: the exchange is the caller's
    prog = fused.program([(fused.OP_EXCHANGE, ctypes.addressof(ctx))])
    with pytest.raises(RuntimeError, match="no exchange"):
        fused.run_program(ctypes.addressof(prog), ctypes.addressof(step))


@pytest.mark.skipif(not q8_kernel.available(), reason="no AVX512-VNNI / AVX2 CPU or no C++ compiler")
@pytest.mark.parametrize("m,k,n", [(1, 288, 300), (2, 96, 53), (2, 32 * 7, 17)])
def test_q8_linear_into_equals_q8_linear(m, k, n):
    """The row step's int8 matmul (prepared arguments, a scratch shared by matmuls of several widths, the output
    written into a preallocated buffer) is bitwise the general loop's ``q8_linear``: the same kernel and the same
    activation quantization; an odd number of blocks (7) takes the kernel's 256-bit tail."""
    from tensorpar.decode.int8 import quantize_weight
    g = torch.Generator().manual_seed(m * k + n)
    x, w = torch.randn(m, k, generator=g) * 2, quantize_weight(torch.randn(n, k, generator=g), write=False)
    scratch = q8_kernel.scratch(2, 512)
    y = torch.full((m, n), float("nan"))
    args = q8_kernel.into_args(x, w.q, w.scale, y, scratch)
    q8_kernel.linear_into(args)
    assert torch.equal(y, torch.ops.tensorpar.q8_linear(x, w.q, w.scale, None))
    with pytest.raises(ValueError, match="scratch"):
        q8_kernel.into_args(x, w.q, w.scale, y, q8_kernel.scratch(1, 32))


def _stored(w) -> tuple:
    """The tensors of a stored weight as copies: an :class:`~tensorpar.decode.int8.Int8Weight`'s ``q`` and
    ``scale``; a :class:`~tensorpar.decode.bf16_weights.Bf16Weight`'s bf16 matrix in the plain ``[out, in]``
    layout (blocked or not)."""
    from tensorpar.decode.bf16_weights import Bf16Weight
    return (w.plain().clone(),) if isinstance(w, Bf16Weight) else (w.q.clone(), w.scale.clone())


def job_logits(ctx, folder, ids, mask, want, shm, quantize="none", layout=False, tp_comm="fp32", oneshot=None):
    """Prefill and decode steps feeding ``want`` ``[b, steps]`` (transformers' tokens) to a batch-``b`` LeanDecoder,
    with its row step and with the general loop: per step the logits of both, and how often the row step ran; then
    generate's greedy tokens. ``quantize``: ``--quantize``'s value, applied after loading (fp32 compute).
    ``layout``: also ``out["stored"]``, the stored tensors of layer 0's row-parallel o_proj and down_proj
    (``(q, scale)`` of int8, ``(w,)`` of bf16; this rank's ``[out, in_r]`` slices), and ``out["module"]``, the module
    path's greedy tokens. ``tp_comm``: ``--tp-comm``'s value (``ctx.tp.compression``) for the run. ``oneshot``: the
    shared-memory communicator's one-shot size in bytes for the run (smaller: the step's all-reduces go two-shot)."""
    from tensorpar.decode.int8 import lean_weight
    from tensorpar.decode.lean import LeanDecoder
    from tensorpar.decode.quantize import apply_quantize
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.shm import disable_fast_collectives, enable_fast_collectives
    if shm:
        enable_fast_collectives(ctx.tp, "on")
        if oneshot is not None:
            ctx.tp.fast.oneshot_bytes = oneshot
    ctx.tp.compression = tp_comm
    try:
        model, _ = build_parallel_model(folder, ctx.tp)
        apply_quantize(model, ctx.tp, quantize)
        b, steps = want.shape
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = {}
        for name in ("row", "general"):
            lean = LeanDecoder(model, ctx.tp, max_batch=b, max_len=ids.shape[1] + steps + 1)
            has = lean.row_step is not None
            if name == "general":
                lean.row_step = None
            ran = []
            if lean.row_step is not None:
                call = lean.row_step.__call__
                lean.row_step = type("Counted", (), {"runs": lean.row_step.runs, "dec": lean.row_step.dec, "R": lean.row_step.R,
                                                     "run_split": RowStep.run_split,
                                                     "__call__": lambda self, *a, **k: ran.append(1) or call(*a, **k)})()
            logits = [lean.prefill(ids, mask, pos)]
            for t in range(steps - 1):
                logits.append(lean.decode(want[:, t:t + 1], pos[:, -1:] + 1 + t, ids.shape[1] + t))
            out[name] = (logits, has, len(ran))
        if layout:
            L0 = model.model.layers[0]
            out["stored"] = {n: _stored(lean_weight(m))
                             for n, m in (("o_proj", L0.self_attn.o_proj), ("down_proj", L0.mlp.down_proj))}
            out["module"] = generate_tokens(model, ctx.tp, ids, mask, sampling=SamplingConfig(max_new_tokens=steps),
                                            path="hf").tokens
        tokens = generate_tokens(model, ctx.tp, ids, mask, sampling=SamplingConfig(max_new_tokens=steps)).tokens
        return out, tokens
    finally:
        ctx.tp.compression = "fp32"
        if shm:
            disable_fast_collectives(ctx.tp)


@needs_kernels
@pytest.mark.parametrize("arch,tp,batch,shm", [("llama", 1, 1, False), ("llama", 1, 2, False),
                                               ("llama", 2, 1, True), ("qwen2", 2, 1, True),
                                               ("llama", 2, 6, True), ("qwen2", 1, 3, False),
                                               pytest.param("llama", 2, 2, True, marks=pytest.mark.slow),
                                               pytest.param("llama", 2, 1, False, marks=pytest.mark.slow),
                                               pytest.param("llama", 3, 1, True, marks=pytest.mark.slow),
                                               pytest.param("llama", 4, 2, True, marks=pytest.mark.slow),
                                               pytest.param("qwen2", 1, 2, False, marks=pytest.mark.slow),
                                               pytest.param("qwen2", 3, 1, True, marks=pytest.mark.slow),
                                               pytest.param("qwen2", 4, 2, True, marks=pytest.mark.slow)])
def test_row_step_equals_general_loop_and_transformers(pools, tmp_path, arch, tp, batch, shm):
    """A decoder of batch 1 to 6 runs its decode steps through the row step; their logits are within fp32 rounding
    of the general loop's (1e-5 of the largest: the fused norms differ in the last bits, the GEMV is the same) and
    greedy tokens equal transformers', at tp=1, 2, 3 and 4 over shared memory (the fused all-reduce reads the ranks'
    slots; the 9 query heads split unevenly at 2 and 4, the 53-token vocabulary at 2, 3 and 4) and at tp=2 over
    gloo (it adds all_reduce's result). Batch 2, 3 and 6: left-padded rows (decode masks); 6 rows run the GEMV as a
    group of 4 input rows and one of 2, 3 rows as one group of 3. qwen2: QKV biases and an untied
    head; the biases go to the QKV matmul's kernel as the general loop's call of the same kernel adds them."""
    folder = make_model_folder(tmp_path / arch, arch)
    ids, mask = prompts(ARCHS[arch]["vocab_size"])
    rows = {1: [0], 2: [0, 2], 3: [0, 1, 2], 6: [0, 1, 2, 2, 0, 1]}[batch]
    ids, mask = ids[rows], mask[rows]
    steps = 10
    want, _ = hf_reference(folder, ids, mask, steps)
    for r, (out, tokens) in enumerate(run_tp(pools, tp, job_logits, folder, ids, mask, want, shm)):
        got, has, ran = out["row"]
        ref, _, ran_general = out["general"]
        # the prompt too, as one row per token, when its b x s tokens fit in the row step's rows
        assert has and ran == steps - (ids.numel() > gemv_kernel.MAX_ROWS) and ran_general == 0, (has, ran)
        for a, b in zip(got, ref):
            assert (a - b).abs().max() <= 1e-5 * b.abs().max(), f"rank {r}"
        assert torch.equal(tokens, want), f"tp={tp} rank {r}: {tokens} != transformers {want}"


@needs_kernels
def test_row_step_with_all_reduces_above_the_one_shot_size(pools, tmp_path):
    """A step whose ``[rows, H]`` sums are larger than the shared-memory one-shot size (64 rows of the 1.1B's 2048
    fp32 are 512 KiB against 256 KiB; here 6 rows of 24 against 256 bytes) takes the two-shot sum, and its tokens
    and logits still equal the general loop's and transformers' (before, the exchange raised ValueError)."""
    folder = make_model_folder(tmp_path / "llama", "llama")
    ids, mask = prompts(ARCHS["llama"]["vocab_size"])
    ids, mask = ids[[0, 1, 2, 2, 0, 1]], mask[[0, 1, 2, 2, 0, 1]]
    steps = 6
    want, _ = hf_reference(folder, ids, mask, steps)
    for r, (out, tokens) in enumerate(run_tp(pools, 2, job_logits, folder, ids, mask, want, True, "none", False, "fp32", 256)):
        (got, has, ran), (ref, _, _) = out["row"], out["general"]
        assert has and ran == steps - 1, (has, ran)
        for a, b in zip(got, ref):
            assert (a - b).abs().max() <= 1e-5 * b.abs().max(), f"rank {r}"
        assert torch.equal(tokens, want), f"rank {r}: {tokens} != transformers {want}"


@needs_kernels
def test_sliding_window_row_step_runs_inside_the_window(pools, tmp_path):
    """Mistral with a 10-position sliding window, tp=2: decode steps whose keys all lie inside the window (lengths
    8-10 after a 7-token prompt, and the prompt itself as one row per token) run the row step, the later ones the
    general loop, which narrows the mask; logits
    within the fp32 bound of the llama test, greedy tokens equal transformers' (which apply the window)."""
    ARCHS["mistral_w10"] = dict(ARCHS["mistral"], sliding_window=10)
    try:
        folder = make_model_folder(tmp_path / "mistral", "mistral_w10")
    finally:
        del ARCHS["mistral_w10"]
    ids, mask = prompts(ARCHS["mistral"]["vocab_size"])
    ids, mask = ids[:1], mask[:1]
    steps = 8                                   # decode lengths 8 .. 14
    want, _ = hf_reference(folder, ids, mask, steps)
    for r, (out, tokens) in enumerate(run_tp(pools, 2, job_logits, folder, ids, mask, want, True)):
        got, has, ran = out["row"]
        ref, _, _ = out["general"]
        assert has and ran == 4, (has, ran)          # the 7-token prompt as rows, then lengths 8-10
        for a, b in zip(got, ref):
            assert (a - b).abs().max() <= 1e-5 * b.abs().max(), f"rank {r}"
        assert torch.equal(tokens, want), f"rank {r}: {tokens} != transformers {want}"


#: --tp-comm int8 (compressed partial sums), row step against the general loop: both quantize their partial sums
#: per block of 32 before the exchange; the partials differ in the last bits (fused norms and attention), which the
#: quantization absorbs unless an element lies within them of a half step: it rounds the other way, moves by one
#: step of its block (~1e-3 of the logits), and through the KV cache every later step with it. Measured on this
#: model at tp=2, the prompt through the row step too (2026-12-03): the prompt's logits within 1.4e-7 of the
#: largest, one such flip at decode step 4 (1.3e-3 on rank 0, 3e-4 on rank 1), 5e-5 at most on the other steps;
#: greedy tokens equal. 1e-2 allows a few flips (as INT8_TOL); the tokens are compared too.
TP_COMM_INT8_TOL = 1e-2


@needs_kernels
@pytest.mark.parametrize("shm", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_tp_comm_int8_row_step_equals_general_loop(pools, tmp_path, shm):
    """--tp-comm int8 no longer keeps decode off the row step: at tp=2 the row step runs every decode step, and its
    logits stay within TP_COMM_INT8_TOL of the largest of the general loop's under the same compression; their
    all-reduces are compressed alike (counted in tests/core/test_comm_int8.py)."""
    folder = make_model_folder(tmp_path / "llama", "llama")
    ids, mask = prompts(ARCHS["llama"]["vocab_size"])
    ids, mask = ids[:1], mask[:1]
    steps = 10
    want, _ = hf_reference(folder, ids, mask, steps)
    worst = 0.0
    for r, (out, tokens) in enumerate(run_tp(pools, 2, job_logits, folder, ids, mask, want, shm, "none", False,
                                             "int8")):
        got, has, ran = out["row"]
        ref, _, ran_general = out["general"]
        # the prompt too, as one row per token, when its b x s tokens fit in the row step's rows
        assert has and ran == steps - (ids.numel() > gemv_kernel.MAX_ROWS) and ran_general == 0, (has, ran)
        for a, b in zip(got, ref):
            worst = max(worst, float((a - b).abs().max() / b.abs().max()))
        assert torch.equal(tokens, want), f"rank {r}: {tokens} != transformers {want}"
    print(f"--tp-comm int8, row step vs general loop: worst logit difference {worst:.2e} of the largest")
    assert worst <= TP_COMM_INT8_TOL, worst


#: int8 row step against the general loop: each matmul is the same kernel on the same quantized input, bitwise, and
#: the quantization absorbs the last-bit differences of the fused norms and attention, except where an activation's
#: x / d lies within them of a half step: it rounds to the other int8 step, moving that input by one step
#: d = max|x_block| / 127 (the quantization error's own size), and through the KV cache every later step with it.
#: Measured on this model: the unpadded row's logits bitwise equal; the padded row's from step 4 on within 4.2e-3 of
#: the largest (one flip: an attention output at x / d = 63.5 exactly, 6e-8 apart); 1e-2 allows two such.
INT8_TOL = 1e-2


@needs_kernels
@pytest.mark.skipif(not q8_kernel.available(), reason="no AVX512-VNNI / AVX2 CPU or no C++ compiler")
@pytest.mark.parametrize("tp,batch", [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow),
                                      pytest.param(2, 2, marks=pytest.mark.slow),
                                      pytest.param(1, 1, marks=pytest.mark.slow)])
def test_int8_row_step_equals_general_loop_and_quantized_reference(pools, tmp_path, monkeypatch, tp, batch):
    """A model quantized by ``--quantize int8`` computing in fp32 decodes its one- and two-row steps through the row
    step (Q8_0 x Q8_0 kernel into the step's buffers): the logits are within INT8_TOL of the general loop's, and the
    greedy tokens at tp=1 and tp=2 (shared memory; 9 query heads split 5 / 4) equal those of transformers' unsharded
    model quantized in plain PyTorch (tests/decode/test_quant.py's reference: Q8_0 weights, each Linear's input
    quantized per block of 32). Batch 2: a left-padded row."""
    from tests.decode import test_generate as tg
    from tests.decode.test_quant import QARCHS, fake_quant_reference
    monkeypatch.setitem(tg.ARCHS, "llama", QARCHS["llama"])       # every rank's Linear inputs whole blocks of 32
    folder = str(make_model_folder(tmp_path / "llama", "llama"))
    ids, mask = prompts(QARCHS["llama"]["vocab_size"])
    rows = {1: [0], 2: [0, 2], 3: [0, 1, 2], 6: [0, 1, 2, 2, 0, 1]}[batch]
    ids, mask = ids[rows], mask[rows]
    steps = 10
    want, _ = fake_quant_reference(folder, ids, mask, steps)
    for r, (out, tokens) in enumerate(run_tp(pools, tp, job_logits, folder, ids, mask, want, tp > 1, "int8")):
        got, has, ran = out["row"]
        ref, _, ran_general = out["general"]
        # the prompt too, as one row per token, when its b x s tokens fit in the row step's rows
        assert has and ran == steps - (ids.numel() > gemv_kernel.MAX_ROWS) and ran_general == 0, (has, ran)
        for a, b in zip(got, ref):
            assert (a - b).abs().max() <= INT8_TOL * b.abs().max(), f"rank {r}: {(a - b).abs().max()}"
        assert torch.equal(tokens, want), f"int8 tp={tp} rank {r}: {tokens} != quantized reference {want}"


#: a Llama whose 10 query / 2 KV heads of 32 do not divide 3 (tp=3: 4 / 3 / 3 query heads, the middle rank holding
#: both KV heads; tp=4: 3 / 3 / 2 / 2) and whose every rank's share of a row-parallel input is whole blocks of 32 at
#: tp 1-4 (o_proj: its heads x 32; down_proj: 384 / tp = 384, 192, 128, 96); hidden 160 (a multiple of 10 heads and of
#: 32); vocabulary 53 (uneven at 3 and 4); tied embedding
UNEVEN = dict(model_type="llama", vocab_size=53, hidden_size=160, intermediate_size=384, num_hidden_layers=2,
              num_attention_heads=10, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
              tie_word_embeddings=True)
#: bf16 weights, fp32 compute: tp=N multiplies the same bf16 values as tp=1 (asserted bitwise), so only the order of
#: the fp32 sums differs (each row-parallel product split over the ranks and added in rank order by the all-reduce,
#: and the fused norms' last bits after it): 1e-5 of the largest logit, the fp32 row step's bound
BF16_TOL = 1e-5


@pytest.mark.parametrize("fmt,tp,batch", [("int8", 3, 1), ("bf16", 4, 2),
                                          pytest.param("int8", 4, 2, marks=pytest.mark.slow),
                                          pytest.param("bf16", 3, 1, marks=pytest.mark.slow)])
def test_quantized_row_step_tp3_tp4_uneven_heads(pools, tmp_path, monkeypatch, fmt, tp, batch):
    """``--quantize int8`` and ``--quantize bf16`` at tp=3 and tp=4 on a Llama whose head counts do not divide 3
    (``UNEVEN``; batch 2: a left-padded row): where the kernels run (AVX-512 BF16 / VNNI and a C++ compiler) the
    row step decodes every step (one row at tp=3, two at tp=4) with logits within INT8_TOL / BF16_TOL of the
    general loop's at the same layout (elsewhere no decoder has a row step, and the rest below holds for the
    general loop: the PyTorch int8 path, ``F.linear`` on the widened bf16 weights); generate's greedy tokens and the
    module path's equal the quantized unsharded reference's (int8: Q8_0 weights and inputs in plain PyTorch; bf16:
    the fp32 model with bf16-rounded weights); and tp=N equals tp=1:

    * the stored weights: each rank's o_proj and down_proj tensors (``q`` and ``scale`` of int8, ``w`` of bf16) are
      bitwise its columns of tp=1's. For int8 this is the block layout: tp moves no block boundary of a row-parallel
      input, since every rank's share is a whole number of blocks of 32 and the shares lie in rank order (rank r's
      blocks are tp=1's blocks ``off_r / 32 ...``); a block's weight scale and its activation scale
      ``d = max|x_block| / 127`` depend on that block's 32 values only, and column-parallel inputs are whole rows on
      every rank. So tp=N computes tp=1's quantized model, and the rows below differ only in the order of fp32 sums.
      (Had a split cut a block, a rank would scale its part of the block by its own max: another model at each tp,
      off by the quantization's own size; ``block_misfit`` refuses such splits before the ranks start.)
    * the logits of every step, the ranks' vocabulary slices joined, against tp=1's row step: bf16 within BF16_TOL;
      int8 within INT8_TOL: the order of the sums moves an activation by a few units in its last place, which the
      next quantization absorbs except where ``x / d`` lies within that of a half step: it then rounds to the other
      step, as between the row step and the general loop (INT8_TOL's derivation above). Measured on a CPU without
      AVX-512 (no row step; the general loop's PyTorch paths): tp=3 and 4 within 1.8e-7 - 2.7e-7 of tp=1's largest
      logit, int8 and bf16 alike (no activation re-rounded in these 10 steps)."""
    from tests.decode import test_generate as tg
    monkeypatch.setitem(tg.ARCHS, "llama", UNEVEN)
    folder = str(make_model_folder(tmp_path / "llama", "llama"))
    ids, mask = prompts(UNEVEN["vocab_size"])
    rows = {1: [0], 2: [0, 2], 3: [0, 1, 2], 6: [0, 1, 2, 2, 0, 1]}[batch]
    ids, mask = ids[rows], mask[rows]
    steps = 10
    if fmt == "int8":
        from tests.decode.test_quant import fake_quant_reference
        want, _ = fake_quant_reference(folder, ids, mask, steps)
        tol, kernel = INT8_TOL, q8_kernel.available()
    else:
        from tests.decode.test_bf16_weights import rounded_reference
        want, _ = rounded_reference(folder, ids, mask, steps)
        tol, kernel = BF16_TOL, gemv_kernel.available()
    row_step = kernel and fused.available()
    (one, one_tokens), = run_tp(pools, 1, job_logits, folder, ids, mask, want, False, fmt, True)
    res = run_tp(pools, tp, job_logits, folder, ids, mask, want, row_step, fmt, True)
    assert torch.equal(one_tokens, want), f"{fmt} tp=1: {one_tokens} != reference {want}"
    for r, (out, tokens) in enumerate(res):
        got, has, ran = out["row"]
        ref, _, ran_general = out["general"]
        want_ran = steps - (ids.numel() > gemv_kernel.MAX_ROWS) if row_step else 0        # the prompt as rows too
        assert has == row_step and ran == want_ran and ran_general == 0, (has, ran)
        for a, b in zip(got, ref):
            assert (a - b).abs().max() <= tol * b.abs().max(), f"{fmt} tp={tp} rank {r}: {(a - b).abs().max()}"
        assert torch.equal(tokens, want), f"{fmt} tp={tp} rank {r}: {tokens} != reference {want}"
        assert torch.equal(out["module"], want), f"{fmt} tp={tp} rank {r}: module path {out['module']} != {want}"
    for name, full in one["stored"].items():
        for i, t in enumerate(full):
            joined = torch.cat([out["stored"][name][i] for out, _ in res], dim=1)
            assert torch.equal(joined, t), f"{fmt} tp={tp}: {name}'s stored tensor {i} is not tp=1's, sliced"
    for step, b in enumerate(one["row"][0]):
        a = torch.cat([out["row"][0][step] for out, _ in res], dim=-1)                 # [b, V]: vocab in rank order
        err = (a - b).abs().max().item()
        assert err <= tol * b.abs().max().item(), f"{fmt} tp={tp} step {step}: logits differ from tp=1 by {err}"


def test_row_step_stays_out_of_what_it_does_not_run(tmp_path):
    """Deterministic decoders, oneDNN-prepacked ones (max_batch above the row step's MAX_ROWS, the weights not
    blocked) and sliding-window models keep the general loop."""
    from tensorpar.decode.lean import LeanDecoder
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.parallel import ParallelContext
    ctx = ParallelContext.single()
    model, _ = build_parallel_model(make_model_folder(tmp_path / "llama", "llama"), ctx.tp)
    assert LeanDecoder(model, ctx.tp, max_batch=1, max_len=8, deterministic=True).row_step is None
    big = LeanDecoder(model, ctx.tp, max_batch=gemv_kernel.MAX_ROWS + 1, max_len=8, block=False)
    assert big.row_step is None and big.packed       # blocked (the default) it keeps the row step: decode_chunks
    assert LeanDecoder(model, ctx.tp, max_batch=gemv_kernel.MAX_ROWS, max_len=8).row_step is not None
    assert LeanDecoder(model, ctx.tp, max_batch=1, max_len=8, prepack=False).row_step is None
    # the fused norm replaces only the probed fp32 formula w * x_hat, never a module (Gemma's (1 + w) * x_hat has
    # weight and eps attributes too)
    from tensorpar.decode.kernels import rms_norm_fn
    from tensorpar.decode.row_step import _norm
    mod = model.model.layers[0].input_layernorm
    assert _norm(mod) is None and _norm(rms_norm_fn(mod)) is not None
    gemma = type("GemmaLike", (), {"weight": mod.weight, "eps": 1e-6})()
    assert _norm(gemma) is None


@needs_kernels
def test_a_dropped_decoder_and_its_weights_are_freed_without_garbage_collection(tmp_path, monkeypatch):
    """A decoder with a row step is freed as soon as it is dropped: the row step refers back to it weakly, so the two
    are no reference cycle (which lived until the next garbage collection). That cycle kept a batch-1 generate's
    decoder, and its views of the plain weights, alive while a later batch-32 generate packed the weights: SmolLM2
    fp32 at tp=2 held both copies, +305-327 MB RSS per rank against +98-110 MB with the cycle gone (load average
    5-6; docs/memory.md). Here with the garbage collector off: the dropped decoder is gone at once; generate at
    batch 1 then MAX_ROWS + 1 (packed for the call, plain again after it) releases the first engine without a collection and
    frees the plain fused q/k/v weight it read."""
    import gc
    import weakref

    from tensorpar.decode.lean import LeanDecoder
    from tensorpar.decode.packed import packed_model
    from tensorpar.generate import cached_engine
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.layers.fused import FUSED_KEY
    from tensorpar.parallel import ParallelContext
    ctx = ParallelContext.single()
    model, _ = build_parallel_model(make_model_folder(tmp_path / "llama", "llama"), ctx.tp)
    collections = []
    collect = gc.collect
    # who asked (release_engine's caller): _engine replacing the kept engine, or settle dropping a packed one
    monkeypatch.setattr(gc, "collect", lambda *a: collections.append(sys._getframe(2).f_code.co_name) or collect(*a))
    ids = torch.tensor([[5, 6, 7, 8]])
    gc.disable()
    try:
        dec = LeanDecoder(model, ctx.tp, max_batch=1, max_len=8)
        assert dec.row_step is not None
        ref = weakref.ref(dec)
        del dec
        assert ref() is None, "a dropped decoder with a row step stayed alive"
        one = generate_tokens(model, ctx.tp, ids, sampling=SamplingConfig(max_new_tokens=3)).tokens
        first = weakref.ref(cached_engine(model))
        assert first().lean.row_step is not None
        fused = weakref.ref(model.model.layers[0].self_attn.__dict__[FUSED_KEY][0])
        rows = gemv_kernel.MAX_ROWS + 1                                     # more than the row step runs: packed
        many = generate_tokens(model, ctx.tp, ids.repeat(rows, 1), sampling=SamplingConfig(max_new_tokens=3)).tokens
        assert not packed_model(model) and cached_engine(model) is None     # packed for the call, plain after
        assert first() is None and fused() is None and "_engine" not in collections, collections
    finally:
        gc.enable()
    assert torch.equal(many, one.repeat(rows, 1))


def job_smollm2(ctx, folder, ids):
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.shm import disable_fast_collectives, enable_fast_collectives
    enable_fast_collectives(ctx.tp, "on")
    try:
        model, _ = build_parallel_model(folder, ctx.tp)
        return generate_tokens(model, ctx.tp, ids, sampling=SamplingConfig(max_new_tokens=32)).tokens
    finally:
        disable_fast_collectives(ctx.tp)


@needs_kernels
@pytest.mark.network
@pytest.mark.slow
def test_smollm2_batch_one_row_step_equals_transformers(pools):
    """SmolLM2-135M at batch 1 (the row step decodes; 9 query heads over 3 KV heads split 5 / 4 per rank, the uneven
    layout) at tp=2 over shared memory gives transformers' 32 greedy tokens for each of three prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tensorpar.hub import resolve_model
    folder = str(resolve_model("smollm2", progress=False))
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt in ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):"]:
        ids = tok([prompt], return_tensors="pt")["input_ids"]
        with torch.no_grad():
            want = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False, eos_token_id=None,
                                  pad_token_id=tok.eos_token_id)[:, ids.shape[1]:]
        for r, got in enumerate(pools(2).run(job_smollm2, folder, ids)):
            assert torch.equal(got, want), f"{prompt!r} rank {r}: {tok.decode(got[0])!r} != {tok.decode(want[0])!r}"


def job_embed_and_rope(ctx, folder, ids, shm):
    """The row step's own embedding lookup (its all-reduce's exchange, then the first program's add + norm) and its
    rotary tables against the modules they replace, as bits: ``(x equal, h equal, tables equal)``. The embedding
    rows of ids 3 and 50 hold a -0.0 (the all-reduced module output has +0.0 there at tp > 1)."""
    import ctypes

    from tensorpar.decode.lean import LeanDecoder
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.shm import disable_fast_collectives, enable_fast_collectives
    if shm:
        enable_fast_collectives(ctx.tp, "on")
    try:
        model, _ = build_parallel_model(folder, ctx.tp)
        emb = model.model.embed_tokens
        with torch.no_grad():
            for t in (3, 50):
                if emb.vocab_start <= t < emb.vocab_stop:
                    emb.weight[t - emb.vocab_start, 1] = -0.0
        lean = LeanDecoder(model, ctx.tp, max_batch=2, max_len=16)
        rs = lean.row_step
        assert rs is not None and rs.embed is not None and rs.tables is not None
        b, H = ids.numel(), rs.x.shape[1]
        w0, eps0 = rs.norm0
        step = rs.step       # the embedding's exchange, then the first program's add + norm (OP_NORM)
        step[fused.STEP_PARTS], step[fused.STEP_NPARTS], keep = rs._embed(ids, b)
        norm0 = fused.program([(fused.OP_NORM, rs.xp, b, H, w0.data_ptr(), fused.float_bits(eps0), rs.h.data_ptr())])
        fused.run_program(ctypes.addressof(norm0), ctypes.addressof(step))
        del keep
        want = lean.embed(ids.view(1, b)).view(b, H)
        x = want.clone()
        h = torch.empty_like(x)
        fused.rms_norm_raw((x.data_ptr(), b, H, w0.data_ptr(), eps0, h.data_ptr()))
        bits = lambda t: t.contiguous().view(torch.int32)       # noqa: E731  (-0.0 and +0.0 differ)
        x_eq = torch.equal(bits(rs.x[:b]), bits(want))
        h_eq = torch.equal(bits(rs.h[:b]), bits(h))
        tables_eq = True
        for key, rotary in lean.rotary.items():
            cos_t, sin_t = rs.tables[key]
            for p in range(16):             # every row: the decoder's own call of that one position
                c, s = lean._rotary(rotary, want.view(1, b, H), torch.tensor([p]), None)
                tables_eq &= torch.equal(bits(cos_t[p]), bits(c.reshape(-1))) and torch.equal(
                    bits(sin_t[p]), bits(s.reshape(-1)))
        return x_eq, h_eq, tables_eq
    finally:
        if shm:
            disable_fast_collectives(ctx.tp)


@needs_kernels
@pytest.mark.parametrize("tp,shm", [(1, False), (2, True), pytest.param(2, False, marks=pytest.mark.slow)])
def test_row_step_embedding_and_rotary_tables_are_the_modules_bits(pools, tmp_path, tp, shm):
    """The row step looks its embedding rows up itself (each rank its own rows, zeros elsewhere, the all-reduce
    fused with the first norm onto x = 0) and reads rotary tables computed once: bitwise the embedding module's
    all-reduced output (a -0.0 in a row included), the norm of it, and the decoder's per-step rotary call at every
    position; two rows, ids owned by different ranks at tp=2 (53-token vocabulary: 0-26 and 27-52)."""
    folder = make_model_folder(tmp_path / "llama", "llama")
    for r, (x_eq, h_eq, tables_eq) in enumerate(run_tp(pools, tp, job_embed_and_rope, folder,
                                                       torch.tensor([3, 50]), shm)):
        assert x_eq and h_eq and tables_eq, (r, x_eq, h_eq, tables_eq)

