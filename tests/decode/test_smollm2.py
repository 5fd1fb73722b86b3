"""The real model: SmolLM2-135M-Instruct (9 query heads, 3 KV heads, tied embeddings, vocab 49152)
sharded at tp = 2, 3 and 4 gives transformers' single-process greedy tokens for 32 new tokens and
prefill logits within 1e-4 (fp32). Fetched and converted once into the cache (network marker)."""
import pytest
import torch

from tensorpar.generate import SamplingConfig, generate_tokens
from tests._ranks import run_tp

pytestmark = pytest.mark.network

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):"]
N = 32


@pytest.fixture(scope="module")
def smollm2():
    from tensorpar.hub import resolve_model
    return str(resolve_model("smollm2", progress=False))


@pytest.fixture(scope="module")
def reference(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2)
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=N, do_sample=False, min_new_tokens=N, eos_token_id=None,
                             pad_token_id=tok.pad_token_id)
        logits = model(**enc).logits[:, -1]
    del model
    return enc["input_ids"], enc["attention_mask"], out[:, enc["input_ids"].shape[1]:], logits, tok


def job(ctx, folder, ids, mask):
    from tensorpar import comm
    from tensorpar.hf.load import build_parallel_model
    model, plan = build_parallel_model(folder, ctx.tp)
    with torch.no_grad():
        logits = comm.all_gather(model(input_ids=ids, attention_mask=mask).logits[:, -1], ctx.tp, -1, plan.vocab)
    res = generate_tokens(model, ctx.tp, ids, mask, sampling=SamplingConfig(max_new_tokens=N))
    return res.tokens, (logits if ctx.tp.rank == 0 else None), plan.heads.describe()


@pytest.mark.parametrize("tp", [2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_smollm2_greedy_equals_transformers(pools, smollm2, reference, tp):
    ids, mask, want, want_logits, tok = reference
    assert tok.decode(want[0]).startswith(" Paris")
    out = run_tp(pools, tp, job, smollm2, ids, mask)
    tokens, logits, layout = out[0]
    diff = (logits - want_logits).abs().max().item()
    assert diff <= 1e-4, f"tp={tp}: prefill logits differ by {diff:.2e}"
    for r, (t, _, _) in enumerate(out):
        for step in range(N):
            assert torch.equal(t[:, step], want[:, step]), (
                f"tp={tp} rank {r} ({layout}): first difference at step {step}: "
                f"{tok.batch_decode(t[:, :step + 1])} vs {tok.batch_decode(want[:, :step + 1])}")
