"""bf16 models (``--dtype bfloat16``) with their matmul weights in the bf16 blocked layout of our GEMV
(tensorpar.decode.matmuls.use_blocked, bf16_weights.bf16_linear on a bf16 input): each matmul within one bf16
rounding of ``F.linear`` in bf16 at every row count; the layout replaces
the plain weights (state_dict unchanged, one copy); greedy tokens of the lean path equal transformers' bf16 model at
tp 1 and 2, logits within verify's bf16 rule of the plain decoder's."""
import itertools

import pytest
import torch
import torch.nn.functional as F

from tensorpar.decode import bf16_weights, gemv_kernel
from tests._ranks import run_tp
from tests.decode.test_generate import ARCHS, make_model_folder, prompts
from tests.decode.test_quant import folders  # noqa: F401 (the fixture: models whose Linears split into int8 blocks)

N_NEW = 12
needs_gemv = pytest.mark.skipif(not gemv_kernel.available(),
                                reason="TENSORPAR_GEMV_KERNEL=0, neither AVX-512 BF16 nor AVX2 + FMA, or no compiler")


@needs_gemv
@pytest.mark.parametrize("k,n,bias", [(64, 70, False), (300, 33, True), (1030, 97, False)])
def test_bf16_input_on_blocked_weight(k, n, bias):
    """bf16 ``x`` on a bf16 weight held blocked (compute dtype bf16), at every row count (1-40, 100: the kernel's
    row groups of 12, its two-block path up to 4 rows): our GEMV's fp32 sums (``vdpbf16ps`` on pairs of inputs)
    rounded once to bf16, so within one bf16 unit of ``F.linear``'s (whose fp32 sums are in another order) and each
    row bitwise alone; the layout gives the weight back exactly."""
    from tensorpar.decode.bf16_weights import Bf16Weight, bf16_linear
    g = torch.Generator().manual_seed(k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    bw = Bf16Weight(bf16_weights.block_bf16(w), torch.bfloat16, n)
    assert torch.equal(bw.dense(), w) and bw.dense().dtype == torch.bfloat16
    for m in list(range(1, 41)) + [100]:
        x = torch.randn(m, k, generator=g).bfloat16()
        got, want = bf16_linear(x, bw, b), F.linear(x, w, b)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        # one bf16 rounding of sums that differ in their last fp32 bits: at most one bf16 unit (2^-7 relative)
        assert torch.allclose(got.float(), want.float(), rtol=2.0 ** -7, atol=2.0 ** -7 * float(want.abs().max()))
        alone = torch.cat([bf16_linear(x[i:i + 1], bw, b) for i in range(m)])
        assert torch.equal(got, alone), f"m={m}: a row's outputs depend on the others"


@needs_gemv
def test_bf16_blocked_sums():
    """The kernel's fp32 sums (before rounding) within 2e-6 of the exact sums of the bf16 products (fp64), at 1-13
    rows, on 1 and 2 threads alike (bitwise); an odd number of inputs (padded with a zero input) the same, its rows,
    views and round trip exact, its fp32 path bitwise the fp32 blocked layout's."""
    g = torch.Generator().manual_seed(5)
    n, k = 70, 1030
    w = torch.randn(n, k, generator=g).bfloat16()
    p = bf16_weights.block_bf16(w)
    for m in (1, 3, 4, 5, 13):
        x = torch.randn(m, k, generator=g).bfloat16()
        got = gemv_kernel.bf16_blocked_linear(x, p, n, None)
        exact = x.double() @ w.double().T
        assert float((got.double() - exact).abs().max()) <= 2e-6 * float(exact.abs().max())
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            assert torch.equal(gemv_kernel.bf16_blocked_linear(x, p, n, None), got)
        finally:
            torch.set_num_threads(threads)
    w = torch.randn(40, 1025, generator=g).bfloat16()       # an odd number of inputs: padded with a zero input
    bw = bf16_weights.to_bf16(w)
    assert bw.blocked and bw.shape == (40, 1025) and bw.w.shape == (2, 1026, 32) and torch.equal(bw.plain(), w)
    idx = torch.tensor([[0, 39], [17, 5]])
    assert torch.equal(bw.rows(idx), w[idx].float()) and torch.equal(bw.narrow(32, 8).plain(), w[32:])
    for m in (1, 5):
        x = torch.randn(m, 1025, generator=g).bfloat16()
        got = gemv_kernel.bf16_blocked_linear(x, bw.w, 40, None, k=1025)
        exact = x.double() @ w.double().T
        assert float((got.double() - exact).abs().max()) <= 2e-6 * float(exact.abs().max())
        fp32 = gemv_kernel.blocked_linear(x.float(), gemv_kernel.BlockedWeight(gemv_kernel.block(w.float()), 40), None)
        assert torch.equal(gemv_kernel.bf16w_blocked_linear(x.float(), bw.w, 40, None, k=1025), fp32)


@needs_gemv
def test_bf16_blocked_refuses_bad_shapes():
    """Zero input rows give an empty output (no division by a zero row count in the kernel); an input of another
    width than the weight's inputs is refused, also where the padded layout would hold it (1023 against 1024 inputs,
    1026 against 1025), by bf16_linear and by the kernel's entries, and so is an integer input (it would truncate
    the weights); ``copy_rows`` refuses a destination of another shape (the kernel would write past it)."""
    from tensorpar.decode.bf16_weights import bf16_linear
    g = torch.Generator().manual_seed(8)
    for kin in (1024, 1025):
        bw = bf16_weights.blocked(torch.randn(40, kin, generator=g), torch.bfloat16)
        for dtype in (torch.bfloat16, torch.float32):
            bw_ = bw if dtype == torch.bfloat16 else bw._replace(dtype=torch.float32)
            assert bf16_linear(torch.randn(0, kin).to(dtype), bw_).shape == (0, 40)
            run = gemv_kernel.bf16_blocked_linear if dtype == torch.bfloat16 else gemv_kernel.bf16w_blocked_linear
            for bad in (kin - 1, kin + 1, 0):
                with pytest.raises(ValueError, match="bf16_linear: x must be floating point"):
                    bf16_linear(torch.randn(3, bad).to(dtype), bw_)
                if bad:                 # the kernel's own check (the row step calls it without bf16_linear)
                    with pytest.raises(ValueError, match="gemv bf16w into"):
                        run(torch.randn(3, bad).to(dtype), bw.w, bw.n, None, bw.k)
        with pytest.raises(ValueError, match="bf16_linear: x must be floating point"):   # truncated weights else
            bf16_linear(torch.ones(3, kin, dtype=torch.int32), bw)
        for dst in (torch.empty(2, 1000, dtype=torch.bfloat16), torch.empty(1, kin, dtype=torch.bfloat16)):
            with pytest.raises(ValueError, match="copy_rows: dst"):
                bw.copy_rows(dst, 0, 2)


@needs_gemv
def test_bf16_blocked_on_the_avx2_build():
    """The AVX2 build (no ``vdpbf16ps``: two fma in input order) of a bf16 model's blocked matmul is bitwise the fp32
    path on the same layout (``tp_gemv_bf16w_blocked``, the weights widened), where this CPU runs both builds."""
    from tests.decode.test_gemv import avx2_build
    g = torch.Generator().manual_seed(6)
    lib = avx2_build()
    for f in (lib.tp_gemv_bf16_blocked, lib.tp_gemv_bf16w_blocked):
        f.restype, f.argtypes = gemv_kernel._lib().tp_gemv_bf16_blocked.restype, \
            gemv_kernel._lib().tp_gemv_bf16_blocked.argtypes
    for (n, k), m in itertools.product(((70, 1030), (40, 1025)), (1, 4, 5)):
        p = bf16_weights.block_bf16(torch.randn(n, k, generator=g))
        x = torch.randn(m, k, generator=g).bfloat16().float()
        ys = [torch.empty(m, n) for _ in range(2)]
        for f, y in zip((lib.tp_gemv_bf16_blocked, lib.tp_gemv_bf16w_blocked), ys):
            f(*gemv_kernel.bf16w_into_args(x, p, y, 1, n=n, k=k))
        assert torch.equal(ys[0], ys[1]), m


@needs_gemv
def test_copy_rows_from_the_blocked_layout_is_exact():
    """``Bf16Weight.copy_rows`` into a bf16 buffer (our kernel's ``tp_unblock_bf16``: whole blocks 16 pairs of inputs
    at a time as a transpose, tails pair by pair) gives the plain rows bit for bit: whole and cut blocks, row
    ranges starting and ending inside a block, inputs not a multiple of 16 or of its tile; into fp32 as before."""
    from tensorpar.decode.bf16_weights import Bf16Weight
    g = torch.Generator().manual_seed(3)
    for n, k in [(70, 33), (64, 48), (100, 2048), (33, 17), (32, 16), (96, 4097), (40, 300), (45, 1031)]:
        w = torch.randn(n, k, generator=g).bfloat16()
        bw = bf16_weights.blocked(w, torch.bfloat16)
        assert bw.shape == (n, k) and torch.equal(bw.plain(), w)
        for a, b in [(0, n), (0, min(n, 32)), (min(n, 5), n), (min(n, 31), min(n, 65)), (n - 1, n)]:
            for dtype in (torch.bfloat16, torch.float32):
                dst = torch.empty(b - a, k, dtype=dtype)
                bw.copy_rows(dst, a, b)
                assert torch.equal(dst, w[a:b].to(dtype)), (n, k, a, b, dtype)


def test_copy_rows_on_the_avx2_build():
    """``tp_unblock_bf16`` of the AVX2 build (no transpose: the tile filled value by value) gives the same rows, where
    this CPU runs both builds."""
    import ctypes

    from tests.decode.test_gemv import avx2_build
    f = avx2_build().tp_unblock_bf16
    f.restype, f.argtypes = None, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    w = torch.randn(100, 300, generator=torch.Generator().manual_seed(4)).bfloat16()
    p = bf16_weights.block_bf16(w)
    for a, b in [(0, 100), (7, 70)]:
        dst = torch.empty(b - a, 300, dtype=torch.bfloat16)
        f(p.data_ptr(), 300, a, b, dst.data_ptr())
        assert torch.equal(dst, w[a:b]), (a, b)


def job_blocked(ctx, folder, ids, mask, n, min_in):
    from tensorpar import comm
    from tensorpar.decode.bf16_weights import Bf16Weight
    from tensorpar.decode.lean import LeanDecoder
    from tensorpar.decode.packed import packed_weight_bytes
    from tensorpar.generate import SamplingConfig, generate_tokens
    from tensorpar.hf.load import build_parallel_model
    default = bf16_weights.BLOCK_MIN_IN
    if min_in is not None:
        bf16_weights.BLOCK_MIN_IN = min_in              # this worker only, restored below
    try:
        model, plan = build_parallel_model(folder, ctx.tp, dtype=torch.bfloat16)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        tied = model.lm_head.weight is model.get_input_embeddings().weight
        untied_table = 0 if tied else model.get_input_embeddings().weight.numel()
        tokens = generate_tokens(model, ctx.tp, ids, mask, sampling=SamplingConfig(max_new_tokens=n),
                                 path="lean").tokens
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits, row_step, held, plain_left = {}, {}, 0, 0
        for block, rows in ((True, True), (True, False), (False, True), (False, False)):
            lean = LeanDecoder(model, ctx.tp, max_batch=ids.shape[0], max_len=ids.shape[1] + 1, block=block)
            row_step[block] = lean.row_step is not None
            if not rows:
                lean.row_step = None                    # the general loop
            kinds = {type(w).__name__ for L in lean.layers for w in (L.wqkv, L.wo, L.wgu, L.wd)}
            if block:
                held = packed_weight_bytes(model)
                plain_left = sum(p.numel() for p in model.parameters() if p.dim() == 2)     # freed: 0 elements
                blocked = lean.blocked and kinds == {Bf16Weight.__name__}
            first = comm.all_gather(lean.prefill(ids, mask, pos).float().contiguous(), ctx.tp, -1, plan.vocab)
            step = lean.decode(first.argmax(-1)[:, None], pos[:, -1:] + 1, ids.shape[1])    # one decode step
            assert step.dtype == torch.bfloat16
            logits[block, rows] = [first, comm.all_gather(step.float().contiguous(), ctx.tp, -1, plan.vocab)]
        same_state = all(torch.equal(state[k], v) for k, v in model.state_dict().items())
        return dict(tokens=tokens, logits=logits, blocked=blocked, held=held, plain_left=plain_left,
                    untied_table=untied_table, same_state=same_state, row_step=row_step)
    finally:
        bf16_weights.BLOCK_MIN_IN = default


def hf_bf16_greedy(folder, ids, mask, n):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0, min_new_tokens=n)
    return out[:, ids.shape[1]:]


