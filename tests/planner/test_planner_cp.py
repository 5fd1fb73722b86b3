"""The planner with context parallelism (issue 25, item 5): its activation model against the measured bytes of
bench/bench_cp.py, its cp traffic against the ring's and Ulysses' own counts, and its choice of a layout with cp > 1
for a long sequence that does not fit without it. No process group."""
import json
from dataclasses import replace
from pathlib import Path

import pytest

from tensorpar.planner.cluster import ClusterSpec, device_preset
from tensorpar.planner.enumerate import search
from tensorpar.planner.layout import Assumptions, Layout, Workload, problems
from tensorpar.planner.memory import memory_per_device
from tensorpar.planner.model_spec import from_dims, preset
from tensorpar.planner.traffic import cp_collectives

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "cp.json"
FP32 = Assumptions(activation_bytes=4, param_bytes=4, grad_bytes=4, attention="sdpa")


def bench_model():
    from bench.bench_cp import MODEL
    return from_dims(layers=MODEL["num_hidden_layers"], hidden=MODEL["hidden_size"],
                     heads=MODEL["num_attention_heads"], kv_heads=MODEL["num_key_value_heads"],
                     ffn=MODEL["intermediate_size"], vocab=MODEL["vocab_size"], head_dim=MODEL["head_dim"],
                     tied_embeddings=MODEL["tie_word_embeddings"])


def predicted(cp, seq, mode="ring"):
    lay = Layout(1, 1, 1, 1, cp=cp, cp_mode=mode)
    return memory_per_device(bench_model(), lay, Workload(1, seq), FP32).activations


def test_activation_prediction_matches_the_benchmark():
    """Saved bytes per rank (autograd's saved tensors, measured by bench/bench_cp.py on tensorpar's trainer) at
    cp 1, 2 (ring and all2all) and 4, and at every length of its budget ladder, against the planner's activations.

    Tolerance 2 %: the model counts every tensor autograd keeps (it matched to the byte when it was written); the
    slack is for a transformers or torch release that saves one small tensor more. The issue's targets (cp 2
    <= 0.55 and cp 4 <= 0.3 of cp 1) are checked on the measured ratios and on the predicted ones."""
    res = json.loads(RESULTS.read_text())
    rows = res["rows"] + res["ladder"]
    assert {(r["cp"], r["mode"]) for r in res["rows"]} >= {(1, "ring"), (2, "ring"), (2, "all2all"), (4, "ring")}
    for r in rows:
        want = r["saved_mib"] * 2 ** 20
        got = predicted(r["cp"], r["seq"], r["mode"])
        assert got == pytest.approx(want, rel=0.02), f"cp={r['cp']} {r['mode']} seq {r['seq']}: planner {got} vs {want}"
    base = next(r for r in res["rows"] if r["cp"] == 1)
    for r in res["rows"]:
        target = {1: 1.0, 2: 0.55, 4: 0.3}[r["cp"]]
        assert r["saved_mib"] / base["saved_mib"] <= target and r["peak_mib"] / base["peak_mib"] <= target, r
        ratio = predicted(r["cp"], r["seq"], r["mode"]) / predicted(1, r["seq"])
        assert ratio == pytest.approx(r["saved_mib"] / base["saved_mib"], abs=0.01), r


