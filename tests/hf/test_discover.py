"""--discover-plan / make_plan(discover=True): plans found from the meta model's graph and shapes, proven at tp 2
and 3 against the unsharded transformers model (tensorpar.verify.compare: every watched module, the logits, the
loss and every gradient, each within tensorpar.verify.policy.tolerance, the rule `tensorpar verify` holds every
layout to), and refused, naming the module, where they cannot be placed or do not prove."""
import argparse
import json

import pytest
import transformers as T

from tensorpar.hf.discover import PROVEN, discover_plan, plan_dict, save_plan, variants
from tensorpar.hf.discover_block import DiscoveryError
from tensorpar.verify.prove import prove_discovered, prove_plan, resolve_flags
from tensorpar.hf.plan import make_plan, meta_model
from tensorpar.hf.styles import Replicated


#: configs that state no KV-head count (GPT-BigCode's multi_query: 1; GPT-2: one per query head), whose causal-mask
#: buffer or position table follows max_position_embeddings
NO_KV_COUNT = dict(num_key_value_heads=None, max_position_embeddings=256)
QUIRKS = {"gpt_bigcode": NO_KV_COUNT, "gpt2": NO_KV_COUNT, "gpt-sw3": NO_KV_COUNT,
          "opt": dict(NO_KV_COUNT, ffn_dim=40), "biogpt": NO_KV_COUNT, "gpt_neox": NO_KV_COUNT,
          # Granite's four scalars away from their default 1, so the proof sees them (values of granite-3.0)
          "granite": dict(embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22,
                          attention_multiplier=0.0078125)}


def cfg(model_type, **kw):
    """6 query heads, 2 KV heads of 8: at tp 3 a KV head is shared by ranks (a GQA group straddles two)."""
    base = dict(num_hidden_layers=2, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                intermediate_size=40, vocab_size=61, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return T.AutoConfig.for_model(model_type, **{**base, **QUIRKS.get(model_type, {}), **kw})


TABLES = ("llama", "qwen3", "phi3")
#: mixture-of-experts tables: routed experts only (mixtral, qwen3_moe), a shared expert with its gate (qwen2_moe:
#: one moe_block), a dense layer among the sparse ones (qwen2_moe's mlp_only_layers, placed by block index)
MOE_TABLES = {"mixtral": {}, "qwen3_moe": {},
              "qwen2_moe": dict(num_experts=4, moe_intermediate_size=24, shared_expert_intermediate_size=40),
              "qwen2_moe-dense-1": dict(num_experts=4, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                        mlp_only_layers=[1])}


def _proves(pools, c):
    _, reports = prove_discovered(c, discover_plan(c), pools=pools)
    assert [r["tp_size"] for r in reports] == [2, 3]
    # names only (the proof's instance has the same ones); frozen parameters (ERNIE-4.5-MoE's router score
    # correction, requires_grad=False) have no gradient in either model
    n_params = sum(p.requires_grad for p in meta_model(c).parameters())
    for r in reports:
        assert r["ok"], r
        grads = [d for d in r["diffs"] if d["kind"] == "grad"]
        assert len(grads) == n_params and any(d["name"] == "logits" for d in r["diffs"])


@pytest.mark.parametrize("model_type", sorted(PROVEN) + list(TABLES))
def test_discovered_plan_proves_at_tp2_and_tp3(pools, model_type):
    """Among them: phi (partial rotary applied in its attention forward, parallel residual, output ``dense``),
    gpt_bigcode (one fused ``c_attn`` of (6 + 2 x 1) x 8 rows: multi-query, its KV heads read from the shapes),
    olmo3 (q/k RMSNorms over the whole projection, OLMo 2's style; sliding-window layers)."""
    _proves(pools, cfg(model_type))


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["stablelm", "olmo2", "gpt2", "gpt-sw3", "nanochat", "opt", "biogpt",
                                        "gpt_neox"])
def test_more_discovered_plans_prove(pools, model_type):
    """stablelm: partial rotary in the attention forward; olmo2 (a table family): full-width q/k norms; gpt2 (a
    table family) and gpt-sw3: GPT-2's Conv1D projections ([in, out] weights), fused c_attn; nanochat: its final
    norm runs twice (after the embedding and after the blocks), each call compared with the reference's same call;
    opt, biogpt: the MLP written into the block (fc1 column, fc2 row); biogpt's embedding scale is a float;
    gpt_neox (a table family): its fused query_key_value rows are per head, the proof refuses [q | k | v] and
    passes the per-head variant."""
    _proves(pools, cfg(model_type))


