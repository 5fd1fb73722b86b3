"""Our fp32 / bf16 GEMV (tensorpar/decode/gemv_kernel.py, csrc/gemv.cpp) against ``F.linear``, and the lean path
that runs it on the plain weights for decoders of a few rows (tensorpar/decode/matmuls.py ``use_gemv``)."""
import pytest
import torch
import torch.nn.functional as F

from tensorpar.decode import gemv_kernel
from tests.decode.test_generate import ARCHS, hf_reference, make_model_folder, prompts

needs_kernel = pytest.mark.skipif(not gemv_kernel.available(),
                                  reason="TENSORPAR_GEMV_KERNEL=0, neither AVX-512 BF16 nor AVX2 + FMA, or no compiler")


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: 1e-5 of the largest |output| (the same products summed in another order than MKL/oneDNN); bf16: both
    round an fp32 sum of the same products to bf16, so they differ by at most one bf16 rounding of it (2^-8
    relative) plus the fp32 order (1e-5)."""
    got, want = got.double(), want.double()
    scale = float(want.abs().max())
    if dtype == torch.float32:
        assert (got - want).abs().max() <= 1e-5 * scale
    else:
        assert ((got - want).abs() <= 2.0 ** -8 * want.abs() + 1e-5 * scale).all()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 1280, 2048), (1, 2048, 2816), (3, 96, 80), (4, 33, 130), (6, 40, 2050),
                                   (1, 1283, 2050), (1, 37, 1030), (1, 50, 520), (5, 21, 1100), (2, 53, 576),
                                   (3, 61, 1030), (16, 45, 1100)])
def test_gemv_equals_linear(dtype, m, n, k):
    """The kernel on decode-like shapes (and odd ones: tails of K, more than 4 rows; rows of >= 2 KB, several weight
    rows at a time for groups of 1-4 input rows, with N not a multiple of the stripes and tails of K, and a fifth row
    of a batch of 5, 16 rows in four groups) with and without bias, 1 and 2
    threads, each mode (the default one, one weight row at a time, bf16 widened, two weight rows at a time), the
    lean path's entry and the custom op, equals ``F.linear`` within :func:`_close`'s tolerance."""
    g = torch.Generator().manual_seed(m * n + k)
    x, w, b = (torch.randn(*s, generator=g).to(dtype) for s in ((m, k), (n, k), (n,)))
    for bias in (None, b):
        want = F.linear(x, w, bias)
        for threads in (1, 2):
            for mode in (None, gemv_kernel.MODE_ONE_ROW, gemv_kernel.MODE_WIDEN, gemv_kernel.MODE_PAIRS):
                got = gemv_kernel.gemv_raw(x, w, bias, threads=threads, mode=mode)
                assert got.dtype == dtype and got.shape == (m, n)
                _close(got, want, dtype)
        _close(gemv_kernel.linear(x, w, bias), want, dtype)
        _close(torch.ops.tensorpar.gemv(x, w, bias), want, dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(45, 1100), (70, 2050)])
def test_a_rows_outputs_do_not_depend_on_the_rows_beside_it(dtype, n, k):
    """Rows of at least 2 KB: each output is summed in one order whatever the group of input rows it is in (1-4) and
    the thread's chunk, so row r of a batch of m (1-32, 1 and 2 threads) is bitwise that row alone: the row step's
    decode at batch 32 gives each request what batch 1 would."""
    g = torch.Generator().manual_seed(n + k)
    x, w, b = (torch.randn(*s, generator=g).to(dtype) for s in ((32, k), (n, k), (n,)))
    for threads in (1, 2):
        alone = torch.cat([gemv_kernel.gemv_raw(x[r:r + 1], w, b, threads=threads) for r in range(32)])
        for m in (2, 3, 4, 5, 7, 16, 32):
            assert torch.equal(gemv_kernel.gemv_raw(x[:m], w, b, threads=threads), alone[:m]), (m, threads)


@needs_kernel
@pytest.mark.parametrize("n,k", [(480, 576), (1536, 576), (60, 36), (32, 36), (33, 7), (1, 5), (96, 2050)])
def test_blocked_layout_equals_linear_at_every_row_count(n, k):
    """fp32 weights in the blocked layout (:class:`~tensorpar.decode.gemv_kernel.BlockedWeight`; SmolLM2's tp=2
    shapes, one block, a last block of 1-31 rows; the layout has no tails along K) at 1-100 rows (the pairs of
    blocks of 1-4 rows, 12-row passes and their rest), 1 and 2 threads, with and without bias: within 1e-5 of
    ``F.linear`` (another order of the fp32 sums), each row bitwise the row alone (one lane sums an output from
    k = 0 up, whatever the rows beside it), the layout exact both ways, and the row step's entry
    (:func:`~tensorpar.decode.gemv_kernel.into_args`) the same bits."""
    g = torch.Generator().manual_seed(n + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    bw = gemv_kernel.BlockedWeight(gemv_kernel.block(w), n)
    assert bw.shape == w.shape and bw.p.shape == (-(-n // 32), k, 32) and torch.equal(bw.dense(), w)
    assert bw.dense().is_contiguous()       # one block: a reshape alone would give a transposed view
    x = torch.randn(100, k, generator=g)
    for bias in (None, b):
        alone = torch.cat([gemv_kernel.blocked_linear(x[r:r + 1], bw, bias) for r in range(100)])
        for m in (1, 2, 3, 4, 5, 12, 13, 25, 32, 100):
            want = F.linear(x[:m], w, bias)
            for threads in (1, 2):
                old = torch.get_num_threads()
                torch.set_num_threads(threads)
                try:
                    got = gemv_kernel.blocked_linear(x[:m], bw, bias)
                finally:
                    torch.set_num_threads(old)
                _close(got, want, torch.float32)
                assert torch.equal(got, alone[:m]), (m, threads)
            y = torch.empty(m, n)
            gemv_kernel.linear_into(gemv_kernel.into_args(x[:m].contiguous(), bw, y, 1, bias))
            assert torch.equal(y, alone[:m])


@needs_kernel
def test_blocked_linear_refuses_a_bias_or_input_of_another_shape():
    """A bias of the wrong length was read past its end, a 3-D input taken as [M, K] (found by a review)."""
    w = gemv_kernel.BlockedWeight(gemv_kernel.block(torch.randn(33, 64)), 33)
    for x, bias in ((torch.randn(8, 64), torch.randn(5)), (torch.randn(2, 4, 64), None),
                    (torch.randn(8, 64), torch.randn(33, 1))):
        with pytest.raises(ValueError, match=r"blocked_linear: .* fp32 x \[M, 64\] and a bias \[33\] or"):
            gemv_kernel.blocked_linear(x, w, bias)


@needs_kernel
def avx2_build():
    """The AVX2 build of our GEMV's library, on a CPU that runs the AVX-512 one too (else the test is skipped)."""
    from tensorpar.decode.q8_kernel import _cpu_has_features
    from tensorpar.native import load_target
    avx2 = next(t for t in gemv_kernel.TARGETS if t[0] == "avx2")
    if gemv_kernel.target() != "avx512" or not _cpu_has_features(avx2[1]):
        pytest.skip("needs a CPU that runs both builds")
    lib = load_target(avx2, gemv_kernel._SRC, gemv_kernel._FLAGS, "gemv", "TENSORPAR_GEMV_KERNEL")
    if lib is None:
        pytest.skip("the AVX2 build did not build here")
    return lib


