"""The family records and :func:`tensorpar.hf.families.why_not`: one rule for the launching process and the ranks.

No process group: every check here runs on configs, or on a model sharded at tp=1 in this process.
"""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tensorpar.comm import Group
from tensorpar.hf.apply import parallelize
from tensorpar.hf.families import FAMILIES, RECORDS, sliding_window, why_not
from tensorpar.hf.plan import make_plan

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=64, max_position_embeddings=128)


def cfg(model_type, **kw):
    return AutoConfig.for_model(model_type, **{**SMALL, **kw})


def test_every_family_has_one_record_and_the_plan_table_comes_from_it():
    assert set(RECORDS) == set(FAMILIES)
    assert all(RECORDS[mt].plan is FAMILIES[mt] for mt in RECORDS)


@pytest.mark.parametrize("model_type", [mt for mt, r in RECORDS.items() if r.causal_lm])
def test_sequence_parallel_in_the_record_is_what_the_plan_does(model_type):
    """The record's sequence_parallel flag and the plan builder agree: a plan is made with it, refused without."""
    from tests.families import config as fam_config
    from tests.families_fam import config as fam2
    from tests.families_moe import config as moe_config
    for make in (fam_config, fam2, moe_config):
        try:
            c = make(model_type)
            break
        except Exception:  # noqa: BLE001 (each helper knows its own families)
            continue
    else:
        pytest.skip(f"no test config for {model_type}")
    if RECORDS[model_type].sequence_parallel:
        assert why_not("sequence_parallel", c) is None
        make_plan(c, 2, sequence_parallel=True)
    else:
        assert why_not("sequence_parallel", c) is not None
        with pytest.raises(ValueError, match="sequence_parallel"):
            make_plan(c, 2, sequence_parallel=True)