def test_mlp_written_into_the_block_is_found():
    """OPT's fc1 / fc2 are children of the decoder block (no MLP module): split in place as column / row, the
    block's forward kept; its attention declares k_proj, v_proj, q_proj (in that order) and out_proj."""
    c = cfg("opt", ffn_dim=40)
    spec = plan_dict(discover_plan(c))["entries"]
    assert spec["model.decoder.layers.*.fc1"] == {"style": "column"}
    assert spec["model.decoder.layers.*.fc2"] == {"style": "row"}
    assert spec["model.decoder.layers.*.self_attn"] == {"style": "attention", "heads": 6, "kv_heads": 6,
                                                        "head_dim": 8, "o_name": "out_proj"}
    assert make_plan(c, 3, discover=True).intermediate.sizes == (14, 13, 13)   # fc1's 40 rows


@pytest.mark.parametrize("model_type", TABLES + ("gpt2", "olmo2"))
def test_discovered_plan_splits_as_the_table(model_type):
    """On a table family the discovered plan splits heads, MLP and vocabulary exactly as the table does, with the
    table's style on each module both name (GPT-2: the Conv1D styles; OLMo 2: the full-width q/k norm style)."""
    c = cfg(model_type)
    a, b = make_plan(c, 3, discover=True), make_plan(c, 3)
    assert a.heads == b.heads and a.intermediate.sizes == b.intermediate.sizes and a.vocab.sizes == b.vocab.sizes
    assert a.blocks == b.blocks and a.num_layers == b.num_layers
    found, table = ({e.pattern: e.style for e in p.entries} for p in (a, b))
    both = set(found) & set(table)
    assert {p for p in table if p.endswith(("attn", "self_attn", "mlp"))} <= both
    for p in both:
        assert type(found[p]) is type(table[p]), p
    if model_type == "phi3":
        assert found["model.layers.*.self_attn"].fused == "qkv_proj"
        assert found["model.layers.*.mlp"].fused == "gate_up_proj"


def test_fused_per_head_variant_is_the_neox_table_style():
    """GPT-NeoX's fused query_key_value has the shape of [q | k | v] rows; the variant the proof tries next has
    fused_layout per_head, which builds the style of GPT-NeoX's table, splitting heads as the table does."""
    c = cfg("gpt_neox")
    plans = variants(discover_plan(c))
    assert [e.args.get("fused_layout") for p in plans for e in p.entries if e.style == "attention"] == \
        [None, "per_head"]
    a, b = make_plan(c, 3, user_plan=plans[1]), make_plan(c, 3)
    found, table = ({e.pattern: e.style for e in p.entries} for p in (a, b))
    assert type(found["gpt_neox.layers.*.attention"]) is type(table["gpt_neox.layers.*.attention"])
    assert a.heads == b.heads and a.intermediate.sizes == b.intermediate.sizes and a.vocab.sizes == b.vocab.sizes


def test_full_width_qk_norm_argument_is_checked():
    """qk_norm='full' (OLMo 2's style) needs separate projections and norms over the whole projection."""
    c = cfg("llama")
    spec = {"model.layers.*.self_attn": {"style": "attention", "qk_norm": "full"}}
    with pytest.raises(ValueError, match=r"qk_norm='full' needs q_norm.weight of 6x8 = 48 elements; LlamaAttention "
                                         r"has None"):
        make_plan(c, 2, user_plan=spec)
    with pytest.raises(ValueError, match=r"qk_norm='per-head'; one of 'head' .* or 'full'"):
        make_plan(c, 2, user_plan={"model.layers.*.self_attn": {"style": "attention", "qk_norm": "per-head"}})


def _shards(plan, model) -> dict:
    """Module -> (style class, what it splits and how) for every module an entry claims, top-down as
    :meth:`ShardingPlan.check` matches them; replicated modules compare as replicated whatever their note."""
    out, claimed = {}, []
    for name, _ in model.named_modules():
        if any(name.startswith(c + ".") for c in claimed):
            continue
        e = plan.match(name)
        if e is not None and e.style.claims:
            claimed.append(name)
            s = e.style
            out[name] = (type(s).__name__, "" if isinstance(s, Replicated) else s.detail(),
                         [r[:2] for r in s.rows()] if not isinstance(s, Replicated) else [])
    return out


