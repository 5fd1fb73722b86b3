"""User plans (--plan-file / make_plan(user_plan=...)): the docs' worked example (Granite, no built-in table)
proven against the unsharded transformers model at tp = 1..4, overrides of a built-in table, and one error per
kind of mistake, each naming the entry."""
import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tensorpar import comm
from tensorpar.generate import SamplingConfig, generate_tokens
from tensorpar.grads import grad_norm, sync_duplicated_grads
from tensorpar.hf.apply import parallelize
from tensorpar.hf.plan import make_plan
from tensorpar.hf.user_plan import load_user_plan
from tensorpar.layers import vocab_parallel_cross_entropy
from tensorpar.testing import assert_parity, compare_grads, random_model
from tests._ranks import run_tp
from tests.families import config as family_config

DOCS = Path(__file__).resolve().parents[2] / "docs" / "plans.md"


def granite_yaml() -> str:
    """The worked example's plan, read from docs/plans.md (so the documented file is the tested one)."""
    text = DOCS.read_text()
    return re.search(r"<!-- granite-plan.*?-->\s*```yaml\n(.*?)```", text, re.S).group(1)


def granite_config():
    import transformers as T
    c = T.GraniteConfig(vocab_size=37, hidden_size=40, intermediate_size=44, num_hidden_layers=2,
                        num_attention_heads=10, num_key_value_heads=2, max_position_embeddings=64,
                        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3,
                        logits_scaling=1.7, tie_word_embeddings=False)
    c._attn_implementation = "sdpa"
    return c


def _parity(ctx, cfg, user_plan, generate=True):
    tp = ctx.tp
    ref = random_model(cfg)
    plan = make_plan(cfg, tp.size, user_plan=user_plan)
    par = parallelize(copy.deepcopy(ref), plan, tp)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    logits_ref = ref(ids).logits
    loss_ref = F.cross_entropy(logits_ref[:, :-1].reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
    loss_ref.backward()
    logits = par(ids).logits
    loss = vocab_parallel_cross_entropy(logits[:, :-1], ids[:, 1:], tp, partition=par)
    loss.backward()
    sync_duplicated_grads(par.parameters(), tp)
    d = [assert_parity("logits", comm.all_gather(logits.detach(), tp, -1, plan.vocab), logits_ref),
         assert_parity("loss", loss, loss_ref)]
    d += compare_grads(par, ref, tp.rank)
    d.append(assert_parity("grad norm", grad_norm(par.parameters(), tp),
                           torch.cat([p.grad.flatten() for p in ref.parameters()]).norm()))
    if generate:
        par.eval(), ref.eval()
        prompt = torch.randint(1, cfg.vocab_size, (2, 5))
        want = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False,
                            min_new_tokens=16, pad_token_id=0, eos_token_id=None)[:, 5:]
        got = generate_tokens(par, tp, prompt, sampling=SamplingConfig(max_new_tokens=16)).tokens
        assert torch.equal(got, want), f"greedy tokens differ:\n{got}\n{want}"
    return len(d), {n: tuple(p.shape) for n, p in par.named_parameters()}, max(x.max_abs for x in d)


def job_granite(ctx, plan_path):
    return _parity(ctx, granite_config(), plan_path)


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_granite_worked_example_parity(pools, tmp_path, tp):
    path = tmp_path / "granite.yaml"
    path.write_text(granite_yaml())
    res = run_tp(pools, tp, job_granite, str(path))
    plan = make_plan(granite_config(), tp, user_plan=str(path))
    for r, (n, shapes, _) in enumerate(res):
        assert n > 10
        assert shapes["model.layers.0.self_attn.q_proj.weight"] == (plan.heads.q_heads.sizes[r] * 4, 40)
        assert shapes["model.layers.0.mlp.gate_proj.weight"] == (plan.intermediate.sizes[r], 40)
        assert shapes["lm_head.weight"] == (plan.vocab.sizes[r], 40)
    assert "model.norm.weight" in plan.implicit_replicated and "replicated, in no entry" in str(plan)


def test_granite_without_a_plan_points_to_plan_file():
    with pytest.raises(ValueError, match=r"unsupported architecture model_type='granite'.*--plan-file"):
        make_plan(granite_config(), 2)


def job_override(ctx):
    return _parity(ctx, family_config("llama"), {"model.layers.0.mlp": "replicated",
                                                 "model.layers.*.mlp": {"style": "gated_mlp"}}, generate=False)