@needs_gemv
@pytest.mark.parametrize("arch,tp", [("llama", 1), ("qwen2", 1), ("llama", 2),
                                     pytest.param("qwen2", 3, marks=pytest.mark.slow),
                                     pytest.param("llama", 4, marks=pytest.mark.slow)])    # 9 q heads: 3 / 2 / 2 / 2
def test_bf16_model_blocked_equals_transformers(pools, tmp_path, arch, tp):
    """``--dtype bfloat16`` with every matmul weight blocked (``BLOCK_MIN_IN`` 0 on the ranks; the tiny models' rows
    are short): the decoder holds only :class:`Bf16Weight` matmul weights (the LM head's too; llama's is tied to the
    embedding, which then looks its rows up in the layout), no plain matrix left but an untied embedding's (one
    copy), the state_dict unchanged; the row step runs its decode steps (bf16 rounding emulated on fp32 buffers, a
    bf16 cache), on the blocked weights and on plain ones; greedy tokens equal transformers' bf16 model at tp 1 and 2
    (qwen2: QKV biases, added in fp32 before the rounding); prefill and decode logits of the blocked weights, the
    row step or the general loop, within verify's bf16 rule (depth: the layers and the head) of the general loop on plain weights."""
    from tensorpar.decode import fused
    from tensorpar.verify import tolerance
    folder = str(make_model_folder(tmp_path / arch, arch))
    ids, mask = prompts(ARCHS[arch]["vocab_size"])
    want = hf_bf16_greedy(folder, ids, mask, N_NEW)
    cfg = ARCHS[arch]
    for r, got in enumerate(run_tp(pools, tp, job_blocked, folder, ids, mask, N_NEW, 0)):
        assert got["blocked"], f"rank {r}: the bf16 weights were not blocked"
        assert got["row_step"] == {True: fused.available(), False: fused.available()}, got["row_step"]
        assert got["same_state"], f"rank {r}: the state_dict changed"
        assert got["held"] > 0 and got["plain_left"] == got["untied_table"], \
            f"rank {r}: {got['plain_left']} plain matrix elements left beside the blocked ones"
        if tp <= 2:     # tp=3: bf16 partial sums of three ranks round unlike tp=1's (the general loop on plain
            #             weights gives qwen2's first token 10 there, transformers 40): the logits' rule only
            assert torch.equal(got["tokens"], want), f"{arch} tp={tp} rank {r}: {got['tokens']} != {want}"
        ref = got["logits"][False, False]
        for key, pair in got["logits"].items():
            for what, a, b in zip(("prefill", "decode"), pair, ref):
                tol = tolerance(torch.bfloat16, cfg["intermediate_size"], cfg["num_hidden_layers"] + 1, tp,
                                float(b.abs().max()))
                assert (a - b).abs().max() <= tol, f"{arch} tp={tp} {key} {what}: {(a - b).abs().max()} > {tol}"


