"""``--model config.json`` for the families tensorpar shards (issue 15.5): the planner's parameter count of
a transformers config equals the parameters of the model transformers builds from it (on the meta
device: no memory, no weights). Dense and mixture-of-experts families."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tensorpar.planner.model_spec import from_hf_config  # noqa: E402

BASE = dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
            intermediate_size=512, vocab_size=1000, max_position_embeddings=512, pad_token_id=0, eos_token_id=1,
            bos_token_id=2)
# Extra parameters the planner leaves out, each well under 0.1 % of a real model: qwen2's QKV bias
# (attention_bias is not in its config), per-head q/k norms (qwen3, olmo2), gemma2's extra norms, the
# shared-expert gate of qwen2_moe, olmoe's q/k norms.
FAMILIES = {
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": {"head_dim": 32}, "gemma": {"head_dim": 32},
    "gemma2": {"head_dim": 32}, "phi3": {}, "olmo2": {}, "starcoder2": {}, "gpt_neox": {"num_key_value_heads": None},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                  "shared_expert_intermediate_size": 256},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "head_dim": 32},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "gemma3_text": {"head_dim": 32}, "stablelm": {},
}


def _real_params(config) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_config_json_parameter_count_matches_transformers(kind, tmp_path):
    kwargs = {**BASE, **{k: v for k, v in FAMILIES[kind].items() if v is not None}}
    if "num_key_value_heads" in FAMILIES[kind]:
        kwargs.pop("num_key_value_heads")
    config = transformers.AutoConfig.for_model(kind, **kwargs)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    spec = from_hf_config(path)
    assert spec.max_positions == 512
    assert spec.is_moe == (kind in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"))
    assert spec.total_params() == pytest.approx(_real_params(config), rel=1e-3)


def test_gpt2_config():
    config = transformers.GPT2Config(n_layer=2, n_embd=256, n_head=8, vocab_size=1000, n_positions=512)
    spec = from_hf_config(config.to_dict())
    assert spec.total_params() == _real_params(config) and spec.max_positions == 512


def test_moe_flops_count_active_experts_only():
    from tensorpar.planner.flops import model_flops

    dense = transformers.AutoConfig.for_model("mixtral", **BASE, num_local_experts=1, num_experts_per_tok=1)
    moe = transformers.AutoConfig.for_model("mixtral", **BASE, num_local_experts=8, num_experts_per_tok=2)
    d, m = from_hf_config(dense.to_dict()), from_hf_config(moe.to_dict())
    mlp_flops_per_token = 2 * 3 * 256 * 512  # gate, up, down for one expert
    extra = model_flops(m, 1, 1) - model_flops(d, 1, 1)  # per token, forward + backward, both layers
    router = 2 * 256 * (8 - 1)
    assert extra == pytest.approx(3 * 2 * (mlp_flops_per_token + router))
    assert m.total_params() - d.total_params() == 2 * (7 * 3 * 256 * 512 + 7 * 256)


@pytest.mark.parametrize("multi_query", [True, False])
def test_gpt_bigcode_multi_query_has_one_kv_head(multi_query):
    """gpt_bigcode with multi_query: one KV head shared by all query heads (it used to be read as 8: a KV cache
    8x too big under --inference)."""
    config = transformers.AutoConfig.for_model("gpt_bigcode", n_layer=2, n_embd=256, n_head=8, vocab_size=1000,
                                               n_positions=512, multi_query=multi_query)
    spec = from_hf_config(config.to_dict())
    assert spec.num_kv_heads == (1 if multi_query else 8)
    assert spec.total_params() == _real_params(config)


def _plan_config(config: dict, tmp_path, capsys):
    from tensorpar import cli

    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code = cli.main(["plan", "--model", str(path), "--gpus", "8", "--global-batch", "8", "--seq", "128"])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("kind", ["megatron-bert", "mobilebert", "layoutlm"])
def test_encoder_families_are_refused(kind, tmp_path, capsys):
    config = transformers.AutoConfig.for_model(kind).to_dict()
    code, out, err = _plan_config(config, tmp_path, capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert f"model_type {kind!r}" in err and "encoder-only or encoder-decoder" in err and "llama" in err


@pytest.mark.parametrize("archs", [["MegatronBertForMaskedLM"], ["LlamaForSequenceClassification"], ["LlamaModel"],
                                   ["BertForQuestionAnswering", "BertForTokenClassification"]])
def test_architectures_without_a_causal_head_are_refused(archs, tmp_path, capsys):
    """Whatever the model_type (here llama, or none), architectures that name no *ForCausalLM head are refused."""
    for kind in ({"model_type": "llama"}, {}):
        config = {**kind, "architectures": archs, "num_hidden_layers": 2, "hidden_size": 64,
                  "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}
        code, out, err = _plan_config(config, tmp_path, capsys)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
        assert archs[0] in err and "encoder-only or encoder-decoder" in err


@pytest.mark.parametrize("kind", ["deepseek_v3", "falcon", "phi"])
def test_families_the_planner_does_not_read_are_refused(kind, tmp_path, capsys):
    """deepseek_v3 (MLA attention, routed experts in n_routed_experts) used to be planned as a dense Llama with a
    fifth of its parameters; falcon and phi miss parameters too. Refused, naming the supported families."""
    config = transformers.AutoConfig.for_model(kind, **BASE).to_dict()
    code, out, err = _plan_config(config, tmp_path, capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert f"model_type {kind!r} is not a family the planner reads" in err
    assert "supported: gemma, gemma2" in err and "qwen3_moe" in err