def test_override_keeps_one_mlp_whole(pools):
    """A user entry before the built-in table: block 0's MLP is replicated (full weights on every rank), block
    1's stays split; the llama table's own pattern is replaced in place; parity at tp = 3."""
    res = run_tp(pools, 3, job_override)
    cfg = family_config("llama")
    for _, shapes, _ in res:
        assert shapes["model.layers.0.mlp.gate_proj.weight"] == (cfg.intermediate_size, cfg.hidden_size)
        assert shapes["model.layers.1.mlp.gate_proj.weight"][0] < cfg.intermediate_size
    plan = make_plan(cfg, 3, user_plan={"model.layers.0.mlp": "replicated"})
    assert [e.pattern for e in plan.entries[:2]] == ["model.layers.0.mlp", "model.embed_tokens"]
    assert plan.implicit_replicated == ()


def test_json_and_yaml_files_give_the_same_plan(tmp_path):
    import yaml
    spec = yaml.safe_load(granite_yaml())
    (tmp_path / "p.json").write_text(json.dumps(spec))
    (tmp_path / "p.yml").write_text(granite_yaml())
    a = make_plan(granite_config(), 3, user_plan=str(tmp_path / "p.json"))
    b = make_plan(granite_config(), 3, user_plan=str(tmp_path / "p.yml"))
    c = make_plan(granite_config(), 3, user_plan=spec)
    assert str(a) == str(b) == str(c)
    assert a.blocks == "model.layers.*" and a.num_layers == 2 and a.heads.q_heads.sizes == (4, 3, 3)


def _err(user_plan, match, cfg=None, tp=2):
    with pytest.raises(ValueError, match=match):
        make_plan(cfg or granite_config(), tp, user_plan=user_plan)


def test_pattern_matching_nothing_names_the_entry():
    _err({"model.layers.*.mlpp": "gated_mlp"},
         r"plan entry 'model.layers.\*.mlpp' \(user plan\) matches no module of the granite model; "
         r"closest module names: model.layers.\*.mlp")


def test_unknown_style_names_the_entry_and_lists_styles():
    _err({"model.layers.*.mlp": {"style": "swiglu"}},
         r"plan entry 'model.layers.\*.mlp': style 'swiglu' does not exist; styles: attention, column, encoder_attention")


def test_unknown_argument_names_the_entry():
    _err({"model.layers.*.mlp": {"style": "gated_mlp", "hidden": 3}},
         r"plan entry 'model.layers.\*.mlp': style 'gated_mlp' takes no argument\(s\) hidden")


def test_split_that_breaks_heads_is_refused():
    # 40 rows of q_proj are 10 heads of 4; "8 heads of 6" would cut heads apart
    _err({"model.layers.*.self_attn": {"style": "attention", "heads": 8, "kv_heads": 2, "head_dim": 6}},
         r"plan entry 'model.layers.\*.self_attn': heads x head_dim = 48 rows but GraniteAttention has 40; "
         r"a split by these sizes would cut a head")
    _err({"model.layers.*.self_attn": {"style": "mlp", "up": "q_proj", "down": "o_proj"}},
         r"plan entry 'model.layers.\*.self_attn': style 'mlp' on the attention module GraniteAttention would "
         r"split its projections without regard to heads")
    _err({"model.layers.*.self_attn": "attention"}, r"plan entry 'model.layers.\*.self_attn': tp_size \(11\) "
         r"exceeds the number of attention heads \(10\)", tp=11)


def test_large_unclaimed_parameter_must_be_declared():
    entries = yaml_entries()
    del entries["lm_head"]
    # lm_head.weight: 37 x 40 = 1480 elements > 1000
    _err({"replicate_threshold": 1000, "entries": entries},
         r"user plan: lm_head.weight \(1,480 elements\) is claimed by no entry and is larger than "
         r"replicate_threshold=1,000; shard it with a plan entry, or declare its module replicated: "
         r"\{\"lm_head\": \"replicated\"\}")
    plan = make_plan(granite_config(), 2, user_plan={"replicate_threshold": 1000,
                                                     "entries": {**entries, "lm_head": "replicated"}})
    assert plan.match("lm_head").style.name == "replicated"


def yaml_entries() -> dict:
    import yaml
    return dict(yaml.safe_load(granite_yaml())["entries"])


def test_size_mismatch_and_bad_files(tmp_path):
    _err({"model.layers.*.mlp": {"style": "gated_mlp", "size": 40}},
         r"plan entry 'model.layers.\*.mlp': size=40 but the module's projection has 44 rows")
    (tmp_path / "p.toml").write_text("x")
    _err(str(tmp_path / "p.toml"), r"unknown suffix '.toml'; use .json, .yaml or .yml")
    (tmp_path / "bad.json").write_text("{")
    _err(str(tmp_path / "bad.json"), r"plan file '.*bad.json' does not parse")
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_user_plan(str(tmp_path / "missing.yaml"))
    _err({"model.layers.*.mlp": 3}, r"plan entry 'model.layers.\*.mlp': expected a style name or a mapping")