@pytest.mark.parametrize("key", MOE_TABLES)
def test_discovered_moe_plan_shards_as_the_table(key):
    """On the mixture-of-experts tables the discovered plan claims the same modules with the same styles and the
    same splits as the table (router replicated, every expert split over the same expert-width partition,
    Qwen2-MoE's block whole with its shared expert, a dense layer by index), at tp 3 (uneven splits)."""
    c = cfg(key.split("-")[0], **MOE_TABLES[key])
    a, b = make_plan(c, 3, discover=True), make_plan(c, 3)
    assert a.heads == b.heads and a.intermediate.sizes == b.intermediate.sizes and a.vocab.sizes == b.vocab.sizes
    model = meta_model(c)
    got, want = _shards(a, model), _shards(b, model)
    assert got == want
    assert any(v[0] in ("MoEExperts", "SharedExpertMoE") for v in want.values())


def test_olmoe_sparse_block_is_discovered_as_the_table():
    """OLMoE's sparse block alone (``_discover_moe``) is placed as the table places it: the router replicated, the
    stacked experts split by moe_experts over the same widths. (The whole plan is discovered too; its attention
    is OLMo 2's full-width q/k-norm style, a class other than the table's OLMoE style, so it is not compared.)"""
    from tensorpar.hf.discover_block import _discover_moe
    from tensorpar.hf.user_plan import load_user_plan, merge_user_plan
    c = cfg("olmoe")
    model = meta_model(c)
    found = _discover_moe("model.layers.0.mlp", model.model.layers[0].mlp, c, c.hidden_size)
    assert {k: v["style"] for k, v in found.items()} == {".gate": "replicated", ".experts": "moe_experts"}
    table = make_plan(c, 3)
    spec = {f"model.layers.*.mlp{k}": v for k, v in found.items()}
    merged = merge_user_plan(table, load_user_plan(spec), c, model, 3)   # the discovered entries replace the table's
    assert _shards(merged, model) == _shards(table, model)


def test_moe_plan_styles_refuse_what_they_cannot_split():
    """The plan-file styles discovery proposes for experts check their module at plan time, one line each."""
    c = cfg("mixtral")
    with pytest.raises(ValueError, match=r"plan entry 'model.layers.\*.mlp': style 'moe_block' needs a sparse block "
                       r"with gate, experts, shared_expert, shared_expert_gate \(Qwen2-MoE's\); "
                       r"MixtralSparseMoeBlock has gate, experts$"):
        make_plan(c, 2, user_plan={"model.layers.*.mlp": "moe_block"})
    with pytest.raises(ValueError, match=r"plan entry 'model.layers.\*.mlp.gate': style 'moe_experts' needs stacked "
                       r"experts .*; MixtralTopKRouter has weight \[8, 48\]$"):
        make_plan(c, 2, user_plan={"model.layers.*.mlp.gate": "moe_experts"})
    with pytest.raises(ValueError, match=r"plan entry 'model.layers.\*.mlp.experts': size=32 but the module's "
                       r"projection has 40 rows"):
        make_plan(c, 2, user_plan={"model.layers.*.mlp.experts": {"style": "moe_experts", "size": 32}})


def test_saved_plan_is_a_plan_file(tmp_path):
    """--save-plan writes the user-plan JSON --plan-file reads: the same plan, one path."""
    c = cfg("granite")
    path = tmp_path / "granite.json"
    save_plan(discover_plan(c), str(path))
    assert str(make_plan(c, 3, user_plan=str(path))) == str(make_plan(c, 3, discover=True))
    spec = json.loads(path.read_text())
    assert spec["entries"]["model.layers.*.self_attn"] == {"style": "attention", "heads": 6, "kv_heads": 2,
                                                           "head_dim": 8}
    assert spec["blocks"] == "model.layers.*"


def test_plan_that_does_not_prove_is_refused_naming_the_module(pools):
    """SmolLM3 with 8 blocks leaves the rotary embedding out of every 4th (no_rope_layers = [1, 1, 1, 0, ...]); the
    attention style applies it in every block. The proof's instance keeps blocks until each per-layer value
    occurs (4 here, not 2), so block 3's attention is compared and named."""
    c = cfg("smollm3", num_hidden_layers=8)
    assert c.no_rope_layers[:4] == [1, 1, 1, 0]
    with pytest.raises(DiscoveryError, match=r"refused: on a random-weight smollm3 \(4 blocks\) at tp=2 against "
                       r"the unsharded model, model.layers.3.self_attn \(attention\) differs by .* > tolerance"
                       r".*--plan-file"):
        prove_plan(c, discover_plan(c), tps=(2,), train=False, pools=pools)


