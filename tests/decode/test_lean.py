"""The lean decode path (tensorpar/decode/lean.py) equals the module path and transformers, token for token.

transformers' own greedy tokens for llama / qwen2 / mistral at tp 1-9 are checked by tests/decode/test_generate.py
(generate's default path is the lean one for these families), SmolLM2's by tests/decode/test_smollm2.py and the serve
engine's by tests/decode/test_serve.py; here: lean == module path on the same sharded model, the fused projections share
the parameters' memory, verify runs the lean path, and bf16 decode is the same at tp 1 and tp 2.
"""
import pytest
import torch

from tensorpar.generate import SamplingConfig, generate_tokens
from tests._ranks import run_tp
from tests.decode.test_generate import ARCHS, hf_reference, make_model_folder, prompts


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lean")
    return {a: make_model_folder(root / a, a) for a in ("llama", "qwen2")}


def _storage_bytes(model) -> int:
    seen = {}
    for p in model.parameters():
        st = p.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def job_lean_vs_module(ctx, folder, ids, mask, n):
    from tensorpar.decode.packed import unpack_weights
    from tensorpar.hf.load import build_parallel_model
    model, _ = build_parallel_model(folder, ctx.tp)
    before = _storage_bytes(model)
    cfg = SamplingConfig(max_new_tokens=n)
    module = generate_tokens(model, ctx.tp, ids, mask, sampling=cfg, path="hf").tokens
    lean = generate_tokens(model, ctx.tp, ids, mask, sampling=cfg, path="lean").tokens
    # the fp32 CPU decoder packed the weights in place of the plain ones (tensorpar/decode/packed.py): the module
    # path reads them converted back, then the plain parameters are restored
    packed_module = generate_tokens(model, ctx.tp, ids, mask, sampling=cfg, path="hf").tokens
    unpack_weights(model)
    a = model.model.layers[0].self_attn
    w = a.__dict__["_lean_fused"][0]
    shared = (a.q_proj.weight.data_ptr() == w.data_ptr()
              and a.k_proj.weight.untyped_storage().data_ptr() == w.untyped_storage().data_ptr())
    after_module = generate_tokens(model, ctx.tp, ids, mask, sampling=cfg, path="hf").tokens  # fused module forward
    return module, lean, packed_module, after_module, shared, before, _storage_bytes(model)


@pytest.mark.parametrize("arch,tp", [("llama", 2), ("llama", 3), ("qwen2", 2)])
def test_lean_equals_module_path_without_extra_memory(pools, folders, arch, tp):
    ids, mask = prompts(ARCHS[arch]["vocab_size"])
    want, _ = hf_reference(folders[arch], ids, mask, 24)
    for r, (module, lean, packed, after, shared, before, now) in enumerate(run_tp(pools, tp, job_lean_vs_module,
                                                                                  folders[arch], ids, mask, 24)):
        assert torch.equal(module, want), f"{arch} tp={tp} rank {r}: module path != transformers"
        assert torch.equal(lean, want), f"{arch} tp={tp} rank {r}: lean path != transformers"
        assert torch.equal(packed, want), f"{arch} tp={tp} rank {r}: module path on packed weights != transformers"
        assert torch.equal(after, want), f"{arch} tp={tp} rank {r}: fused module path != transformers"
        assert shared, "q/k/v parameters are not views of the fused weight"
        assert now == before, f"parameter memory grew from {before} to {now} bytes after fusing"


def job_lean_kv_runs(ctx, folder, ids, mask, n, threshold):
    import tensorpar.decode.kv_cache as lean  # the threshold lives with the cache
    from tensorpar.hf.load import build_parallel_model
    model, _ = build_parallel_model(folder, ctx.tp)
    old, lean._RUNS_MIN_ROW_POSITIONS = lean._RUNS_MIN_ROW_POSITIONS, threshold
    try:
        return generate_tokens(model, ctx.tp, ids, mask, sampling=SamplingConfig(max_new_tokens=n), path="lean").tokens
    finally:
        lean._RUNS_MIN_ROW_POSITIONS = old