def test_sequence_parallel_user_plan_without_table_is_refused():
    with pytest.raises(ValueError, match="sequence_parallel=True needs a built-in table"):
        make_plan(granite_config(), 2, sequence_parallel=True, user_plan=yaml_entries())


@pytest.mark.slow
def test_generate_with_plan_file(tmp_path):
    """`tensorpar generate --plan-file granite.yaml` at tp = 2 on a saved Granite folder; without the file it
    stops before launching, pointing to --plan-file."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    folder = tmp_path / "granite"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(granite_config()).save_pretrained(folder)
    vocab = {chr(ord("a") + i): i for i in range(26)} | {" ": 26, ".": 27, "<eos>": 28}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<eos>").save_pretrained(folder)
    plan_file = tmp_path / "granite.yaml"
    plan_file.write_text(granite_yaml())
    env = dict(os.environ, PYTHONPATH=os.getcwd(), TENSORPAR_THREADS="1")

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "tensorpar", "generate", "--model", str(folder), *args],
                              capture_output=True, text=True, timeout=300, env=env)
    r = cli("--tp", "2")
    assert r.returncode == 2 and "unsupported architecture model_type='granite'" in r.stderr \
        and "--plan-file" in r.stderr
    r = cli("--tp", "2", "--plan-file", str(plan_file), "--print-plan")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ShardingPlan(granite, tp_size=2" in r.stdout and "10 q heads -> [5, 5]" in r.stdout
    r = cli("--tp", "2", "--plan-file", str(plan_file), "--prompt", "the cat", "--max-new-tokens", "4",
            "--fast-collectives", "off")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "time to first token" in r.stdout


def _llama_folder(path):
    """A random Llama of 4 query heads, 2 KV heads of head_dim 8 (hidden 32), saved with a tokenizer."""
    from transformers import LlamaConfig

    from tests.decode.test_generate_cli import _add_tokenizer
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    random_model(cfg).save_pretrained(path)
    _add_tokenizer(path)
    return cfg


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_plan_file_with_rows_that_match_other_heads_fails_before_launch(tmp_path, monkeypatch, capsys, command):
    """8 heads of 4 rows (kv 4 x 4) have the rows of the model's 4 heads of 8 (kv 2 x 8): every row count matches,
    and the ranks used to start and fail in the rotary kernel (head_dim 8 tables on 4-wide heads: a traceback on a
    rank). The launching process refuses it in one line naming the plan file, the entry, the value and the heads
    that fit, and starts no rank."""
    from tensorpar.cli import main
    from tensorpar import launch

    _llama_folder(tmp_path / "m")
    plan = tmp_path / "p.json"
    plan.write_text(json.dumps({"model.layers.*.self_attn": {"style": "attention", "heads": 8, "kv_heads": 4,
                                                             "head_dim": 4}}))
    started = []
    monkeypatch.setattr(launch, "run_ranks", lambda *a, **k: started.append(a) or 0)
    extra = ["--max-new-tokens", "2"] if command == "generate" else ["--port", "0"]
    capsys.readouterr()
    assert main([command, "--model", str(tmp_path / "m"), "--tp", "2", "--plan-file", str(plan), *extra]) == 2
    err = capsys.readouterr().err
    assert err == (f"tensorpar {command}: error: plan entry 'model.layers.*.self_attn' (plan file '{plan}'): head_dim=4 "
                   f"(heads=8, kv_heads=4) but LlamaAttention's heads are 8 wide (its head_dim: its rotary tables, "
                   f"scaling and per-head norms are built for it); the rows match, the heads do not: give heads=4, "
                   f"kv_heads=2, head_dim=8\n"), err
    assert started == []
    plan.write_text(json.dumps({"model.layers.*.self_attn": {"style": "attention", "heads": 4, "kv_heads": 2,
                                                             "head_dim": 8}}))
    assert main([command, "--model", str(tmp_path / "m"), "--tp", "2", "--plan-file", str(plan), *extra]) == 0
    assert len(started) == 1     # the heads that fit: launched


def test_fused_projection_heads_must_fit_the_output_projection():
    """Phi-3's fused qkv_proj holds (heads + 2 kv_heads) x head_dim rows: the family config's 6 heads and 2 KV
    heads of 8 give 80, and so do 8 heads and 1 KV head. The output projection takes 6 x 8 = 48 input features,
    which the ranks' row-parallel split (RowParallelLinear: heads x head_dim of them) would refuse on every rank:
    refused at plan time instead."""
    cfg = family_config("phi3")
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size) == (6, 2, 48)
    _err({"model.layers.*.self_attn": {"style": "attention", "fused": "qkv_proj", "heads": 8, "kv_heads": 1,
                                       "head_dim": 8}},
         r"plan entry 'model.layers.\*.self_attn' \(user plan\): heads x head_dim = 8x8 = 64 but "
         r"Phi3Attention.o_proj takes 48 input features \(heads=8, kv_heads=1, head_dim=8\): give the heads, "
         r"kv_heads and head_dim of this module", cfg=cfg)


@pytest.mark.parametrize("value", [0, -9, "abc", 2.5, True])
def test_plan_entry_head_counts_must_be_positive_integers(value):
    """Review (2026-12-02): "heads": 0 was taken as left out (the config's), -9 gave "use tp_size <= -9" and "abc"
    a bare int() error; each is now one line naming the entry, the field and its value."""
    cfg = family_config("phi3")
    _err({"model.layers.*.self_attn": {"style": "attention", "fused": "qkv_proj", "heads": value}},
         r"plan entry 'model.layers.\*.self_attn'.*: \"heads\" must be a positive integer \(or left out: the "
         r"config's value\), got " + re.escape(repr(value)), cfg=cfg)


def test_plan_entry_heads_that_do_not_group_name_the_config_heads():
    """8 heads over the config's 2 KV heads group, 7 do not: the message gives the config's counts."""
    cfg = family_config("phi3")
    _err({"model.layers.*.self_attn": {"style": "attention", "fused": "qkv_proj", "heads": 7}},
         r"plan entry 'model.layers.\*.self_attn'.*multiple.*\(the config's: heads=6, kv_heads=2\)", cfg=cfg)


def test_user_plan_on_a_vision_table():
    """encoder_attention in a user plan over the ViT table: the documented heads x head_dim are accepted, a
    head_dim that would cut heads (ViT's q_proj has 5 x 12 = 60 rows) is refused naming the entry."""
    from tests.hf.test_vit import config as vit_config
    cfg = vit_config("vit")
    plan = make_plan(cfg, 2, user_plan={"vit.layers.*.attention": {"style": "encoder_attention", "heads": 5,
                                                                   "head_dim": 12}})
    assert plan.match("vit.layers.1.attention").style.layout.q_heads.sizes == (3, 2)
    _err({"vit.layers.*.attention": {"style": "encoder_attention", "head_dim": 8}},
         r"plan entry 'vit.layers.\*.attention': heads x head_dim = 40 rows but ViTAttention has 60", cfg=cfg)


def gpt_oss_config():
    """A tiny gpt_oss (no built-in table): 6 query heads with one attention sink each, 2 KV heads, biases on
    every projection, a sliding and a full layer, 4 experts (small: replicated implicitly)."""
    import transformers as T
    c = T.GptOssConfig(vocab_size=37, hidden_size=24, intermediate_size=16, num_hidden_layers=2,
                       num_attention_heads=6, num_key_value_heads=2, head_dim=4, num_local_experts=4,
                       num_experts_per_tok=2, max_position_embeddings=64, sliding_window=4,
                       layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    c._attn_implementation = "eager"  # what transformers picks for gpt_oss (no sdpa: the sinks)
    return c


GPT_OSS_PLAN = {"model.embed_tokens": "vocab_embedding", "model.layers.*.self_attn": "attention",
                "lm_head": "lm_head"}


def job_gpt_oss(ctx):
    return _parity(ctx, gpt_oss_config(), GPT_OSS_PLAN)


@pytest.mark.parametrize("tp", [2, 3])
def test_gpt_oss_attention_sinks_sharded_with_the_query_heads(pools, tp):
    """gpt_oss's ``sinks`` (one logit per query head) go with the rank's query heads: logits, loss, every gradient
    (the sinks' slices included), grad norm and 16 greedy tokens equal transformers' unsharded model (tolerance of
    assert_parity: fp32, only the reduction order differs); at tp = 3 a KV head straddles two ranks."""
    plan = make_plan(gpt_oss_config(), tp, user_plan=GPT_OSS_PLAN)
    for r, (n, shapes, _) in enumerate(run_tp(pools, tp, job_gpt_oss)):
        assert shapes["model.layers.0.self_attn.sinks"] == (plan.heads.q_heads.sizes[r],)
        assert n > 20


def test_unknown_attention_parameter_is_refused_naming_it():
    """A per-head parameter the attention style does not know is refused at plan time (it would be lost)."""
    from tensorpar.hf.plan import meta_model
    cfg = family_config("llama")
    model = meta_model(cfg)
    model.model.layers[1].self_attn.head_gate = torch.nn.Parameter(torch.ones(cfg.num_attention_heads, device="meta"))
    with pytest.raises(ValueError, match=r"'model\.layers\.\*\.self_attn': style 'attention' does not know "
                                         r"model\.layers\.1\.self_attn\.head_gate"):
        make_plan(cfg, 2).check(model)
