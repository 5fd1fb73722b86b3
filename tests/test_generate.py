"""Generation with sharded models equals transformers' single-process generate, token for token."""
import pytest
import torch

from tensorpar.generate import SamplingConfig, generate_tokens, sample
from tests._ranks import run_tp

ARCHS = {
    "llama": dict(model_type="llama", vocab_size=53, hidden_size=36, intermediate_size=40, num_hidden_layers=2,
                  num_attention_heads=9, num_key_value_heads=3, head_dim=4, max_position_embeddings=128,
                  tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2", vocab_size=53, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=False),
    "mistral": dict(model_type="mistral", vocab_size=53, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                    num_attention_heads=6, num_key_value_heads=2, head_dim=4, max_position_embeddings=128,
                    sliding_window=None, tie_word_embeddings=False),
    "gpt2": dict(model_type="gpt2", vocab_size=53, n_embd=24, n_layer=2, n_head=6, n_positions=128,
                 tie_word_embeddings=True),
}


def make_model_folder(path, arch: str, seed: int = 0):
    """Save a random-weight model of ``arch`` as config.json + safetensors into ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM
    kw = dict(ARCHS[arch])
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float()
    if arch == "qwen2":  # give the QKV biases non-zero values so that their slicing is checked
        with torch.no_grad():
            for layer in model.model.layers:
                for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    m.bias.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {a: str(make_model_folder(root / a, a)) for a in ARCHS}


def prompts(vocab: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0          # left padding
    mask[2, :4] = 0
    ids[mask == 0] = 0
    return ids, mask


def hf_reference(folder, ids, mask, n):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0, min_new_tokens=n)
        logits = model(ids, attention_mask=mask).logits[:, -1]
    return out[:, ids.shape[1]:], logits


def job_generate(ctx, folder, ids, mask, n):
    from tensorpar import comm
    from tensorpar.hf.load import build_parallel_model
    model, plan = build_parallel_model(folder, ctx.tp)
    res = generate_tokens(model, ctx.tp, ids, mask, sampling=SamplingConfig(max_new_tokens=n))
    with torch.no_grad():
        local = model(input_ids=ids, attention_mask=mask).logits[:, -1]
    logits = comm.all_gather(local, ctx.tp, -1, plan.vocab)
    return res.tokens, logits


@pytest.mark.parametrize("arch,tps", [("llama", [1, 2, 3, 4, 9]), ("qwen2", [2, 3]), ("mistral", [4]), ("gpt2", [4])])
def test_greedy_equals_transformers(pools, model_dirs, arch, tps):
    folder = model_dirs[arch]
    ids, mask = prompts(ARCHS[arch]["vocab_size"])
    want, want_logits = hf_reference(folder, ids, mask, 32)
    for tp in tps:
        for r, (tokens, logits) in enumerate(run_tp(pools, tp, job_generate, folder, ids, mask, 32)):
            assert (logits - want_logits).abs().max() <= 1e-4, f"{arch} tp={tp} rank {r}: prefill logits"
            for step in range(32):
                assert torch.equal(tokens[:, step], want[:, step]), (
                    f"{arch} tp={tp} rank {r}: first difference at step {step}: {tokens[:, step]} != {want[:, step]}")


def job_sample(ctx, folder, ids, mask):
    from tensorpar.hf.load import build_parallel_model
    model, _ = build_parallel_model(folder, ctx.tp)
    cfg = SamplingConfig(max_new_tokens=12, temperature=0.9, top_k=20, top_p=0.9, seed=7)
    return generate_tokens(model, ctx.tp, ids, mask, sampling=cfg).tokens


def test_sampling_same_on_every_rank_and_seeded(pools, model_dirs):
    ids, mask = prompts(53)
    a = run_tp(pools, 2, job_sample, model_dirs["llama"], ids, mask)
    b = run_tp(pools, 2, job_sample, model_dirs["llama"], ids, mask)
    assert torch.equal(a[0], a[1]) and torch.equal(a[0], b[0])


def test_top_k_top_p_filtering():
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0, -1.0]])
    g = torch.Generator().manual_seed(0)
    draws = {int(sample(logits, SamplingConfig(temperature=1.0, top_k=2), g)) for _ in range(200)}
    assert draws == {0, 1}
    draws = {int(sample(logits, SamplingConfig(temperature=1.0, top_p=0.5), g)) for _ in range(100)}
    assert draws == {0}                      # p(0) = 0.71 >= 0.5: only the top token is kept


def test_prompt_too_long(model_dirs):
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.parallel import ParallelContext
    ctx = ParallelContext.single()
    model, _ = build_parallel_model(model_dirs["llama"], ctx.tp)
    with pytest.raises(ValueError, match="max_position_embeddings=128"):
        generate_tokens(model, ctx.tp, torch.zeros(1, 120, dtype=torch.long), sampling=SamplingConfig(16))
