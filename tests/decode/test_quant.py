"""int8 quantization (tensorpar/decode/quantize.py, int8.py, q8_kernel.py): the quantized model at tp 1/2/3 equals the
plain-PyTorch quantized unsharded model (weights and each Linear's input quantized per block of 32 inputs, absmax
scales, llama.cpp's Q8_0 x Q8_0), token for token; our kernel (AVX512-VNNI or AVX2) equals the same math written in PyTorch."""
import argparse

import pytest
import torch

from tensorpar.generate import SamplingConfig, generate_tokens
from tests._ranks import run_tp
import tests.decode.test_generate as tg
from tests.decode.test_generate import ARCHS, make_model_folder, prompts

N_NEW = 16
#: the test models with every rank's share of each Linear's input a whole number of blocks of 32 at the tp they run:
#: llama hidden 288, 9 q heads / 3 KV heads of 32 (tp=2: 5 and 4 heads, uneven), MLP 192 (tp 2: 96, tp 3: 64), tied embedding;
#: qwen2 4 q / 2 KV heads of 16 (tp=2: 32 each), q/k/v biases, untied
QARCHS = {
    "llama": {**ARCHS["llama"], "hidden_size": 288, "intermediate_size": 192, "head_dim": 32},
    "qwen2": {**ARCHS["qwen2"], "hidden_size": 64, "intermediate_size": 192, "num_attention_heads": 4},
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    with pytest.MonkeyPatch.context() as mp:
        for a, kw in QARCHS.items():
            mp.setitem(tg.ARCHS, a, kw)
        return {a: str(make_model_folder(root / a, a)) for a in QARCHS}


def _q8(t, scale_dtype):
    """Plain PyTorch: ``t`` ``[..., K]`` -> its values quantized per block of 32 along K (absmax / 127 scales, stored
    in ``scale_dtype``; round half to even; 0 where the scale is 0), dequantized, float32."""
    b = t.float().unflatten(-1, (-1, 32))
    s = (b.abs().amax(-1, keepdim=True) / 127).to(scale_dtype).float()
    q = torch.where(s != 0, torch.round(b * torch.where(s != 0, 1 / s, 0)) if scale_dtype == torch.float32
                    else torch.round(b / s), 0).clamp(-127, 127)
    return (q * s).flatten(-2)


def fake_quant_reference(folder, ids, mask, n, dtype=torch.float32):
    """transformers' unsharded model with every decoder Linear and the LM head replaced, in plain PyTorch, by the
    Q8_0 x Q8_0 math: weights ``round(W / s) * s`` with one fp16 ``s = max|W_block| / 127`` per block of 32 inputs
    of the full weight, inputs ``round(x * (1/d)) * d`` per row and block of 32 with fp32 ``d``; its greedy tokens
    and all-position logits."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    linears = [m for layer in model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for m in linears + [model.lm_head]:
            m.weight.copy_(_q8(m.weight, torch.float16).to(dtype))
            m.register_forward_pre_hook(lambda mod, args: (_q8(args[0], torch.float32).to(args[0].dtype),))
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0, min_new_tokens=n)
        logits = model(ids[:1]).logits[0].float()
    return out[:, ids.shape[1]:], logits


def job_int8(ctx, folder, ids, mask, n, dtype, quantize=True):
    from tensorpar import comm
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.decode.lean import LeanDecoder
    from tensorpar.decode.quantize import quantize_int8
    model, plan = build_parallel_model(folder, ctx.tp, dtype=dtype)
    if quantize:
        quantize_int8(model, ctx.tp)
    tokens = generate_tokens(model, ctx.tp, ids, mask, sampling=SamplingConfig(max_new_tokens=n), path="lean").tokens
    module = generate_tokens(model, ctx.tp, ids, mask, sampling=SamplingConfig(max_new_tokens=n), path="hf").tokens
    s = ids.shape[1]
    lean = LeanDecoder(model, ctx.tp, max_batch=1, max_len=s)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    local = lean.forward(ids[:1], torch.arange(s)[None], causal, length=s, start=0, last_only=False)[0]
    logits = comm.all_gather(local.contiguous(), ctx.tp, -1, plan.vocab).float()           # [s, V]
    return tokens, module, logits, lean.linear.__name__


def job_int8_pytorch_path(ctx, *args):
    """:func:`job_int8` with our C++ kernel off in this rank (``TENSORPAR_Q8_KERNEL=0``, what a CPU without AVX2, a
    missing compiler or CUDA get): ``int8_linear`` runs ``int8_linear_reference`` and no decoder has a row step.
    The rank's environment and the kernel's cached library are restored afterwards."""
    import os

    from tensorpar.decode import q8_kernel
    old = os.environ.get("TENSORPAR_Q8_KERNEL")
    os.environ["TENSORPAR_Q8_KERNEL"] = "0"
    q8_kernel._lib.cache_clear()
    q8_kernel._lib_of.cache_clear()
    try:
        assert not q8_kernel.available()
        return job_int8(ctx, *args)
    finally:
        if old is None:
            del os.environ["TENSORPAR_Q8_KERNEL"]
        else:
            os.environ["TENSORPAR_Q8_KERNEL"] = old
        q8_kernel._lib.cache_clear()
        q8_kernel._lib_of.cache_clear()


@pytest.mark.parametrize("arch,tp,job", [("llama", 1, job_int8), ("llama", 2, job_int8), ("llama", 3, job_int8),
                                         ("qwen2", 2, job_int8), ("llama", 2, job_int8_pytorch_path)],
                         ids=["llama-1", "llama-2", "llama-3", "qwen2-2", "llama-2-pytorch-path"])
def test_int8_equals_quantized_unsharded_model(pools, folders, arch, tp, job):
    """The int8 model at tp 1/2/3 gives the quantized reference's greedy tokens (lean and module path) and its
    prompt logits within 1e-4 (fp32; logits of magnitude ~1): the weights and every Linear's input are quantized
    as the reference's, the sums differ in order only. ``llama-2-pytorch-path``: the same with our kernel off
    (int8_linear_reference, the kernel's arithmetic in PyTorch: it was one fp32 matmul of the dequantized values,
    whose sum order rounded one of layer 0's MLP inputs, at x / d = 7.50002, to the other int8 step: 7e-3 on the
    logits)."""
    ids, mask = prompts(ARCHS[arch]["vocab_size"])
    want, want_logits = fake_quant_reference(folders[arch], ids, mask, N_NEW)
    for r, (tokens, module, logits, kernel) in enumerate(run_tp(pools, tp, job, folders[arch], ids, mask,
                                                                 N_NEW, torch.float32)):
        assert kernel == "int8_linear", "the lean path did not run the int8 matmul"
        assert torch.equal(tokens, want), f"{arch} tp={tp} rank {r}: int8 lean tokens != quantized reference"
        assert torch.equal(module, want), f"{arch} tp={tp} rank {r}: int8 module path tokens != quantized reference"
        err = (logits - want_logits).abs().max().item()
        assert err < 1e-4, f"{arch} tp={tp}: int8 logits differ from the quantized reference by {err}"


def test_int8_changes_the_model(pools, folders):
    """The quantization is real: the logits move away from the fp32 model's by more than the tolerance above."""
    ids, mask = prompts(ARCHS["llama"]["vocab_size"])
    (_, _, q, _), = run_tp(pools, 1, job_int8, folders["llama"], ids, mask, 2, torch.float32)
    (_, _, fp, kernel), = run_tp(pools, 1, job_int8, folders["llama"], ids, mask, 2, torch.float32, False)
    # the fp32 path: F.linear, oneDNN prepacked, or our GEMV on the plain weights (a batch <= 2 decoder on a CPU)
    assert kernel in ("linear", "packed_linear", "gemv_linear")
    assert (q - fp).abs().max().item() > 1e-3


def test_int8_bf16_tp_1_and_2(pools, folders):
    """bf16 models run the same int8 matmul (fp32 inside, the output cast to bf16): at tp 1 and 2 the prompt logits
    stay within bf16 rounding of the fp32 quantized reference (0.05; logits of magnitude ~1) and of each other, and
    the first new token is the same. Later greedy tokens may differ: at tp=2 the row-parallel partial products are
    rounded to bf16 before the all-reduce, and this random model has near-ties (row 2 flips at step 9 of 16)."""
    ids, mask = prompts(ARCHS["llama"]["vocab_size"])
    _, ref_logits = fake_quant_reference(folders["llama"], ids, mask, 1)
    outs = [run_tp(pools, tp, job_int8, folders["llama"], ids, mask, 2, torch.bfloat16) for tp in (1, 2)]
    one_tokens, _, one_logits, _ = outs[0][0]
    for tp, res in zip((1, 2), outs):
        for tokens, _, logits, kernel in res:
            assert kernel == "int8_linear"
            assert torch.equal(tokens[:, 0], one_tokens[:, 0]), f"bf16 int8 tp={tp} first token != tp=1"
            err = (logits - ref_logits).abs().max().item()
            assert err < 0.05, f"bf16 int8 tp={tp}: logits differ from the fp32 quantized reference by {err}"
            assert (logits - one_logits).abs().max().item() < 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [64, 96])             # 96: an odd number of blocks (the kernel's 256-bit tail)