@pytest.mark.parametrize("model_type, kw, match", [
    ("mixtral", {"router_jitter_noise": 0.1}, r"model.layers.0.mlp: router_jitter_noise=0.1: the router's "
                                              r"training-time jitter is not the same on every rank"),
    ("gpt_oss", {}, r"model.layers.0.mlp.experts \(GptOssExperts\): GptOssExperts.has_bias=True is not supported"),
    ("jetmoe", {}, r"model.layers.0.mlp.input_linear \(JetMoeParallelExperts\): style 'moe_experts' needs stacked "
                   r"experts gate_up_proj \[E, 2f, h\] and down_proj \[E, h, f\]; JetMoeParallelExperts has "
                   r"weight \[8, 80, 48\]"),
    ("persimmon", {"num_key_value_heads": None}, r"model.layers.0.self_attn.q_layernorm.weight \[8\] "
                                                  r"\(PersimmonAttention\) is neither a projection nor a per-head"),
    ("apertus", {}, r"model.layers.0.mlp \(ApertusMLP\) holds act_fn.alpha_p \[1\]"),
    ("bloom", {}, r"transformer.h.0.self_attention \(BloomAttention\)"),
    ("qwen3_next", {}, r"cannot place model.layers.0.linear_attn \(Qwen3NextGatedDeltaNet: .*linear attention"),
])
def test_what_discovery_cannot_place_is_named(model_type, kw, match):
    with pytest.raises(DiscoveryError, match=match + r".*--plan-file"):
        discover_plan(cfg(model_type, **kw))


def test_remote_code_is_refused():
    c = cfg("llama")
    c.auto_map = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    with pytest.raises(DiscoveryError, match=r"llama runs remote code \(config.auto_map\).*--plan-file"):
        discover_plan(c)


def test_flag_combinations_are_refused_before_anything_runs(tmp_path):
    c = cfg("granite")
    with pytest.raises(ValueError, match="--save-plan p.json: needs --discover-plan"):
        resolve_flags(argparse.Namespace(discover_plan=False, save_plan="p.json", plan_file=None), c)
    with pytest.raises(ValueError, match="--discover-plan and --plan-file x.yaml: give one of the two"):
        resolve_flags(argparse.Namespace(discover_plan=True, save_plan=None, plan_file="x.yaml"), c)
    with pytest.raises(ValueError, match="--save-plan .*: the folder .*nope does not exist"):
        resolve_flags(argparse.Namespace(discover_plan=True, save_plan=str(tmp_path / "nope" / "p.json"),
                                         plan_file=None), c)
    with pytest.raises(ValueError, match="--save-plan .*: is a folder; give a file path"):   # before the proof
        resolve_flags(argparse.Namespace(discover_plan=True, save_plan=str(tmp_path), plan_file=None), c)
    with pytest.raises(ValueError, match="either a plan file .* or discover=True"):
        make_plan(c, 2, discover=True, user_plan={"model.layers.*.mlp": "gated_mlp"})