def test_cp_terms_are_those_of_the_shorter_sequence():
    """At cp the layer, logits and rotary terms are those of s / cp positions, plus the ring's fp32 output copy
    (b s/cp h d x 4 bytes per layer); exact (the same sums)."""
    m = bench_model()
    seq, b = 4096, 1
    extra = 4 * b * (seq // 2) * m.head_dim * m.num_heads * m.num_layers
    assert predicted(2, seq) == predicted(1, seq // 2) + extra


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_cp_traffic_per_layer(cp):
    """Ring: per layer each rank sends (cp-1)/cp of the whole sequence's K and V in forward and again in backward,
    2 (cp-1)/cp in all (the issue's count), plus the K/V gradients (cp hops of a block: all of them); fp32.
    all2all: four all-to-alls in forward (q, k, v, output) and four in backward, each rank keeping 1/cp."""
    m = preset("llama3-8b")          # 32 query heads, 8 KV heads of 128
    b, s = 2, 8192
    lay = Layout(tp=1, pp=1, dp=1, micro_batch=b, cp=cp)
    kv_bytes = 2 * b * m.num_kv_heads * s * m.head_dim * 4                 # K and V of the whole sequence, fp32
    ring = cp_collectives(m, lay, Workload(b, s), FP32, layers=1)
    blocks = sum(c.wire_bytes for c in ring if "blocks" in c.site)
    assert blocks == pytest.approx(2 * (cp - 1) / cp * kv_bytes, rel=1e-12)
    assert sum(c.wire_bytes for c in ring if "gradients" in c.site) == pytest.approx(kv_bytes, rel=1e-12)
    a2a = cp_collectives(m, Layout(tp=1, pp=1, dp=1, micro_batch=b, cp=cp, cp_mode="all2all"), Workload(b, s),
                         FP32, layers=1)
    for what in ("forward", "backward"):
        assert sum(c.calls for c in a2a if what in c.site) == 4
    q_bytes = b * m.num_heads * s // cp * m.head_dim * 4
    assert sum(c.payload_bytes for c in a2a if "forward" in c.site) == pytest.approx(
        2 * q_bytes + 2 * q_bytes * m.num_kv_heads / m.num_heads, rel=1e-12)


def test_long_sequence_under_a_memory_cap_picks_cp():
    """The bench model on 4 devices with 0.5 GiB usable each, one sequence of 64k positions: one device alone
    needs 1.3 GiB of activations (more than twice what it has); the best plan splits the
    sequence (cp 4: 1/4 of the activations, its ring hidden behind attention) and is faster than the best plan
    without cp (tp 4 with sequence parallelism, whose all-gathers are exposed). At 512 positions on 8 H100s cp's
    traffic is not worth it: the best plan has cp = 1."""
    model = bench_model()
    cluster = ClusterSpec(replace(device_preset("a100-80gb"), memory_gib=4.5), 4, 4)
    fp32 = dict(activation_bytes=4, param_bytes=4, grad_bytes=4, attention="sdpa")
    long = search(model, cluster, Workload(1, 65536), Assumptions(context_parallel=(1, 2, 4), **fp32))
    best = long.ranked[0]
    assert best.layout.cp == 4, [p.layout.short() for p in long.ranked[:3]]
    alone = memory_per_device(model, Layout(1, 1, 1, 1), Workload(1, 65536), Assumptions(**fp32))
    assert alone.total > long.usable_bytes and alone.activations > 2 * long.usable_bytes
    without = search(model, cluster, Workload(1, 65536), Assumptions(**fp32))
    assert all(p.layout.cp == 1 for p in without.ranked + without.too_big)
    assert without.ranked[0].cost.step.total > best.cost.step.total
    short = search(preset("llama3-8b"), ClusterSpec(device_preset("h100-80gb"), 8, 8), Workload(64, 512),
                   Assumptions(context_parallel=(1, 2, 4, 8)))
    assert short.ranked[0].layout.cp == 1, short.ranked[0].layout.short()


def test_cp_rules():
    model, work = bench_model(), Workload(1, 100)
    cluster = ClusterSpec(device_preset("a100-80gb"), 4, 4)
    rules = {p.rule for p in problems(Layout(1, 1, 1, 1, cp=4), model, cluster, work, FP32)}
    assert "seq%cp" in rules                                   # 100 is not a multiple of 2 x 4
    lay = Layout(4, 1, 1, 1, cp=1)
    assert lay.num_devices == 4 and Layout(2, 1, 1, 1, cp=2).num_devices == 4
    bad = problems(Layout(2, 1, 1, 1, cp=2, cp_mode="all2all"), from_dims(layers=2, hidden=96, heads=6,
                                                                            vocab=256), cluster, Workload(1, 64),
                   FP32)
    assert [p.message for p in bad if p.rule == "all2all"] == [
        "cp_mode=all2all needs the query heads of each tp rank (3 at tp=2) divisible by cp (2); use cp_mode=ring"]


def test_evaluate_ranks_a_cp_layout_among_its_own(capsys):
    """`tensorpar plan --evaluate ...cp=4...` without `--cp 4`: the layout is ranked among the cp layouts too (it
    was reported as not fitting, "needs 0.2 GiB > 76.0 GiB usable", since the search had left cp 4 out)."""
    from tensorpar.cli import main
    rc = main(["plan", "--layers", "2", "--hidden", "128", "--heads", "4", "--kv-heads", "2", "--ffn", "256",
               "--vocab", "256", "--gpus", "4", "--gpus-per-node", "4", "--global-batch", "1", "--seq", "65536",
               "--evaluate", "tp=1,pp=1,cp=4,cp_mode=all2all"])
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 0 and "cp=4 all2all: rank 2 of" in out and "usable." not in out, out


def test_cp_values_that_cannot_divide_the_devices_are_one_line(capsys):
    """Review: `plan --gpus 8 --cp 3` printed an empty table ("No valid layout: nothing.") without saying why, and
    `--cp 0` showed a Python tuple."""
    from tensorpar.cli import main
    base = ["plan", "--model", "smollm2", "--global-batch", "8", "--seq", "4096", "--gpus", "8"]
    assert main([*base, "--cp", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("tensorpar plan: error: --cp 3: no listed cp divides --gpus 8 (the devices are tp x cp x pp x "
                   "dp); use cp values among 1,2,4,8"), err
    assert main([*base, "--cp", "0"]) == 2
    assert capsys.readouterr().err.strip() == "tensorpar plan: error: --cp 0 must list integers >= 1, e.g. 1,2,4"
