"""Generation with sharded models equals transformers' single-process generate, token for token."""
import pytest
import torch

from tensorpar.generate import SamplingConfig, generate_tokens
from tensorpar.serve.tokens import sample
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


def hf_reference(folder, ids, mask, n, device="cpu"):
    """transformers' greedy tokens ``[B, n]`` and last prompt logits ``[B, V]`` (on ``device``) of ``folder``."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    ids, mask = ids.to(device), mask.to(device)
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


@pytest.mark.parametrize("arch,tps", [("llama", [1, 2, 3]), ("qwen2", [2, 3]), ("mistral", [4]), ("gpt2", [4]),
                                      # 9 ranks on 2 cores (a pool of its own): slow
                                      pytest.param("llama", [9], marks=pytest.mark.slow),
                                      # llama at tp 4 (uneven heads): also tests/decode/test_lean_families.py[4], slow
                                      pytest.param("llama", [4], marks=pytest.mark.slow)])
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


def many_rows(n: int) -> list[int]:
    """Indices of ``n`` prompts repeated to one more row than the row step runs (a packed engine)."""
    from tensorpar.decode import gemv_kernel
    return [i % n for i in range(gemv_kernel.MAX_ROWS + 1)]


def job_reuse(ctx, folder, ids, mask, n):
    """Consecutive generate_tokens calls on one model: the engines they build (counted by a spy on Engine.__init__)
    and their tokens. Two rows (plain weights: the engine is kept), then more than the row step's MAX_ROWS (the
    three prompts over and over: packed for the call, then plain again and no engine kept)."""
    from tensorpar.decode.packed import packed_model
    from tensorpar.generate import cached_engine
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.serve import engine as engine_mod
    model, _ = build_parallel_model(folder, ctx.tp)
    built = []
    init = engine_mod.Engine.__init__

    def spy(self, *a, **k):
        built.append(self)
        init(self, *a, **k)
    engine_mod.Engine.__init__ = spy
    two, mask2 = ids[:2], mask[:2]
    try:
        def gen(ids_, mask_, n_):
            return generate_tokens(model, ctx.tp, ids_, mask_, sampling=SamplingConfig(max_new_tokens=n_)).tokens
        out = {"first": gen(two, mask2, n)}
        e1 = cached_engine(model)
        out["second"] = gen(two, mask2, n)
        out["same_engine"] = e1 is not None and cached_engine(model) is e1 and len(built) == 1 and built[0] is e1
        out["shorter"] = gen(two, mask2, n - 3)          # fewer positions: the same engine
        out["shorter_same"] = cached_engine(model) is e1 and len(built) == 1
        with torch.no_grad():       # an in-place write to a parameter (as a LoRA merge does): a new engine
            model.model.layers[0].mlp.down_proj.weight.mul_(1.0)
        out["after_write"] = gen(two, mask2, n)
        out["rebuilt_after_write"] = len(built) == 2 and cached_engine(model) is built[1]
        many = many_rows(ids.shape[0])
        out["many_rows"] = gen(ids[many], mask[many], n)    # another batch size: a new engine, packed for the call
        w = model.model.layers[0].mlp.down_proj.weight
        out["plain_after_packed_call"] = (len(built) == 3 and cached_engine(model) is None
                                          and not packed_model(model) and isinstance(w, torch.nn.Parameter))
    finally:
        engine_mod.Engine.__init__ = init
    return out


def test_generate_reuses_its_engine(pools, model_dirs):
    """generate_tokens keeps its Engine (fused weights, KV cache, row step) on the model and reuses it: a second
    call with the same two rows gives bitwise the same greedy tokens (and transformers') without building another,
    a call with fewer positions too; an in-place write to a parameter (what a LoRA merge does) or another batch
    size builds a new one. 17 rows pack the matmul weights for the call; after it the model holds its plain
    parameters again and no engine (review: a write to a packed module's weight was lost, and a LoRA merge,
    quantize_int8 or .to() failed after such a call). The write multiplies by 1.0: same values, same tokens."""
    folder, tp = model_dirs["llama"], 2             # tp=2: every rank takes the same decisions
    ids, mask = prompts(ARCHS["llama"]["vocab_size"])
    want, _ = hf_reference(folder, ids, mask, 8)
    want2, _ = hf_reference(folder, ids[:2], mask[:2], 8)
    for r, out in enumerate(run_tp(pools, tp, job_reuse, folder, ids, mask, 8)):
        assert torch.equal(out["first"], want2), f"tp={tp} rank {r}: first call != transformers"
        assert torch.equal(out["second"], out["first"]), f"tp={tp} rank {r}: second call's tokens differ"
        assert out["same_engine"], f"tp={tp} rank {r}: the second call built a new engine"
        assert torch.equal(out["shorter"], want2[:, :5]) and out["shorter_same"]
        assert out["rebuilt_after_write"] and torch.equal(out["after_write"], want2)
        assert torch.equal(out["many_rows"], want[many_rows(want.shape[0])]), f"tp={tp} rank {r}: != transformers"
        assert out["plain_after_packed_call"], f"tp={tp} rank {r}: weights left packed or an engine kept"


def job_late_rank(ctx, folder, ids, mask, late_s):
    import time

    from tensorpar.hf.load import build_parallel_model
    model, _ = build_parallel_model(folder, ctx.tp)
    if ctx.rank == 1:
        time.sleep(late_s)          # a rank that is still loading when the others start
    return generate_tokens(model, ctx.tp, ids, mask, sampling=SamplingConfig(max_new_tokens=2)).ttft_s


@pytest.mark.slow   # a 2-rank launch that sleeps 3 s
def test_first_token_time_starts_when_every_rank_is_ready(pools, model_dirs):
    """The time to first token is the prompt's forward and pick (what the planner predicts), not the wait for a
    rank still loading: rank 1 starts 3 s late; every rank's first token takes far less (a 2-layer model of width
    36; 1.5 s leaves room for a loaded machine). Before, rank 0 (which prints it) counted the 3 s."""
    ids, mask = prompts(53)
    ttfts = run_tp(pools, 2, job_late_rank, model_dirs["llama"], ids, mask, 3.0)
    assert max(ttfts) < 1.5, ttfts


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


# ---------------------------------------------------------------- chat prompts

def bos_chat_folder(path):
    """A random llama whose tokenizer adds BOS (a post-processor, as Llama's does) and whose chat template
    also writes ``{{ bos_token }}``: rendering to text and tokenizing again gives two BOS (sglang PR #888)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    folder = make_model_folder(path, "llama")
    vocab = {chr(ord("a") + i): i for i in range(26)} | {" ": 26, ".": 27, "<eos>": 28, ":": 29, "<s>": 30}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                      special_tokens=[("<s>", 30)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="<eos>", pad_token="<eos>")
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}. {% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    tok.save_pretrained(folder)
    return str(folder)


CHAT_PROMPTS = ["the cat", "a dog ran far"]          # different lengths: the shorter one is left-padded


def _template_ids(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True,
                                   return_dict=False)


def test_chat_prompt_ids_are_apply_chat_templates(tmp_path):
    from transformers import AutoTokenizer

    from tensorpar.generate import _encode
    tok = AutoTokenizer.from_pretrained(bos_chat_folder(tmp_path / "bos"))
    ids, mask = _encode(tok, CHAT_PROMPTS, chat=True)
    for row, m, text in zip(ids, mask, CHAT_PROMPTS):
        want = _template_ids(tok, text)
        assert want.count(tok.bos_token_id) == 1
        assert row[m.bool()].tolist() == want                 # one BOS, not the template's plus the tokenizer's
    assert mask[1].all() and not mask[0].all()               # left padding


def job_chat(ctx, folder, n):
    from transformers import AutoTokenizer

    from tensorpar.generate import _encode
    from tensorpar.hf.load import build_parallel_model
    model, _ = build_parallel_model(folder, ctx.tp)
    ids, mask = _encode(AutoTokenizer.from_pretrained(folder), CHAT_PROMPTS, chat=True)
    return ids, generate_tokens(model, ctx.tp, ids, mask, sampling=SamplingConfig(max_new_tokens=n)).tokens


def test_chat_prompt_greedy_equals_transformers_on_template_ids(pools, tmp_path):
    """What every rank feeds the model for ``--chat`` is apply_chat_template's ids, and the greedy tokens are
    transformers' generate of those ids (each prompt alone: no padding in the reference)."""
    from transformers import AutoTokenizer
    folder = bos_chat_folder(tmp_path / "bos")
    tok = AutoTokenizer.from_pretrained(folder)
    want = []
    for text in CHAT_PROMPTS:
        x = torch.tensor([_template_ids(tok, text)])
        want.append(hf_reference(folder, x, torch.ones_like(x), 8)[0][0])
    for tp in (1, 2):
        for r, (ids, tokens) in enumerate(run_tp(pools, tp, job_chat, folder, 8)):
            for i, text in enumerate(CHAT_PROMPTS):
                assert ids[i][ids[i] != tok.pad_token_id].tolist() == _template_ids(tok, text), f"tp={tp} rank {r}"
                assert torch.equal(tokens[i], want[i]), f"tp={tp} rank {r} prompt {i}: {tokens[i]} != {want[i]}"


@pytest.mark.network
def test_smollm2_chat_prompt_ids_are_apply_chat_templates():
    from transformers import AutoTokenizer

    from tensorpar.generate import _encode
    from tensorpar.hub import resolve_model
    tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2", progress=False)))
    ids, mask = _encode(tok, ["What is 2+2?", "Say hi"], chat=True)
    for row, m, text in zip(ids, mask, ["What is 2+2?", "Say hi"]):
        assert row[m.bool()].tolist() == _template_ids(tok, text)


# ---------------------------------------------------------------- length-dependent rotary factors (rope_scaling)

ROPE_SWITCH = 32        # longrope's original_max_position_embeddings here: prompts of 8 and 29 tokens start short,
ROPE_LENGTHS = {"llama": (8, 29, 70), "phi3": (8, 70)}      # 70 long; 29 + 6 new tokens crosses it while decoding


def make_rope_folder(path, arch: str, rope: str):
    """A random llama or phi3 (both on the lean path) with ``rope_scaling`` of type ``rope``: longrope whose long
    factors differ from its short ones (switching above :data:`ROPE_SWITCH`), or dynamic NTK."""
    from transformers import AutoConfig, AutoModelForCausalLM
    if arch == "llama":
        kw, d = dict(ARCHS["llama"], initializer_range=0.5, tie_word_embeddings=False), 4
    else:
        kw, d = dict(model_type="phi3", vocab_size=53, hidden_size=48, intermediate_size=40, num_hidden_layers=2,
                     num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
                     bos_token_id=1, eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
                     initializer_range=0.5), 8
    if rope == "longrope":
        kw["rope_parameters"] = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * (d // 2),
                                     long_factor=[float(4 ** i) for i in range(d // 2)],
                                     original_max_position_embeddings=ROPE_SWITCH)
        if arch == "phi3":
            kw["original_max_position_embeddings"] = ROPE_SWITCH     # Phi-3 reads it from the config itself
    else:
        kw["rope_parameters"] = dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0)
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).float().save_pretrained(path)
    return str(path)


def rope_prompts(arch: str) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 53, (n,), generator=g).tolist() for n in ROPE_LENGTHS[arch]]


