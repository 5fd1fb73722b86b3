"""The lean decode path for every family whose record sets ``fast_decode``: greedy tokens equal transformers'
``generate`` and the lean prefill logits equal the module path's (tensorpar/decode/block.py's per-family features:
q/k norms, (1 + w) norms, sandwich and post norms, soft-capping, sliding windows, local/global rotary, checkpoint-
fused projections, plain biased MLPs, LayerNorm, GPT-NeoX's per-head q/k/v rows, partial rotary and parallel
residual, mixture-of-experts blocks called as they are).

The small random models are those of the family parity tests (tests/families.py, tests/families_fam.py,
tests/families_moe.py), with a prompt (7 tokens) plus 10 new tokens longer than their sliding windows (4 and 5), and
left padding.
"""
import pytest
import torch

from tensorpar.generate import SamplingConfig, generate_tokens, inference_only
from tensorpar.hf.families import RECORDS
from tests._ranks import run_tp
from tests.decode.test_generate import hf_reference, prompts

#: every family test config whose record sets fast_decode; gemma2: eager attention (soft-capping)
FAST = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "starcoder2", "olmo2",
        "olmo2:kv1", "gpt_neox", "gpt_neox:seq", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]
N_NEW = 10


def family_config(name):
    from tests import families, families_fam, families_moe
    if name in families_moe.FAMILIES:
        return families_moe.config(name)
    return (families.config if name in families.FAMILIES else families_fam.config)(name)


def save_family(path, name, seed=0):
    """A random-weight model of test config ``name`` saved to ``path`` (norm weights and biases randomised too,
    so that (1 + w) norms, q/k norms and biases are checked with non-trivial values)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(name)).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.normal_(0.0 if n.endswith("bias") else 1.0, 0.3)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("fam")
    return {n: save_family(root / n.replace(":", "_"), n) for n in FAST}


@pytest.fixture(scope="module")
def references(folders):
    ids, mask = prompts(37)
    return {n: hf_reference(folders[n], ids, mask, N_NEW) for n in FAST}


def test_every_fast_family_is_tested():
    """The list above is every family with a fast decode path (a new one cannot be switched on untested)."""
    fast = {mt for mt, r in RECORDS.items() if r.fast_decode}
    assert fast == {family_config(n).model_type for n in FAST}


def job_families(ctx, folders, names, ids, mask, module_tokens=True):
    """Per family: lean greedy tokens, module-path greedy tokens (``None`` without ``module_tokens``), lean and
    module prefill logits (gathered), and the lean greedy tokens with fp32 weights in our GEMV's blocked layout
    (the model marked ``inference_only``, as the generate command does; the plain weights before)."""
    from tensorpar import comm
    from tensorpar.decode.lean import LeanDecoder
    from tensorpar.hf.load import build_parallel_model
    out = {}
    cfg = SamplingConfig(max_new_tokens=N_NEW)
    for n in names:
        model, plan = build_parallel_model(folders[n], ctx.tp)
        lean = generate_tokens(model, ctx.tp, ids, mask, sampling=cfg, path="lean").tokens
        module = generate_tokens(model, ctx.tp, ids, mask, sampling=cfg, path="hf").tokens if module_tokens else None
        inference_only(model)
        blocked = generate_tokens(model, ctx.tp, ids, mask, sampling=cfg, path="lean").tokens
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        dec = LeanDecoder(model, ctx.tp, max_batch=ids.shape[0], max_len=ids.shape[1])
        lean_logits = comm.all_gather(dec.prefill(ids, mask, pos), ctx.tp, -1, plan.vocab)
        with torch.no_grad():
            mod_logits = comm.all_gather(model(input_ids=ids, attention_mask=mask).logits[:, -1], ctx.tp, -1,
                                         plan.vocab)
        out[n] = lean, module, lean_logits, mod_logits, blocked
    return out


def check(results, references, tp):
    for r, per in enumerate(results):
        for n, (lean, module, lean_logits, mod_logits, blocked) in per.items():
            want, want_logits = references[n]
            where = f"{n} tp={tp} rank {r}"
            # fp32: the two paths differ only in the order of sums inside a matmul and the attention kernel
            # (a few ulp of logits of size ~1-10 after 2-3 layers); 1e-4 is the bound of test_generate's check
            assert (lean_logits - mod_logits).abs().max() <= 1e-4, f"{where}: lean vs module prefill logits"
            assert (lean_logits - want_logits).abs().max() <= 1e-4, f"{where}: lean vs transformers logits"
            assert module is None or torch.equal(module, want), f"{where}: module path != transformers"
            assert torch.equal(lean, want), f"{where}: lean path {lean.tolist()} != transformers {want.tolist()}"
            assert torch.equal(blocked, want), f"{where}: blocked weights {blocked.tolist()} != transformers"


def test_lean_greedy_equals_transformers_every_family_tp2(pools, folders, references):
    """CI's case: one tp=2 launch runs every family (KV heads split, or the single KV head replicated: qwen2,
    gemma, olmo2:kv1); the module path's own tokens are checked by the slow cases and the family tests."""
    ids, mask = prompts(37)
    check(run_tp(pools, 2, job_families, folders, FAST, ids, mask, False), references, 2)


@pytest.mark.slow
@pytest.mark.timeout(3600)        # every family, 3-4 ranks: minutes on a loaded 2-core machine
@pytest.mark.parametrize("tp", [1, 3, 4])
def test_lean_greedy_equals_transformers_every_family(pools, folders, references, tp):
    """tp=1 (this process) and tp=3, 4, which split the test configs' heads unevenly (KV heads straddling ranks:
    the per-run attention, the OLMo 2 sum of squares counted once per KV head); module path tokens too."""
    ids, mask = prompts(37)
    check(run_tp(pools, tp, job_families, folders, FAST, ids, mask), references, tp)


def test_gemma_norm_fast_path_is_the_module_bitwise():
    """Gemma's (1 + w) RMSNorm (input, sandwich and Gemma 3's per-head q/k norms) takes the lean path's shorter
    formula, bit for bit the module's in fp32 and bf16, one row (decode) and several."""
    from transformers import AutoModelForCausalLM

    from tensorpar.decode.block import norm_fn
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config("gemma3_text"))
    layer = model.model.layers[0]
    for dtype in (torch.float32, torch.bfloat16):
        for norm in (layer.input_layernorm, layer.post_feedforward_layernorm, layer.self_attn.q_norm):
            norm = norm.to(dtype)
            with torch.no_grad():
                norm.weight.normal_(0, 0.5)
            fast = norm_fn(norm)
            assert fast is not norm, f"{dtype}: the fast Gemma norm was not taken"
            for rows in (1, 5):
                x = (torch.randn(rows, norm.weight.shape[0]) * 7).to(dtype)
                with torch.no_grad():
                    assert torch.equal(fast(x), norm(x)), f"{dtype} rows={rows}"