@pytest.mark.parametrize("tp", [2, 4])
def test_lean_decode_attention_per_kv_head_run_gives_transformers_tokens(pools, folders, tp):
    """The test llama's 9 query / 3 KV heads split 5 + 4 at tp=2, 3 + 2 + 2 + 2 at tp=4 (groups straddle the ranks;
    tp=1 and 3 have equal groups and never take this path, test_generate covers them): decode attention per
    run of query heads (threshold 0: every step) and with copied KV heads (threshold never reached) both give
    transformers' greedy tokens."""
    ids, mask = prompts(ARCHS["llama"]["vocab_size"])
    want, _ = hf_reference(folders["llama"], ids, mask, 24)
    for threshold in (0, 10**9):
        for r, got in enumerate(run_tp(pools, tp, job_lean_kv_runs, folders["llama"], ids, mask, 24, threshold)):
            assert torch.equal(got, want), f"threshold {threshold}, rank {r}"


def test_lean_refuses_unsupported(pools, tmp_path):
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.parallel import ParallelContext
    folder = make_model_folder(tmp_path / "gpt2", "gpt2")
    ctx = ParallelContext.single()
    model, _ = build_parallel_model(str(folder), ctx.tp)
    ids, mask = prompts(53)
    with pytest.raises(ValueError, match="lean.*gpt2"):
        generate_tokens(model, ctx.tp, ids, mask, sampling=SamplingConfig(max_new_tokens=2), path="lean")
    with pytest.raises(ValueError, match="path must be"):
        generate_tokens(model, ctx.tp, ids, mask, sampling=SamplingConfig(max_new_tokens=2), path="fast")


def job_verify(ctx):
    from tensorpar.verify import compare_to_reference
    from tests.verify.test_verify import _pair
    ref, par, ids = _pair(ctx, "llama")
    rep = compare_to_reference(ref, par, ctx.tp, ids)
    return {d.name: (d.max_abs, d.tol) for d in rep.diffs}


def test_verify_runs_the_lean_path(pools):
    for diffs in run_tp(pools, 2, job_verify):
        for name in ("lean prefill logits", "lean decode logits"):
            got, tol = diffs[name]
            assert got <= tol, f"{name}: {got} > {tol}"


def job_bf16(ctx, folder, ids, mask, n):
    from tensorpar import comm
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.decode.lean import LeanDecoder
    model, plan = build_parallel_model(folder, ctx.tp, dtype=torch.bfloat16)
    tokens = generate_tokens(model, ctx.tp, ids, mask, sampling=SamplingConfig(max_new_tokens=n)).tokens
    lean = LeanDecoder(model, ctx.tp, max_batch=ids.shape[0], max_len=ids.shape[1])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = comm.all_gather(lean.prefill(ids, mask, pos).float(), ctx.tp, -1, plan.vocab)
    return tokens, logits


def test_bf16_tp1_equals_tp2(pools, folders):
    """bf16 decode at tp=2 gives tp=1's tokens; prefill logits within verify's bf16 tolerance rule."""
    from tensorpar.verify import tolerance
    ids, mask = prompts(53)
    (t1, l1), = run_tp(pools, 1, job_bf16, folders["llama"], ids, mask, 16)
    for t2, l2 in run_tp(pools, 2, job_bf16, folders["llama"], ids, mask, 16):
        tol = tolerance(torch.bfloat16, ARCHS["llama"]["intermediate_size"], ARCHS["llama"]["num_hidden_layers"] + 1,
                        2, float(l1.abs().max()))
        assert (l2 - l1).abs().max() <= tol
        assert torch.equal(t1, t2)


def test_rms_norm_fast_path_is_the_module_bitwise(folders):
    """The lean path's RMSNorm (fewer framework calls) is taken for the families' norms, fp32 and bf16, and gives
    the module's output bit for bit (including a one-row input, the decode shape)."""
    from transformers import AutoModelForCausalLM

    from tensorpar.decode.kernels import rms_norm_fn
    for arch in ("llama", "qwen2"):
        model = AutoModelForCausalLM.from_pretrained(folders[arch])
        for dtype in (torch.float32, torch.bfloat16):
            norm = model.model.layers[0].input_layernorm.to(dtype)
            with torch.no_grad():
                norm.weight.uniform_(0.5, 1.5)
            fast = rms_norm_fn(norm)
            assert fast is not norm, f"{arch} {dtype}: the fast RMSNorm was not taken"
            for rows in (1, 5):
                x = (torch.randn(rows, norm.weight.shape[0]) * 7).to(dtype)
                with torch.no_grad():
                    assert torch.equal(fast(x), norm(x)), f"{arch} {dtype} rows={rows}"


