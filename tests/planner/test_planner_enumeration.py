"""Validity and completeness of the layout enumeration, deterministic ranking, and the validation
messages. No process group, no torch."""
import itertools
import json

import pytest

from tensorpar.planner.cluster import ClusterSpec, device_preset
from tensorpar.planner.enumerate import divisors, search
from tensorpar.planner.layout import Assumptions, Layout, Workload, parse_layout, problems
from tensorpar.planner.model_spec import from_hf_config, preset
from tensorpar.planner.report import plans_json

SMOL = preset("smollm2")  # 9 query heads, 3 KV heads: uneven splits
CLUSTER = ClusterSpec(device_preset("a100-80gb"), num_devices=16, devices_per_node=8)
WORK = Workload(global_batch=32, seq_len=2048)


def test_every_ranked_plan_is_valid_and_fits():
    assume = Assumptions(attention="sdpa")
    found = search(SMOL, CLUSTER, WORK, assume)
    assert found.ranked
    for plan in found.ranked:
        lay = plan.layout
        assert lay.tp * lay.pp * lay.dp == 16
        assert lay.tp <= SMOL.num_heads and 8 % lay.tp == 0
        assert WORK.global_batch % (lay.dp * lay.micro_batch) == 0
        assert lay.pp <= SMOL.num_layers
        assert not (lay.sequence_parallel and lay.tp == 1)
        assert not (lay.distributed_optimizer and lay.dp == 1)
        assert lay.recompute != "selective"  # a no-op with sdpa attention
        assert plan.fits and plan.memory.total <= plan.usable_bytes
        assert problems(lay, SMOL, CLUSTER, WORK, assume) == []
    for plan in found.too_big:
        assert not plan.fits


def test_enumeration_is_complete():
    """Brute force over the knobs, written independently of the planner's loops."""
    assume = Assumptions(attention="eager", virtual_stages=(1, 2))
    found = search(SMOL, CLUSTER, WORK, assume)
    seen = {p.layout for p in (*found.ranked, *found.too_big)}
    expected = set()
    for tp, pp in itertools.product(divisors(16), divisors(16)):
        if 16 % (tp * pp):
            continue
        dp = 16 // (tp * pp)
        for mb, sp, rc, do, v in itertools.product(range(1, 9), (False, True), ("none", "selective", "full"),
                                                    (False, True), (1, 2)):
            ok = (tp <= 9 and 8 % tp == 0 and 1536 % tp == 0 and pp * v <= 30 and 32 % (dp * mb) == 0
                  and not (sp and tp == 1) and not (do and dp == 1) and not (v > 1 and pp == 1)
                  and not (v > 1 and (32 // (dp * mb)) % pp))
            if ok:
                expected.add(Layout(tp, pp, dp, mb, sp, rc, do, v))
    assert seen == expected


def test_ranking_is_deterministic_and_sorted():
    model, hw = preset("llama3-8b"), ClusterSpec(device_preset("h100-80gb"), 64, 8)
    work, assume = Workload(256, 8192), Assumptions(attention="sdpa")
    first = search(model, hw, work, assume)
    second = search(model, hw, work, assume)
    assert [p.layout for p in first.ranked] == [p.layout for p in second.ranked]
    keys = [p.sort_key() for p in first.ranked]
    assert keys == sorted(keys)
    assert plans_json(first.ranked[:5]) == plans_json(second.ranked[:5])


def test_json_schema():
    found = search(SMOL, CLUSTER, WORK, Assumptions(attention="sdpa"))
    plans = json.loads(plans_json(found.ranked[:3]))
    assert [p["rank"] for p in plans] == [1, 2, 3]
    for p in plans:
        for key in ("tp", "pp", "dp", "micro_batch", "sequence_parallel", "recompute", "distributed_optimizer",
                    "memory_gb", "step_time_s", "tflops_per_device", "mfu"):
            assert key in p
        mem = p["memory_gb"]
        assert set(mem) == {"weights", "gradients", "optimizer", "activations", "total"}
        assert mem["total"] == pytest.approx(mem["weights"] + mem["gradients"] + mem["optimizer"]
                                             + mem["activations"], abs=0.01)
        assert p["mfu"] == pytest.approx(p["tflops_per_device"] / 312.0, rel=1e-3)


def test_tp_within_node_by_default_and_on_request():
    model = preset("llama3-70b")  # 64 heads
    hw = ClusterSpec(device_preset("h100-80gb"), 64, 8)
    work = Workload(64, 4096)
    lay = Layout(tp=16, pp=1, dp=4, micro_batch=1)
    found = problems(lay, model, hw, work, Assumptions())
    assert [p.rule for p in found] == ["tp-node"]
    assert "tp (16) must divide --gpus-per-node (8)" in found[0].message
    assert problems(lay, model, hw, work, Assumptions(allow_cross_node_tp=True)) == []


def test_problem_messages_name_setting_value_and_fix():
    lay = Layout(tp=4, pp=64, dp=1, micro_batch=3)
    messages = " | ".join(p.message for p in problems(lay, SMOL, CLUSTER, WORK, Assumptions()))
    assert "tp x pp x dp = 4 x 64 x 1 = 256 must equal --gpus (16)" in messages
    assert "pp x virtual_stages (64 x 1) exceeds the 30 layers" in messages
    assert "dp x micro_batch (1 x 3) must divide --global-batch (32)" in messages
    assert [p.rule for p in problems(Layout(1, 1, 16, 1, sequence_parallel=True), SMOL, CLUSTER, WORK,
                                     Assumptions())] == ["no-op"]


def test_parse_layout():
    lay = parse_layout("tp=8,pp=4,dp=32,micro_batch=2,sequence_parallel=on,recompute=selective", 1024)
    assert lay == Layout(8, 4, 32, 2, True, "selective", False, 1)
    assert parse_layout("tp=2, pp=2", 16) == Layout(2, 2, 4, 1)
    with pytest.raises(ValueError, match="'mb=2' is not key=value with key one of"):
        parse_layout("tp=2,pp=1,mb=2", 16)
    with pytest.raises(ValueError, match="needs pp=N"):
        parse_layout("tp=2", 16)
    with pytest.raises(ValueError, match=r"sequence_parallel \('maybe'\) must be on/off"):
        parse_layout("tp=2,pp=1,sequence_parallel=maybe", 16)


def test_hf_config_reading(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
           "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True,
           "hidden_act": "silu", "head_dim": 64}
    path = tmp_path / "smol" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    spec = from_hf_config(path)
    assert spec.name == "smol"
    assert spec.total_params() == preset("smollm2-135m").total_params()
    gpt2 = from_hf_config({"n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024,
                           "resid_pdrop": 0.1}, name="gpt2")
    assert gpt2.total_params() == pytest.approx(124.44e6, rel=1e-3)  # GPT-2 small, 124M
    with pytest.raises(ValueError, match="lacks num_hidden_layers, num_attention_heads, intermediate_size, vocab_size"):
        from_hf_config({"hidden_size": 8})