def test_sliding_window_follows_transformers_layer_types():
    assert sliding_window(cfg("mistral", sliding_window=16)) == 16
    assert sliding_window(cfg("mistral", sliding_window=None)) is None
    # Qwen2 windows only the layers from max_window_layers on; none of them when max_window_layers >= layers
    assert sliding_window(cfg("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1)) == 16
    assert sliding_window(cfg("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=2)) is None
    assert sliding_window(cfg("qwen2", use_sliding_window=False, sliding_window=16)) is None


QWEN2_WINDOWED = dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)


def test_quantize_is_refused_in_the_parent_for_what_the_ranks_refuse():
    """Windowed configs run the lean path (tensorpar/decode/block.py narrows the mask), so the parent accepts them
    (old code: refused, "sliding_window=16 (the fast decode path implements no attention window)"); a family
    without a fast path is still refused before any rank starts."""
    from tensorpar.decode.quantize import check_quantize
    blocks = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=32)
    for c in (cfg("mistral", sliding_window=16, **blocks), cfg("qwen2", **QWEN2_WINDOWED, **blocks),
              cfg("mistral", sliding_window=None, **blocks)):    # int8's blocks of 32 whole on every rank
        check_quantize("int8", c, make_plan(c, 2))
    c = AutoConfig.for_model("gpt2", n_embd=32, n_head=4, n_layer=2)
    with pytest.raises(ValueError, match=r"--quantize int8 .*'gpt2'.*use --quantize none"):
        check_quantize("int8", c, make_plan(c, 2))


@pytest.mark.parametrize("mt", ["phi3", "starcoder2", "gpt_neox", "mixtral", "qwen2_moe", "gemma"])
def test_quantize_int8_refused_in_the_parent_and_on_the_ranks_for_layouts_it_cannot_read(mt):
    """The fast path now runs these families, but quantize_int8 reads separate q/k/v and gate/up projections: the
    fused (phi3), plain-MLP (starcoder2, gpt_neox) and expert layouts crashed inside every rank with a TypeError or
    AttributeError (merge of the every-family fast path). Now one line before any rank starts, and the ranks apply
    the same rule (why_not("int8")); gemma is left out until its int8 output is verified."""
    from tensorpar.decode.quantize import check_quantize
    from tensorpar.hf.families import why_not
    c = cfg(mt, pad_token_id=0)
    with pytest.raises(ValueError, match=rf"--quantize int8 supports llama, .*not '{mt}'; use --quantize none"):
        check_quantize("int8", c, make_plan(c, 2))
    assert why_not("int8", c) is not None
    for ok in ("llama", "qwen3", "olmo2"):
        assert why_not("int8", cfg(ok)) is None


def test_pipeline_refuses_every_windowed_family_not_only_mistral():
    """Old code checked mistral alone: a Qwen2 config with windowed layers was cut into stages that applied the
    full causal mask to its sliding-window layers (a silently different model)."""
    from tensorpar.pipeline.stages import check_pipeline
    with pytest.raises(ValueError, match=r"--pp 2: this qwen2 config has sliding_window=16.*use --pp 1"):
        check_pipeline(cfg("qwen2", **QWEN2_WINDOWED), 2, 1, 2, "1f1b")
    with pytest.raises(ValueError, match=r"--pp 2: pipeline parallelism supports llama, mistral, qwen2, qwen3, not 'gpt2'"):
        check_pipeline(AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=4, vocab_size=64), 2, 1, 2, "1f1b")
    check_pipeline(cfg("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=2), 2, 1, 2, "1f1b")


CONFIGS = [("llama", {}), ("mistral", {"sliding_window": None}), ("mistral", {"sliding_window": 16}),
           ("qwen2", {}), ("qwen2", QWEN2_WINDOWED), ("qwen3", {"head_dim": 8}), ("gemma2", {"head_dim": 8}),
           ("gemma3_text", {"head_dim": 8}), ("phi3", {"pad_token_id": 0}), ("olmo2", {}), ("starcoder2", {}),
           ("gpt_neox", {"num_key_value_heads": None}), ("mixtral", {"num_local_experts": 4})]


@pytest.mark.parametrize("model_type,kw", CONFIGS, ids=[f"{m}-{i}" for i, (m, _) in enumerate(CONFIGS)])
def test_the_ranks_fast_path_rule_is_the_parents(model_type, kw):
    """lean_unsupported (what a rank asks of its sharded model) says yes exactly when why_not (what the parent
    asks of the config) does."""
    from tensorpar.decode.prepare import lean_unsupported
    c = cfg(model_type, **kw)
    torch.manual_seed(0)
    model = parallelize(AutoModelForCausalLM.from_config(c), make_plan(c, 1), Group.single())
    assert (lean_unsupported(model) is None) == (why_not("fast_decode", c) is None)


def test_expert_parallel_query():
    assert "no mixture-of-experts" in why_not("expert_parallel", cfg("llama"))
    assert why_not("expert_parallel", cfg("mixtral", num_local_experts=4)) is None
    with pytest.raises(ValueError, match="unknown feature"):
        why_not("lora", cfg("llama"))


def test_train_pp_on_a_windowed_folder_is_refused_before_tokenizing(tmp_path, monkeypatch, capsys):
    """Old code tokenized the whole corpus (a progress bar of work items) before the pipeline check refused the
    config; now a model folder is checked first, with why_not's rule."""
    import argparse

    import tensorpar.train.data as train_data
    from tensorpar.train.cli import add_arguments, main
    c = cfg("qwen2", **QWEN2_WINDOWED)
    AutoModelForCausalLM.from_config(c).save_pretrained(tmp_path / "m")
    capsys.readouterr()   # transformers' "Writing model shards" bar

    def no_tokenizing(*a, **k):
        raise AssertionError("the corpus was tokenized before the refusal")
    monkeypatch.setattr(train_data, "load_data", no_tokenizing)
    p = argparse.ArgumentParser()
    add_arguments(p)
    rc = main(p.parse_args(["--model", str(tmp_path / "m"), "--tp", "1", "--pp", "2", "--data", "shakespeare",
                            "--tokenizer", "bytes", "--out", str(tmp_path / "run"), "--no-progress"]))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--pp 2: this qwen2 config has sliding_window=16" in err[0], err