def job_int8_bf16(ctx, folder, ids, mask):
    from tensorpar import comm
    from tensorpar.decode import row_step
    from tensorpar.decode.lean import LeanDecoder
    from tensorpar.decode.quantize import quantize_int8
    from tensorpar.hf.load import build_parallel_model
    model, plan = build_parallel_model(folder, ctx.tp, dtype=torch.bfloat16)
    quantize_int8(model, ctx.tp)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out, why = {}, None
    for rows in (True, False):
        lean = LeanDecoder(model, ctx.tp, max_batch=ids.shape[0], max_len=ids.shape[1] + 1)
        if rows:
            why = row_step.why_not(lean)
        else:
            lean.row_step = None
        first = comm.all_gather(lean.prefill(ids, mask, pos).float().contiguous(), ctx.tp, -1, plan.vocab)
        step = lean.decode(first.argmax(-1)[:, None], pos[:, -1:] + 1, ids.shape[1])
        out[rows] = [first, comm.all_gather(step.float().contiguous(), ctx.tp, -1, plan.vocab)]
    return why, out


@pytest.mark.parametrize("tp", [1, 2])
def test_int8_bf16_row_step_equals_general_loop(pools, folders, tp):
    """``--quantize int8`` on a bf16 model: the row step runs it (its int8 kernel on the input widened to fp32, the
    output rounded to bf16 once: the general loop's matmul bitwise), prompts as rows and decode steps; logits within
    0.05 of the general loop's (test_quant's bound for int8 with bf16 activations: a bf16 rounding in another order
    can move an activation to the other int8 step)."""
    from tensorpar.decode import fused, q8_kernel
    ids, mask = prompts(ARCHS["llama"]["vocab_size"])
    for r, (why, out) in enumerate(run_tp(pools, tp, job_int8_bf16, folders["llama"], ids, mask)):
        if not (fused.available() and q8_kernel.available()):
            assert why is not None
            continue
        assert why is None, f"rank {r}: {why}"
        for what, a, b in zip(("prefill", "decode"), out[True], out[False]):
            assert (a - b).abs().max() < 0.05, f"tp={tp} {what}: {(a - b).abs().max()}"