@pytest.mark.parametrize("chunk", [2 ** 21, 100])   # 100: the PyTorch path dequantizes 1 row at a time
def test_int8_linear_matches_blockwise_reference(dtype, k, chunk, monkeypatch):
    """int8_linear (our kernel where the CPU has a target) and int8_linear_reference equal the plain-PyTorch
    blockwise math in float64 within fp32 summation error: 1e-5 of the largest output (K <= 96 terms of
    magnitude <= the output scale; the int32 block sums are exact), bf16 outputs within 2 ulp (2 ** -7)."""
    from tensorpar.decode import int8 as quant
    from tensorpar.decode.int8 import int8_linear, int8_linear_reference, quantize_blocks, quantize_weight
    monkeypatch.setattr(quant, "_CHUNK_ELEMS", chunk)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, k, generator=g).to(dtype)
    w[3, :32] = 0                                       # an all-zero block: scale 0, q 0
    x = torch.randn(3, 5, k, generator=g).to(dtype)
    x[0, 0, 32:64] = 0
    b = torch.randn(37, generator=g).to(dtype)
    q = quantize_weight(w)                              # w now holds q * s
    assert q.q.dtype == torch.int8 and q.scale.dtype == torch.float16 and q.scale.shape == (37, k // 32)
    assert q.q.abs().max() == 127 and q.q[3, :32].abs().max() == 0
    assert torch.equal(w, _q8(w, torch.float16).to(dtype))
    xq, d = quantize_blocks(x)
    assert torch.equal(xq.float() * d.repeat_interleave(32, -1), _q8(x, torch.float32))
    want = _q8(x, torch.float32).double() @ w.double().T + b.double()
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    for f in (int8_linear, int8_linear_reference):
        got = f(x, q, b)
        assert got.dtype == dtype and got.shape == (3, 5, 37)
        err = (got.double() - want).abs().max().item()
        assert err < tol * want.abs().max().item(), f"{f.__name__}: {err}"


@pytest.mark.parametrize("m,k,n", [(1, 2048, 64), (4, 576, 33), (2, 160, 7), (1, 5632, 16), (3, 32, 5), (1, 608, 35),
                                   (1, 96, 1)])
def test_q8_kernel_equals_pytorch_path(m, k, n, monkeypatch):
    """Our kernel (tensorpar.decode.q8_kernel, this CPU's target: AVX512-VNNI or AVX2) and the PyTorch path
    (int8_linear_reference: the kernel's sums in its order, its fused multiply-adds through float64) give bitwise
    the same outputs on decode shapes (an even and an odd number of blocks, one block; at one row an even and an
    odd number of weight rows and a single one: the AVX512 kernel reads the four quarters of the rows together), with and
    without a bias, at 1 and 2 threads (each output summed by one thread), the PyTorch path whole and 3 weight rows
    at a time. So the matmuls compute the same whichever runs (before, the PyTorch path was one fp32 matmul, within
    fp32 summation error of the kernel: enough to round a later activation to the other int8 step). The rest of a
    decode step need not: without the kernel the one-row step of fused C++ kernels is off too, and the module
    ops round differently (SmolLM2 int8 tp=2: the greedy texts of 32 tokens part near the end; review, 2026-12-02)."""
    from tensorpar.decode import int8 as quant
    from tensorpar.decode import q8_kernel
    from tensorpar.decode.int8 import int8_linear_reference, quantize_weight
    if not q8_kernel.available():
        pytest.skip("no AVX512-VNNI / AVX2 CPU or no C++ compiler: int8_linear runs the PyTorch path")
    assert q8_kernel._lib().tp_q8_target().decode() == q8_kernel.target()
    g = torch.Generator().manual_seed(1)
    q = quantize_weight(torch.randn(n, k, generator=g), write=False)
    x = torch.randn(m, k, generator=g) * 3
    x[0, :32] = 0                                               # a zero block: d = 0
    bias = torch.randn(n, generator=g)
    threads = torch.get_num_threads()
    try:
        for b in (None, bias):
            wants = [int8_linear_reference(x, q, b)]
            monkeypatch.setattr(quant, "_CHUNK_ELEMS", 3 * m * k // 4)               # 3 rows of lane sums a chunk
            wants.append(int8_linear_reference(x, q, b))
            monkeypatch.undo()
            for t in (1, 2):
                torch.set_num_threads(t)
                got = torch.ops.tensorpar.q8_linear(x, q.q, q.scale, b)
                for want in wants:
                    assert torch.equal(got, want), (t, b is None, (got - want).abs().max())
    finally:
        torch.set_num_threads(threads)


def _representable_case(m, k, n, g):
    """Inputs on which every fp32 operation of both computations is exact: activation blocks of ``xq * 2^e`` with
    one entry ``+-127 * 2^e`` (so ``d = 2^e``, ``x * (1/d) = xq``), some entries halfway, ``(j + 1/2) 2^e``, that
    must round to the even ``j``; int8 weights with scales ``2^f``; ``e, f`` in [-2, 0] and small activations, so
    every partial sum is a multiple of 2^-4 below 2^20 (24 significant bits). A zero activation block. Returns
    ``(x, Int8Weight, bias, the exact result in float64)``."""
    from tensorpar.decode.int8 import Int8Weight
    nb = k // 32
    xq = torch.randint(-3, 4, (m, nb, 32), generator=g).double()
    xq[..., 0] = 127 * (torch.randint(0, 2, (m, nb), generator=g) * 2 - 1)
    half = torch.rand(m, nb, 32, generator=g) < 0.25
    half[..., 0] = False
    e = torch.randint(-2, 1, (m, nb, 1), generator=g).double()
    x = ((xq + 0.5 * half) * 2 ** e)
    x[0, nb // 2] = 0
    xq_even = torch.where(half, 2 * torch.round((xq + 0.5) / 2), xq)      # half to even: j + 1/2 -> even j or j + 1
    xq_even[0, nb // 2] = 0
    xd = (xq_even * 2 ** e).flatten(1)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s = 2.0 ** torch.randint(-2, 1, (n, nb), generator=g)
    w = Int8Weight(q, s.half(), torch.float32)
    bias = torch.randint(-64, 65, (n,), generator=g).double() / 16
    exact = xd @ w.dequantize(torch.float64).T + bias
    assert exact.abs().max() < 2 ** 19 and (exact * 16).frac().abs().max() == 0
    return x.flatten(1).float(), w, bias.float(), exact


@pytest.mark.parametrize("m,k,n", [(1, 608, 40), (2, 160, 7), (4, 576, 33)])   # 608: 19 blocks, odd
def test_q8_kernel_exact_on_representable_inputs(m, k, n):
    """On inputs where no fp32 operation rounds (_representable_case), the kernel, int8_linear_reference and the
    exact sum are bitwise equal: the activation quantization (halfway values to even, a zero block, +-127), the
    int8 products with signs, every block's scale and the bias, with no tolerance at all."""
    from tensorpar.decode import q8_kernel
    from tensorpar.decode.int8 import int8_linear_reference
    x, w, bias, exact = _representable_case(m, k, n, torch.Generator().manual_seed(2))
    assert torch.equal(int8_linear_reference(x, w, bias).double(), exact)
    if not q8_kernel.available():
        pytest.skip("no AVX512-VNNI / AVX2 CPU or no C++ compiler: int8_linear runs the PyTorch path")
    assert torch.equal(torch.ops.tensorpar.q8_linear(x, w.q, w.scale, bias).double(), exact)


def test_q8_kernel_targets_agree_bitwise():
    """Every target this CPU can run (an AVX512-VNNI CPU runs both) gives bitwise the same output: the same exact
    int32 lane sums, summed in the same fp32 order (csrc/q8_linear.cpp)."""
    import ctypes

    from tensorpar.decode import q8_kernel
    from tensorpar.decode.int8 import quantize_weight
    libs = {name: q8_kernel._lib_of(name) for name, _, f in q8_kernel.TARGETS if q8_kernel._cpu_has_features(f)}
    libs = {name: lib for name, lib in libs.items() if lib is not None}
    if len(libs) < 2:
        pytest.skip(f"this CPU runs {len(libs)} of the kernel's targets ({', '.join(libs) or 'none'})")
    g = torch.Generator().manual_seed(3)
    for m, k, n in [(1, 2048, 40), (3, 608, 17), (1, 608, 35), (1, 96, 6)]:
        q = quantize_weight(torch.randn(n, k, generator=g), write=False)
        x, b = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
        outs = {}
        for name, lib in libs.items():
            assert lib.tp_q8_target().decode() == name
            y = torch.empty(m, n)
            lib.tp_q8_linear(x.data_ptr(), m, k, q.q.data_ptr(), q.scale.data_ptr(), n, b.data_ptr(), y.data_ptr(), 1)
            outs[name] = y
        first = next(iter(outs.values()))
        assert all(torch.equal(y, first) for y in outs.values()), {k: (y - first).abs().max() for k, y in outs.items()}


def test_q8_kernel_target_follows_the_cpu_flags(monkeypatch):
    """The target is the first of TARGETS whose /proc/cpuinfo flags the CPU lists: AVX512-VNNI, else AVX2 + FMA +
    F16C, else none (the PyTorch path)."""
    from tensorpar.decode import q8_kernel
    for flags, want in [({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "avx2", "fma"}, "avx512vnni"),
                        ({"avx512f", "avx512bw", "avx512vl", "f16c", "avx2", "fma"}, "avx2"),
                        ({"avx2", "fma", "f16c"}, "avx2"), ({"avx2", "f16c"}, None), (set(), None)]:
        monkeypatch.setattr(q8_kernel, "_cpu_has_features", lambda features, fl=flags: set(features) <= fl)
        assert q8_kernel.target() == want, flags


def test_quantize_refused_before_ranks_start(tmp_path):
    from transformers import AutoConfig

    from tensorpar.decode.quantize import check_quantize
    cfg = AutoConfig.for_model("gpt2", n_embd=24, n_layer=2, n_head=6)
    with pytest.raises(ValueError, match="--quantize int8.*'gpt2'.*--quantize none"):
        check_quantize("int8", cfg, argparse.Namespace(sequence_parallel=False))
    check_quantize("none", cfg, None)
    with pytest.raises(ValueError, match="sequence parallelism"):
        check_quantize("int8", AutoConfig.for_model("llama"), argparse.Namespace(sequence_parallel=True))


def test_quantize_refuses_blocks_split_over_ranks(tmp_path):
    """A rank's share of a Linear's input that is not a whole number of blocks of 32 is refused with one line
    naming the layer and its split: in the launching process from the plan, and on the ranks (quantize_int8) from
    the modules, by the same rule (tensorpar.decode.int8.block_misfit)."""
    from transformers import AutoConfig

    from tensorpar.decode.quantize import check_quantize, quantize_int8
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.hf.plan import make_plan
    from tensorpar.parallel import ParallelContext
    kw = dict(QARCHS["llama"])
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    for tp in (1, 2, 3):
        check_quantize("int8", cfg, make_plan(cfg, tp))
    with pytest.raises(ValueError, match=r"--quantize int8 .* down_proj is split as \[48, 48, 48, 48\]; use another "
                                         r"--tp or --quantize none"):
        check_quantize("int8", cfg, make_plan(cfg, 4))
    small = AutoConfig.for_model("llama", **{k: v for k, v in ARCHS["llama"].items() if k != "model_type"})
    with pytest.raises(ValueError, match=r"the hidden size is split as \[36\]"):
        check_quantize("int8", small, make_plan(small, 1))
    model, _ = build_parallel_model(str(make_model_folder(tmp_path / "m", "llama")), ParallelContext.single().tp)
    with pytest.raises(ValueError, match=r"the hidden size is split as \[36\]"):       # hidden 36 (test_generate)
        quantize_int8(model, ParallelContext.single().tp)


def job_engine_int8(ctx, folder, prompt, n):
    from tensorpar.decode.quantize import apply_quantize
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.serve.engine import Engine
    from tensorpar.serve.plan import Row, StepPlan
    model, _ = build_parallel_model(folder, ctx.tp)
    apply_quantize(model, ctx.tp, "int8")                   # what serve --quantize int8 does on every rank
    engine = Engine(model, ctx.tp, max_batch=2, max_len=32)
    out = engine.step(StepPlan("step", [Row(slot=1, tokens=prompt, start=0)]), None).tokens
    for i in range(n - 1):
        out += engine.step(StepPlan("step", [Row(slot=1, tokens=out[-1:], start=len(prompt) + i)]), None).tokens
    return out, engine.lean.linear.__name__


def test_serve_engine_int8_equals_quantized_reference(pools, folders):
    ids, mask = prompts(ARCHS["llama"]["vocab_size"])
    want, _ = fake_quant_reference(folders["llama"], ids[:1], mask[:1], 8)
    for tokens, kernel in run_tp(pools, 2, job_engine_int8, folders["llama"], ids[0].tolist(), 8):
        assert kernel == "int8_linear"
        assert tokens == want[0].tolist()


@pytest.mark.network
@pytest.mark.slow
def test_smollm2_int8_tp2_equals_quantized_reference(pools):
    """SmolLM2-135M (9 q heads, 3 KV heads, tied embedding, vocab 49152): int8 at tp=2 gives the greedy tokens of
    transformers' unsharded model quantized in plain PyTorch (Q8_0 weights and inputs), and its prompt logits within
    2.0 (fp32; logits up to ~27): an activation whose x / d lies within summation-order rounding of a half step
    rounds the other way, which moves it by one step d = max|x_block| / 127, the size of the quantization error
    itself; SmolLM2's outlier features make d large (measured: 0.85 between our kernel and our PyTorch path at
    tp=1, the same math in another order)."""
    from transformers import AutoTokenizer

    from tensorpar.hub import resolve_model
    folder = str(resolve_model("smollm2", progress=False))
    ids = AutoTokenizer.from_pretrained(folder)(["The capital of France is"], return_tensors="pt")["input_ids"]
    mask = torch.ones_like(ids)
    want, want_logits = fake_quant_reference(folder, ids, mask, N_NEW)
    for tokens, module, logits, kernel in run_tp(pools, 2, job_int8, folder, ids, mask, N_NEW, torch.float32):
        assert kernel == "int8_linear"
        assert torch.equal(tokens, want) and torch.equal(module, want)
        err = (logits - want_logits).abs().max().item()
        assert err < 2.0, f"SmolLM2 int8 tp=2 logits differ from the quantized reference by {err}"


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.timeout(1800)      # two SmolLM2 decodes of 32 tokens: ~1 min idle, past 10 min on the loaded machine
def test_smollm2_int8_greedy_close_to_fp32():
    """Issue 28: SmolLM2-135M int8 (tp=1) picks fp32's greedy token at least 30 times of 32 after 'The capital of
    France is', each position fed fp32's tokens before it (teacher forcing). The fp32 tokens are transformers'
    (tests/decode/test_smollm2.py checks lean == transformers). Teacher forcing because a free-running count
    measures the first near-tie rather than the quantization: token 19 (' ' against '\\n' before a generated
    date) is one, and free-running int8 kept 32 of 32 on the Zen 4 of 2026-12-01 but 19 of 32 on the Xeon of
    2026-12-02 (one thread each), every token after the flip counted as lost; bench/results/decode_int8.md gives
    the free-running counts on three prompts. The module forward gives the logits here; the lean path's int8 is
    checked against a quantized reference by the tests above."""
    from transformers import AutoTokenizer

    from tensorpar.hub import resolve_model
    folder = str(resolve_model("smollm2", progress=False))
    ids = AutoTokenizer.from_pretrained(folder)(["The capital of France is"], return_tensors="pt")["input_ids"]
    mask = torch.ones_like(ids)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want, forced = _smollm2_int8_fp32_tokens(folder, ids, mask)
    finally:
        torch.set_num_threads(threads)
    same = int((forced == want).sum())
    assert same >= 30, f"int8 picked fp32's token at {same} of 32 positions (teacher-forced)"


def _smollm2_int8_fp32_tokens(folder, ids, mask):
    """(fp32's 32 greedy tokens from transformers, int8's argmax at each of those positions fed fp32's tokens),
    each ``[32]`` int64."""
    from transformers import AutoModelForCausalLM

    from tensorpar.decode.quantize import quantize_int8
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.parallel import ParallelContext
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:]
    del ref
    ctx = ParallelContext.single()
    model, _ = build_parallel_model(folder, ctx.tp)
    quantize_int8(model, ctx.tp)
    with torch.no_grad():
        logits = model(torch.cat([ids[0], want[:-1]])[None]).logits[0, ids.shape[1] - 1:]
    return want, logits.argmax(-1)


def job_verify_int8(ctx, quantize_ref, fmt="int8", corrupt=None):
    """verify's comparison of QARCHS' llama stored as ``fmt`` against the unsharded model (``quantize_ref``: the
    reference quantized the same way by ``compare_to_reference``; else compared as a plain fp model). ``corrupt``:
    on rank 0, the scale of block 0 of row 0 of that int8 weight doubled (``lm_head``; ``down_proj``: the last
    layer's). Returns the first failing row ``(name, max |diff|, tolerance)`` or None, and every row's name."""
    import copy

    from transformers import AutoConfig, AutoModelForCausalLM

    from tensorpar.decode.int8 import lean_weight
    from tensorpar.decode.quantize import apply_quantize
    from tensorpar.hf.apply import parallelize
    from tensorpar.hf.plan import make_plan
    from tensorpar.verify import compare_to_reference
    kw = dict(QARCHS["llama"])
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg).float()
    par = parallelize(copy.deepcopy(ref), make_plan(cfg, ctx.tp.size), ctx.tp)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    apply_quantize(par, ctx.tp, fmt)
    if corrupt is not None and ctx.rank == 0:
        mod = par.lm_head if corrupt == "lm_head" else par.model.layers[-1].mlp.down_proj
        lean_weight(mod).scale[0, 0] *= 2
    rep = compare_to_reference(ref, par, ctx.tp, ids, quantize=fmt if quantize_ref else "none")
    f = rep.first_failure
    return (None if f is None else (f.name, f.max_abs, f.tol)), [d.name for d in rep.diffs]


@pytest.mark.parametrize("fmt,tp", [("int8", 1), ("int8", 2), ("bf16", 2)])
def test_verify_quantize(pools, fmt, tp):
    """verify --quantize int8|bf16 stores both sides' weights so and passes (module and lean path; int8 at tp 1 and
    2); storing only the sharded model's so is caught (held to the fp32 bound; bf16 always is, since both sides
    multiply the same bf16-rounded weights in fp32)."""
    for failure, names in run_tp(pools, tp, job_verify_int8, True, fmt):
        assert failure is None, failure
        assert any("lean" in n for n in names), names
    for failure, _ in run_tp(pools, tp, job_verify_int8, False, fmt):
        assert failure is not None


@pytest.mark.parametrize("corrupt,where", [("lm_head", "logits"), ("down_proj", "model.layers.1.mlp")])
def test_verify_int8_fails_on_a_doubled_block_scale(pools, corrupt, where):
    """verify --quantize int8 at tp=2 fails when one scale of rank 0's int8 weights is doubled (block 0 of row 0:
    32 of the LM head's 288 x 27 weights there, or of the last down_proj's 96 x 288), at the value it moves first,
    although the int8 tolerance allows re-rounding (policy.q8_tolerance: 4x the value's int8 noise); the same
    model uncorrupted passes (test_verify_quantize). ``where``: in the first failing row's name (the tied
    embedding reads the corrupted LM head row too, so an id 0 in the input may fail there first)."""
    import math
    for failure, _ in run_tp(pools, 2, job_verify_int8, True, "int8", corrupt):
        assert failure is not None, f"a doubled {corrupt} scale passed verify"
        name, diff, tol = failure
        assert math.isfinite(diff) and diff > tol, failure
        assert where in name or (corrupt == "lm_head" and "embed" in name), failure


def test_int8_weight_bytes_counts_one_byte_per_weight_plus_scales(folders):
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.parallel import ParallelContext
    from tensorpar.decode.int8 import int8_weight_bytes
    from tensorpar.decode.quantize import quantize_int8
    ctx = ParallelContext.single()
    model, _ = build_parallel_model(folders["llama"], ctx.tp)
    lin = [tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False) if p.dim() == 2
           and "embed" not in n]
    quantize_int8(model, ctx.tp)
    assert len(lin) == 2 * 7 + 1                                   # q, k, v, o, gate, up, down per layer; LM head
    assert int8_weight_bytes(model) == sum(o * i for o, i in lin) + 2 * sum(o * i // 32 for o, i in lin)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_int8(model, ctx.tp)


def _quantized_linears(model):
    """``(name, module)`` of the Linears :func:`quantize_int8` quantizes: q/k/v/o, gate/up/down, the LM head."""
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return [(n, m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in names] + [("lm_head", model.lm_head)]


def job_memory(ctx, folder, ids, mask, n):
    import gc
    import weakref

    from tensorpar.hf.load import build_parallel_model
    from tensorpar.decode.prepare import fuse_projections
    from tensorpar.decode.quantize import quantize_int8, resident_weight_bytes
    model, _ = build_parallel_model(folder, ctx.tp)
    fuse_projections(model)            # the lean path's fused fp q/k/v and gate/up buffers, as after a generate call
    lin = _quantized_linears(model)
    fp = [weakref.ref(m.weight) for _, m in lin]
    fp += [weakref.ref(m.__dict__["_lean_fused"][0]) for m in model.modules() if "_lean_fused" in m.__dict__]
    n_q = sum(m.weight.numel() for _, m in lin)                      # this rank's quantized weights
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    before = resident_weight_bytes(model)
    quantize_int8(model, ctx.tp)
    gc.collect()
    alive = sum(r() is not None for r in fp)
    float_2d = sorted(n for n, t in list(model.named_parameters()) + list(model.named_buffers())
                      if t.is_floating_point() and t.dim() == 2)
    after = resident_weight_bytes(model)
    tokens = generate_tokens(model, ctx.tp, ids, mask, sampling=SamplingConfig(max_new_tokens=n), path="lean").tokens
    module = generate_tokens(model, ctx.tp, ids, mask, sampling=SamplingConfig(max_new_tokens=n), path="hf").tokens
    gc.collect()
    return dict(alive=alive, n_fp=len(fp), float_2d=float_2d, before=before, after=after, n_q=n_q,
                tied=tied, after_generate=resident_weight_bytes(model), tokens=tokens, module=module)


@pytest.mark.parametrize("arch,tp", [("llama", 1), ("llama", 2), ("qwen2", 2)])
def test_int8_frees_the_fp_weights(pools, folders, arch, tp):
    """After quantize_int8 no fp copy of a quantized weight is alive (not the parameters, not the lean path's fused
    buffers, not a tied embedding table), the model's storages shrink by exactly 3 bytes per quantized weight less
    2 bytes of scale per 32 of them (tp=1: the quantized count computed from the config), generating does not bring them back, and the
    tokens (lean and module path) still equal the plain-PyTorch quantized reference. llama ties its embedding to
    the LM head (the table then reads the head's int8 rows); qwen2 does not (its embedding stays fp32) and has
    q/k/v biases."""
    from transformers import AutoConfig
    ids, mask = prompts(ARCHS[arch]["vocab_size"])
    want, _ = fake_quant_reference(folders[arch], ids, mask, 8)
    c = AutoConfig.from_pretrained(folders[arch])
    L, h, f, V = c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size
    nh, nkv = c.num_attention_heads, c.num_key_value_heads
    d = getattr(c, "head_dim", None) or h // nh
    n_q_full = L * (h * (nh + 2 * nkv) * d + nh * d * h + 3 * h * f) + V * h
    for r, res in enumerate(run_tp(pools, tp, job_memory, folders[arch], ids, mask, 8)):
        assert res["tied"] == (arch == "llama")
        assert res["alive"] == 0, f"rank {r}: {res['alive']} of {res['n_fp']} fp weight tensors still alive"
        assert res["float_2d"] == ([] if res["tied"] else ["model.embed_tokens.weight"]), res["float_2d"]
        if tp == 1:
            assert res["n_q"] == n_q_full
        assert res["after"] == res["before"] - 3 * res["n_q"] + 2 * (res["n_q"] // 32), res   # fp16 per 32
        assert res["after"] < 0.5 * res["before"], res               # fp32: 4 bytes per weight before
        assert res["after_generate"] == res["after"], "generating re-created fp weights"
        assert torch.equal(res["tokens"], want) and torch.equal(res["module"], want), f"rank {r}: tokens changed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_on_int8_reads_only_the_int8_weights(folders, monkeypatch, dtype):
    """The lean decoder of a quantized model multiplies by the int8 tensors only: building it and decoding never
    dequantizes a freed fp weight (no ``[in, out]`` view, no oneDNN prepack of one, even with ``prepack=True``),
    nothing is cached on the modules and the resident bytes do not grow; the logits equal those of the same
    decoder run without the check."""
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.decode.lean import LeanDecoder
    from tensorpar.parallel import ParallelContext
    from tensorpar.decode.int8 import int8_linear, Int8Weight
    from tensorpar.decode.quantize import quantize_int8, resident_weight_bytes
    ctx = ParallelContext.single()
    model, _ = build_parallel_model(folders["llama"], ctx.tp, dtype=dtype)
    quantize_int8(model, ctx.tp)
    ids, mask = prompts(ARCHS["llama"]["vocab_size"])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)

    def run(prepack):
        lean = LeanDecoder(model, ctx.tp, max_batch=ids.shape[0], max_len=ids.shape[1] + 1, prepack=prepack)
        first = lean.prefill(ids, mask, pos)
        step = lean.decode(first.argmax(-1, keepdim=True), pos[:, -1:] + 1, ids.shape[1])
        return lean, first, step

    _, want_first, want_step = run(None)
    before = resident_weight_bytes(model)

    def no_dequantize(self):
        raise AssertionError("the lean path dequantized a freed fp weight")
    monkeypatch.setattr(Int8Weight, "dequantize", no_dequantize)
    for prepack in (None, True):
        lean, first, step = run(prepack)
        assert lean.packed is False and lean.lin is int8_linear and lean.linear is int8_linear
        assert all(isinstance(w, Int8Weight) for L in lean.layers for w in (L.wqkv, L.wo, L.wgu, L.wd))
        assert torch.equal(first, want_first) and torch.equal(step, want_step)
    from tensorpar.decode.packed import PACKED_KEY, packed_model
    assert not packed_model(model) and not any(PACKED_KEY in m.__dict__ for m in model.modules())
    assert resident_weight_bytes(model) == before


def test_lean_refuses_a_model_cast_after_quantizing(folders):
    """quantize_int8, then .to(bfloat16): the lean decoder's error names both dtypes and says to quantize after
    the cast (the fast RMSNorm of the lean path must not turn it into an AttributeError)."""
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.decode.lean import LeanDecoder
    from tensorpar.parallel import ParallelContext
    from tensorpar.decode.quantize import quantize_int8
    ctx = ParallelContext.single()
    model, _ = build_parallel_model(folders["llama"], ctx.tp)
    quantize_int8(model, ctx.tp)
    model.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"quantized in torch.float32 and is now torch.bfloat16; quantize after"):
        LeanDecoder(model, ctx.tp, max_batch=1, max_len=8)


def test_int8_rows_refuse_ids_outside_the_table():
    """A tied embedding's lookup in the int8 table raises IndexError for an id past the last row or negative (which
    indexed from the end before), as the fp32 embedding does."""
    from tensorpar.decode.int8 import quantize_weight
    w8 = quantize_weight(torch.randn(100, 64), write=False)
    assert w8.rows(torch.tensor([0, 99])).shape == (2, 64)
    for bad in (100, -1):
        with pytest.raises(IndexError, match="^token id out of range: the embedding has 100 rows on this rank$"):
            w8.rows(torch.tensor([bad]))