def hf_alone(folder, prompts, n):
    """transformers' greedy generate of each prompt by itself (the reference: the factors of its own length)."""
    out = []
    for p in prompts:
        x = torch.tensor([p])
        out.append(hf_reference(folder, x, torch.ones_like(x), n)[0][0].tolist())
    return out


def job_generate_batch(ctx, folder, prompts, n):
    from tensorpar.hf.load import build_parallel_model
    model, _ = build_parallel_model(folder, ctx.tp)
    s = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (s - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (s - len(p)) + [1] * len(p) for p in prompts])
    return generate_tokens(model, ctx.tp, ids, mask, sampling=SamplingConfig(max_new_tokens=n)).tokens.tolist()


@pytest.mark.parametrize("arch,rope", [("llama", "longrope"), ("phi3", "longrope"), ("llama", "dynamic")])
def test_rope_scaling_batch_of_lengths_equals_each_alone(pools, tmp_path, arch, rope):
    """generate with prompts of 8 and 70 tokens in one batch (left-padded) at tp=2: each row's greedy tokens are
    transformers' generate of that prompt alone (before: the 70-token row gave the 8-token row longrope's long
    factors)."""
    folder = make_rope_folder(tmp_path / f"{arch}_{rope}", arch, rope)
    prompts = rope_prompts(arch)
    want = hf_alone(folder, prompts, 6)
    for r, got in enumerate(run_tp(pools, 2, job_generate_batch, folder, prompts, 6)):
        assert got == want, f"{arch} {rope} rank {r}"


def test_a_copy_of_the_model_does_not_carry_its_engine():
    """The engine kept on a model (generate_tokens' reuse) points at that model's tensors (the row step's programs
    hold raw addresses): a deepcopy or a pickle (torch.save) of the model carries none, so the copy builds its own."""
    import copy
    import pickle

    from tensorpar.generate.engine_cache import ENGINE_KEY, _CachedEngine, cached_engine
    model = torch.nn.Linear(4, 4)
    model.__dict__[ENGINE_KEY] = _CachedEngine(object(), (), ())
    assert cached_engine(model) is not None
    assert cached_engine(copy.deepcopy(model)) is None
    assert cached_engine(pickle.loads(pickle.dumps(model))) is None