@pytest.mark.slow
def test_generate_discover_plan_saves_a_plan_file(tmp_path):
    """`tensorpar generate --discover-plan --save-plan` on a saved Granite folder (no table) at tp = 2: the plan is
    proven, saved, used; the saved file then runs as --plan-file; `verify --discover-plan --train` passes."""
    import os
    import subprocess
    import sys

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    folder = tmp_path / "granite"
    torch.manual_seed(0)
    c = cfg("granite", vocab_size=29, eos_token_id=28, pad_token_id=28, bos_token_id=None)
    AutoModelForCausalLM.from_config(c).save_pretrained(folder)
    vocab = {chr(ord("a") + i): i for i in range(26)} | {" ": 26, ".": 27, "<eos>": 28}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<eos>").save_pretrained(folder)
    saved = tmp_path / "granite.json"
    env = dict(os.environ, PYTHONPATH=os.getcwd(), TENSORPAR_THREADS="1")

    def cli(cmd, *args):
        return subprocess.run([sys.executable, "-m", "tensorpar", cmd, "--model", str(folder), *args],
                              capture_output=True, text=True, timeout=600, env=env)
    r = cli("generate", "--tp", "2", "--discover-plan", "--save-plan", str(saved), "--prompt", "the cat",
            "--max-new-tokens", "4", "--fast-collectives", "off")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "time to first token" in r.stdout and saved.is_file()
    r = cli("generate", "--tp", "2", "--plan-file", str(saved), "--print-plan")
    assert r.returncode == 0 and "6 q heads -> [3, 3]" in r.stdout, r.stderr[-2000:]
    r = cli("verify", "--tp", "3", "--train", "--discover-plan")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def _save_with_tokenizer(folder, c):
    """A random-weight model of ``c`` saved by transformers with a 29-token character tokenizer; returns it."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(c).eval()
    m.save_pretrained(folder)
    vocab = {chr(ord("a") + i): i for i in range(26)} | {" ": 26, ".": 27, "<eos>": 28}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<eos>").save_pretrained(folder)
    return m, vocab


GLM4_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, vocab_size=29,
                eos_token_id=28, pad_token_id=28, bos_token_id=None)


def test_per_expert_checkpoint_of_a_family_without_a_table_is_read(tmp_path):
    """transformers saves GLM-4-MoE's stacked experts one tensor per expert (mlp.experts.{e}.gate_proj.weight ...);
    with no table, the layout comes from transformers' own conversion for glm4_moe, so the checkpoint check
    (the launcher's, before ranks start) accepts it instead of calling the stacked tensors missing."""
    from tensorpar.hf.load import check_checkpoint
    from tensorpar.hf.moe_checkpoint import layout
    c = cfg("glm4_moe", **GLM4_MOE)
    _save_with_tokenizer(tmp_path, c)
    assert layout("glm4_moe") == ("mlp", ("gate_proj", "up_proj", "down_proj"))
    check_checkpoint(tmp_path, c)


@pytest.mark.slow
@pytest.mark.parametrize("model_type, kw", [("granitemoe", dict(vocab_size=29, eos_token_id=28, pad_token_id=28,
                                                                 bos_token_id=None)),
                                            ("glm4_moe", GLM4_MOE)])
def test_generate_discover_plan_moe_gives_transformers_tokens(tmp_path, model_type, kw):
    """`tensorpar generate --tp 2 --discover-plan` on a saved mixture-of-experts folder without a table (GraniteMoE:
    experts stored stacked under other names; GLM-4-MoE: one tensor per expert, a dense first layer, shared
    experts) gives transformers' greedy tokens (fp32, greedy: the same argmax)."""
    import os
    import subprocess
    import sys

    import torch
    m, vocab = _save_with_tokenizer(tmp_path / model_type, cfg(model_type, **kw))
    ids = torch.tensor([[vocab[ch] for ch in "the cat"]])
    want = m.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
    from transformers import AutoTokenizer
    text = AutoTokenizer.from_pretrained(tmp_path / model_type).decode(want, skip_special_tokens=True)
    env = dict(os.environ, PYTHONPATH=os.getcwd(), TENSORPAR_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "tensorpar", "generate", "--model", str(tmp_path / model_type), "--tp",
                        "2", "--discover-plan", "--prompt", "the cat", "--max-new-tokens", "6",
                        "--fast-collectives", "off"], capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[0] == "the cat" + text


def test_output_dropout_inside_attention_is_kept():
    """GPT-BigCode applies an nn.Dropout (resid_dropout, p = resid_pdrop) after its output projection; the discovered
    attention style dropped it (the proof runs in eval mode and cannot see it), so training a saved discovered plan
    ran without it. It is kept as the families' output dropouts are: a keyed dropout of the same rate."""
    import copy

    from tensorpar.hf.apply import parallelize
    from tensorpar.parallel import ParallelContext
    from tensorpar.testing import random_model
    c = cfg("gpt_bigcode")
    assert c.resid_pdrop > 0
    par = parallelize(copy.deepcopy(random_model(c)), make_plan(c, 1, discover=True), ParallelContext.single().tp)
    drops = [b.attn.output_dropout for b in par.transformer.h]
    assert all(d is not None and d.p == c.resid_pdrop for d in drops), drops


def test_proof_instance_drops_entries_of_blocks_it_lacks():
    """A MoE family with dense and sparse blocks mixed is placed block by block; on its default layer count the
    proof's smaller instance had entries for blocks it lacks ('model.layers.2.mlp.gate' matches no module), so the
    coverage sweep refused ernie4_5_moe. The instance's plan keeps the entries of its own blocks only."""
    from tensorpar.verify.prove import instance_spec, tiny_config
    c = cfg("ernie4_5_moe", num_hidden_layers=6)
    plan = discover_plan(c)
    small = tiny_config(c)
    assert small.num_hidden_layers < 6 and any(".5." in e.pattern for e in plan.entries)
    spec = instance_spec(plan, small.num_hidden_layers)
    assert not any(f".{i}." in p for p in spec["entries"] for i in range(small.num_hidden_layers, 6))
    make_plan(small, 2, user_plan=spec)    # builds (raised "matches no module" before)