def test_blocked_layout_is_the_same_bits_on_the_avx2_build():
    """The AVX2 build (8 lanes, 16 registers: other micro-kernels) sums each output in the same lane order as the
    AVX-512 one, so on a CPU with both its results are bitwise the AVX-512 build's (the CI machine runs one of them;
    this runs the other where it can)."""
    lib = avx2_build()
    lib.tp_gemv.argtypes = gemv_kernel._lib().tp_gemv.argtypes
    g = torch.Generator().manual_seed(3)
    for n, k in ((480, 576), (60, 36)):
        w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        bw = gemv_kernel.BlockedWeight(gemv_kernel.block(w), n)
        for m in (1, 2, 5, 32):
            x = torch.randn(m, k, generator=g)
            y = torch.empty(m, n)
            lib.tp_gemv(*gemv_kernel.into_args(x, bw, y, 1, b))
            assert torch.equal(y, gemv_kernel.blocked_linear(x, bw, b)), (n, k, m)
            _close(y, F.linear(x, w, b), torch.float32)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_runs_gemv_on_the_plain_weights(tmp_path, dtype):
    """A decoder of batch 1 takes our GEMV (not oneDNN's packing): bf16 on the parameters as they are (same
    storage, nothing packed or copied), fp32 on the blocked layout that replaces them (tests/decode/test_packed.py
    checks what it holds); its prefill and decode logits are within the kernel's tolerance of the plain
    ``torch.mm`` / ``F.linear`` decoder (``prepack=False``), and fp32 greedy tokens at batch 1 equal transformers'."""
    from tensorpar.decode.lean import LeanDecoder
    from tensorpar.decode.packed import packed_model
    from tensorpar.generate import SamplingConfig, generate_tokens
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.parallel import ParallelContext
    folder = make_model_folder(tmp_path / "llama", "llama")
    ctx = ParallelContext.single()
    model, _ = build_parallel_model(folder, ctx.tp, dtype=dtype)
    ids, mask = prompts(ARCHS["llama"]["vocab_size"])
    ids, mask = ids[:1], mask[:1]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)

    def logits(prepack):
        lean = LeanDecoder(model, ctx.tp, max_batch=1, max_len=ids.shape[1] + 2, prepack=prepack)
        first = lean.prefill(ids, mask, pos)
        steps = [lean.decode(first.argmax(-1, keepdim=True), pos[:, -1:] + 1, ids.shape[1])]
        steps.append(lean.decode(steps[-1].argmax(-1, keepdim=True), pos[:, -1:] + 2, ids.shape[1] + 1))
        return lean, first, steps

    def storage_bytes():
        return sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                    for p in model.parameters()}.values())

    before = storage_bytes()
    lean, first, steps = logits(None)
    assert lean.gemv and not lean.packed and lean.blocked == (dtype == torch.float32)
    assert packed_model(model) == lean.blocked
    if not lean.blocked:
        assert storage_bytes() == before        # the parameters hold the weights, once (q/k/v fused in place)
    _, first_plain, steps_plain = logits(False)     # a new decoder gives the model its plain weights back first
    # prefill: the layers' 7 rows (fp32: our GEMV, up to MAX_ROWS; bf16: > MAX_ROWS_BF16, torch.mm / F.linear), the LM head's one row our GEMV;
    # decode: our GEMV everywhere, the layers compound the kernel's tolerance a little
    for got, want in zip([first] + steps, [first_plain] + steps_plain):
        tol = (1e-4 if dtype == torch.float32 else 5e-2) * float(want.float().abs().max())
        assert (got.float() - want.float()).abs().max() <= tol
    if dtype == torch.float32:
        want_tokens, _ = hf_reference(folder, ids, mask, 12)
        got_tokens = generate_tokens(model, ctx.tp, ids, mask, sampling=SamplingConfig(max_new_tokens=12)).tokens
        assert torch.equal(got_tokens, want_tokens)