def test_bf16_prepacked_equals_plain_and_follows_weight_updates(folders):
    """bf16 on CPU: the oneDNN-prepacked matmuls give the plain ``F.linear`` path's logits bit for bit, and a weight
    changed in place after a decoder was built is packed again by the next one (no stale copy)."""
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.decode.kernels import can_pack
    from tensorpar.decode.lean import LeanDecoder
    from tensorpar.parallel import ParallelContext
    ctx = ParallelContext.single()
    model, _ = build_parallel_model(folders["llama"], ctx.tp, dtype=torch.bfloat16)
    if not can_pack(model.lm_head.weight):
        pytest.skip("this CPU's oneDNN has no bf16 kernels: the decoder does not prepack")
    ids, mask = prompts(53)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)

    def logits(prepack):
        lean = LeanDecoder(model, ctx.tp, max_batch=3, max_len=ids.shape[1] + 1, prepack=prepack)
        assert lean.packed is prepack
        first = lean.prefill(ids, mask, pos)
        step = lean.decode(first.argmax(-1, keepdim=True), pos[:, -1:] + 1, ids.shape[1])
        return first, step

    packed, plain = logits(True), logits(False)
    assert torch.equal(packed[0], plain[0]) and torch.equal(packed[1], plain[1])
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(-1)
        model.model.layers[1].self_attn.q_proj.weight.mul_(-1)     # a view of the fused QKV weight
    packed2, plain2 = logits(True), logits(False)
    assert torch.equal(packed2[0], plain2[0]) and torch.equal(packed2[1], plain2[1])
    assert not torch.equal(packed2[0], packed[0]), "the weight change did not change the logits"


def test_attention_per_kv_head_run_equals_copied_kv_heads():
    """Heads split unevenly (SmolLM2's 9 query / 3 KV heads at tp=2: 5 + 4): in a decode step, attention over each
    run of query heads with its one KV head, on cache views, equals attention over the KV heads copied per query
    head within a few units in the last place (bitwise on the AVX-512 machine this was written on; on an AVX2-only
    CPU, torch 2.13's CPU attention differed in the last bit of one element in 45: 1.5e-8 on 1.2). Prefill keeps
    the copies: with several queries the difference grows with the head count."""
    import torch.nn.functional as F

    from tensorpar.decode.kernels import kv_runs
    assert kv_runs([0, 0, 0, 1, 1]) == [(0, 0, 3), (1, 3, 5)]
    assert kv_runs([0, 1, 1, 1]) == [(0, 0, 1), (1, 1, 4)]
    assert kv_runs([0, 1, 0]) == [(0, 0, 1), (1, 1, 2), (0, 2, 3)]
    g = torch.Generator().manual_seed(0)
    for kv_index, s in (([0, 0, 0, 1, 1], 1), ([0, 1, 1, 1], 1)):       # decode: one query per row
        b, L, d = 3, 11, 8
        q = torch.randn(b, len(kv_index), s, d, generator=g)
        cache = torch.randn(b + 2, 2, L + 4, d, generator=g)
        keys, vals = cache[1:1 + b, :, :L], cache[2:2 + b, :, :L]              # views, as the lean path reads them
        mask = torch.rand(b, 1, s, L, generator=g) > 0.3
        mask[..., 0] = True
        idx = torch.tensor(kv_index)
        ref = F.scaled_dot_product_attention(q, keys.index_select(1, idx), vals.index_select(1, idx), attn_mask=mask,
                                             scale=0.3)
        got = torch.cat([F.scaled_dot_product_attention(q[:, q0:q1], keys[:, j:j + 1], vals[:, j:j + 1],
                                                        attn_mask=mask, scale=0.3, enable_gqa=q1 - q0 > 1)
                         for j, q0, q1 in kv_runs(kv_index)], dim=1)
        assert ((got - ref).abs() <= 4 * torch.finfo(torch.float32).eps * ref.abs().max()).all()