def job_exchange_bf16(ctx):
    import ctypes

    from tensorpar import comm
    from tensorpar.decode import fused
    g = torch.Generator().manual_seed(10 + ctx.tp.rank)
    partial = torch.randn(3, 96, generator=g).bfloat16().float()         # bf16 values in the step's fp32 buffer
    addr, n, keep = fused.all_reduce_exchange(partial, ctx.tp, None, torch.bfloat16)
    got = torch.empty_like(partial)
    ctypes.memmove(got.data_ptr(), ctypes.cast(addr, ctypes.POINTER(ctypes.c_void_p))[0], got.numel() * 4)
    want = comm.all_reduce(partial.bfloat16(), ctx.tp).float()
    in_fp32 = comm.all_reduce(partial.clone(), ctx.tp).to(torch.bfloat16).float()
    return n, torch.equal(got, want), int((want != in_fp32).sum())


def test_bf16_step_exchange_over_gloo_rounds_as_the_general_loop(pools):
    """Over gloo (no shared memory) at tp=3 a bf16 model's row-step exchange all-reduces a bf16 copy of the partial
    sums: the one part ``OP_NORM_BF16`` adds is bitwise the general loop's bf16 all-reduce, which the fp32 sum rounded
    once is not (each of gloo's adds rounds in bf16)."""
    res = run_tp(pools, 3, job_exchange_bf16)
    assert all(n == 1 and same for n, same, _ in res), res
    assert res[0][2] > 0, "the test's sums never round differently in fp32: it shows nothing"