@needs_kernel
def test_the_build_is_the_cpus_target():
    """The kernel was built for the best of ``gemv_kernel.TARGETS`` that /proc/cpuinfo allows (AVX-512 with BF16,
    else AVX2 + FMA): the library reports that target's vector width (its compiler macros chose the primitives), so
    a library cached for another target (the target is in its name) is not the one loaded."""
    from tensorpar.decode.q8_kernel import _cpu_has_features
    want = next(name for name, features, _ in gemv_kernel.TARGETS if _cpu_has_features(features))
    assert gemv_kernel.target() == want
    assert gemv_kernel._lib().tp_gemv_target() == {"avx512": 512, "avx2": 256}[want]


@needs_kernel
def test_generate_blocks_the_weights_only_of_a_model_marked_inference_only(tmp_path):
    """``generate_tokens`` leaves an unmarked model's parameters as they were (our GEMV on the plain weights);
    after :func:`~tensorpar.generate.inference_only` (what the generate command does) its engine holds the fp32
    weights blocked, the tied LM head's table too, and keeps them and itself for the next call; the tokens are
    the same in both, and :func:`~tensorpar.decode.packed.unpack_weights` gives every parameter back bit for bit."""
    from tensorpar.decode.packed import packed_model, unpack_weights
    from tensorpar.generate import SamplingConfig, cached_engine, generate_tokens, inference_only
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.parallel import ParallelContext
    ctx = ParallelContext.single()
    model, _ = build_parallel_model(make_model_folder(tmp_path / "llama", "llama"), ctx.tp)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids, mask = prompts(ARCHS["llama"]["vocab_size"])
    cfg = SamplingConfig(max_new_tokens=6)
    plain = generate_tokens(model, ctx.tp, ids, mask, sampling=cfg).tokens
    assert not packed_model(model) and not cached_engine(model).lean.blocked
    inference_only(model)
    blocked = generate_tokens(model, ctx.tp, ids, mask, sampling=cfg).tokens
    engine = cached_engine(model)
    assert packed_model(model) and engine.lean.blocked and torch.equal(blocked, plain)
    assert isinstance(engine.lean.lm_w, gemv_kernel.BlockedWeight)          # the tied table
    again = generate_tokens(model, ctx.tp, ids, mask, sampling=cfg).tokens
    assert cached_engine(model) is engine and packed_model(model) and torch.equal(again, plain)
    # what cannot reach the blocked weights refuses instead of leaving them behind (review: .to() gave zeros after,
    # load_state_dict(strict=False) dropped them); a bad id raises as F.embedding does (review: -1 wrapped)
    with pytest.raises(RuntimeError, match="unpack_weights"):
        model.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="unpack_weights"):
        model.load_state_dict(state, strict=False)
    with pytest.raises(IndexError):
        generate_tokens(model, ctx.tp, torch.tensor([[5, -1, 7]]), sampling=cfg)
    unpack_weights(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k


@needs_kernel
def test_quantize_after_a_marked_generate_reads_the_weights_back(tmp_path):
    """``apply_quantize`` on a model whose weights a marked generate left blocked unpacks them first (review: it
    raised AttributeError): its bf16 tokens equal those of the same model quantized before any generate."""
    from tensorpar.decode.quantize import apply_quantize
    from tensorpar.generate import SamplingConfig, generate_tokens, inference_only
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.parallel import ParallelContext
    ctx = ParallelContext.single()
    folder = make_model_folder(tmp_path / "llama", "llama")
    ids, mask = prompts(ARCHS["llama"]["vocab_size"])
    cfg = SamplingConfig(max_new_tokens=6)
    tokens = []
    for generate_first in (False, True):
        model, _ = build_parallel_model(folder, ctx.tp)
        inference_only(model)
        if generate_first:
            generate_tokens(model, ctx.tp, ids, mask, sampling=cfg)
        apply_quantize(model, ctx.tp, "bf16")
        tokens.append(generate_tokens(model, ctx.tp, ids, mask, sampling=cfg).tokens)
    assert torch.equal(tokens[0], tokens[1])