def job_wide_batch(ctx, folder, ids, mask, n):
    from tensorpar import comm
    from tensorpar.decode.lean import LeanDecoder
    from tensorpar.generate import SamplingConfig, generate_tokens
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.decode import matmuls
    out = {}
    model, plan = build_parallel_model(folder, ctx.tp, dtype=torch.bfloat16)
    real = matmuls.bf16_linear
    matmuls.bf16_linear = lambda x, w, b=None: torch.zeros(x.shape[0], w.shape[0], dtype=x.dtype)   # probe fails
    try:
        lean = LeanDecoder(model, ctx.tp, max_batch=ids.shape[0], max_len=ids.shape[1] + 1)
        out["probe_failed"] = dict(gemv=lean.gemv, blocked=lean.blocked, packed=lean.packed,
                                   head=lean.linear.__name__)   # a tied head stays plain: F.linear, not our GEMV
    finally:
        matmuls.bf16_linear = real
    for block in (False, True):
        model, plan = build_parallel_model(folder, ctx.tp, dtype=torch.bfloat16)
        lean = LeanDecoder(model, ctx.tp, max_batch=ids.shape[0], max_len=ids.shape[1] + 1, block=block)
        R = None if lean.row_step is None else lean.row_step.R
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        first = comm.all_gather(lean.prefill(ids, mask, pos).float().contiguous(), ctx.tp, -1, plan.vocab)
        step = lean.decode(first.argmax(-1)[:, None], pos[:, -1:] + 1, ids.shape[1])
        rows = comm.all_gather(step.float().contiguous(), ctx.tp, -1, plan.vocab)
        lean.row_step = None                    # the general loop (writes the step's K/V again, in place)
        general = comm.all_gather(lean.decode(first.argmax(-1)[:, None], pos[:, -1:] + 1, ids.shape[1])
                                  .float().contiguous(), ctx.tp, -1, plan.vocab)
        kinds = {type(w).__name__ for L in lean.layers for w in (L.wqkv, L.wo, L.wgu, L.wd)} | {type(lean.lm_w).__name__}
        tokens = None
        if block:                               # generate's own decoder (block=True, the default)
            tokens = generate_tokens(model, ctx.tp, ids, mask, sampling=SamplingConfig(max_new_tokens=n),
                                     path="lean").tokens
        out[block] = dict(gemv=lean.gemv, blocked=lean.blocked, packed=lean.packed, R=R, tokens=tokens,
                          kinds=kinds, diff=float((rows - general).abs().max()), scale=float(general.abs().max()))
    return out


@needs_gemv
@pytest.mark.parametrize("tp", [1, 2])
def test_bf16_batch_above_4_rows_runs_blocked(pools, tmp_path, tp):
    """A bf16 model decoding 7 prompts (``max_batch`` 7, above the plain bf16 GEMV's 4 rows): the decoder holds every
    matmul weight blocked whatever its row length (the tiny model's rows are shorter than ``BLOCK_MIN_IN``; the LM
    head tied to the embedding too), runs ``vdpbf16ps`` on them at every row count and its row step takes 32 rows;
    its greedy tokens (generate) equal transformers' bf16 ones; the row step's decode logits equal the general loop's
    on the same weights up to verify's bf16 rule. ``block=False``, or a blocked layout whose probe fails (a pretend
    kernel fault), keeps oneDNN's prepacked weights as before (not our GEMV on plain weights above its 4 rows; the tied
    head F.linear)."""
    from tensorpar.decode import fused
    from tensorpar.verify import tolerance
    arch = "llama"
    folder = str(make_model_folder(tmp_path / arch, arch))
    cfg = ARCHS[arch]
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, cfg["vocab_size"], (7, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[3, :2] = 0
    ids[mask == 0] = 0
    want = hf_bf16_greedy(folder, ids, mask, N_NEW)
    for r, got in enumerate(run_tp(pools, tp, job_wide_batch, folder, ids, mask, N_NEW)):
        plain, blocked = got[False], got[True]
        assert not plain["gemv"] and plain["packed"], plain
        assert got["probe_failed"] == dict(gemv=False, blocked=False, packed=True, head="linear"), got["probe_failed"]
        assert blocked["gemv"] and blocked["blocked"] and not blocked["packed"], blocked
        assert blocked["kinds"] == {"Bf16Weight"}, blocked["kinds"]
        assert blocked["R"] == (32 if fused.available() else None), blocked["R"]
        tol = tolerance(torch.bfloat16, cfg["intermediate_size"], cfg["num_hidden_layers"] + 1, tp, blocked["scale"])
        assert blocked["diff"] <= tol, (blocked["diff"], tol)
        assert torch.equal(blocked["tokens"], want), f"tp={tp} rank {r}: {blocked['tokens']} != {want}"


def job_ranks_block_differently(ctx, folder, ids, mask, n):
    from tensorpar.generate import SamplingConfig, generate_tokens
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.decode.lean import LeanDecoder
    default = bf16_weights.BLOCK_MIN_IN
    bf16_weights.BLOCK_MIN_IN = 20          # rank 0's o_proj (6 heads x 4 = 24 inputs) blocked, rank 1's (12) plain
    try:
        model, _ = build_parallel_model(folder, ctx.tp, dtype=torch.bfloat16)
        lean = LeanDecoder(model, ctx.tp, max_batch=ids.shape[0], max_len=ids.shape[1] + n)
        own = {L.wo.blocked if isinstance(L.wo, bf16_weights.Bf16Weight) else False for L in lean.layers}
        R = None if lean.row_step is None else lean.row_step.R
        del lean
        tokens = generate_tokens(model, ctx.tp, ids, mask, sampling=SamplingConfig(max_new_tokens=n),
                                 path="lean").tokens
        return dict(own=own, R=R, tokens=tokens)
    finally:
        bf16_weights.BLOCK_MIN_IN = default


@needs_gemv
def test_ranks_whose_weights_block_differently_agree_on_the_row_count(pools, tmp_path):
    """At tp=2 the tiny llama's 9 query heads split unevenly, so with ``BLOCK_MIN_IN`` 20 rank 0 holds every matmul
    weight blocked (row step of 32 rows on its own) and rank 1 its o_proj plain (4 rows): the decoder takes the
    smallest count on both, so a batch of 3 prompts of 7 tokens (21 prompt rows) runs the same path on both ranks
    (else one rank runs the row step and the other the general loop: different collectives) and the greedy tokens
    equal transformers' bf16 ones."""
    from tensorpar.decode import fused
    folder = str(make_model_folder(tmp_path / "llama", "llama"))
    ids, mask = prompts(ARCHS["llama"]["vocab_size"])
    want = hf_bf16_greedy(folder, ids, mask, N_NEW)
    got = run_tp(pools, 2, job_ranks_block_differently, folder, ids, mask, N_NEW)
    assert got[0]["own"] == {True} and got[1]["own"] == {False}, [g["own"] for g in got]
    for r, g in enumerate(got):
        assert g["R"] == (4 if fused.available() else None), (r, g["R"])
        assert torch.equal(g["tokens"], want), f"rank {r}: {g['tokens']} != {want}"
