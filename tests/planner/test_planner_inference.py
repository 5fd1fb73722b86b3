"""``tensorpar plan --inference`` (issue 15.3): memory per rank (weights, KV cache with GQA replication),
time to first token, per-token decode latency and the choice of tp under a latency target. Numbers worked
by hand on a made-up device; no process group, no torch."""
import json

import pytest

from tensorpar import cli
from tensorpar.planner.cluster import ClusterSpec, DeviceSpec
from tensorpar.planner.inference import (InferenceWorkload, decode_collectives, decode_matrices, decode_read_gbps,
                                         kv_cache_bytes, plan_inference, plan_one, weight_params_per_rank)
from tensorpar.planner.model_spec import ModelSpec, preset

DEVICE = DeviceSpec("test", memory_gib=1.0, peak_tflops=1.0, intra_node_gbps=10.0, inter_node_gbps=1.0,
                    intra_node_latency_us=10.0, matmul_efficiency=0.5, hbm_gbps=100.0)
TINY = ModelSpec("tiny", num_layers=2, hidden_size=64, num_heads=8, num_kv_heads=2, ffn_hidden_size=128,
                 vocab_size=1000, max_positions=256)


def test_kv_cache_replicates_kv_heads_when_tp_exceeds_them():
    # 2 KV heads of 8 dims: tp=1 holds both; tp=2 one each; tp=4 and 8 still one each (replicated).
    per_head = 2 * 2 * 3 * 100 * 8 * 2  # K and V, 2 layers, batch 3, 100 positions, head_dim 8, bf16
    assert [kv_cache_bytes(TINY, t, 3, 100) for t in (1, 2, 4, 8)] == [2 * per_head, per_head, per_head, per_head]
    # smollm2 (9 heads, 3 KV heads) at tp=2: rank 0 holds heads 0-4, which read KV heads 0 and 1.
    smol = preset("smollm2")
    assert kv_cache_bytes(smol, 2, 1, 10) == 2 * 30 * 1 * 10 * 2 * 64 * 2


def test_weights_per_rank():
    assert weight_params_per_rank(TINY, 1) == TINY.total_params()
    # tp=2: 4 q heads + 1 kv head of 8 dims, 64 MLP columns, 500 vocabulary rows (embedding and output).
    layer = 64 * 8 * (4 + 2) + 4 * 8 * 64 + 3 * 64 * 64 + 2 * 64
    assert weight_params_per_rank(TINY, 2) == 2 * layer + 2 * 500 * 64 + 64


def test_hand_worked_latencies():
    cluster = ClusterSpec(DEVICE, num_devices=2, devices_per_node=2)
    work = InferenceWorkload(batch=1, prompt_len=100, max_new_tokens=100)
    q = plan_one(TINY, 2, cluster, work)
    weights = weight_params_per_rank(TINY, 2) * 2
    kv_mean = kv_cache_bytes(TINY, 2, 1, 150)
    assert q.decode_memory == pytest.approx((weights + kv_mean) / 100e9, rel=1e-12)
    # decode all-reduces: 2 per layer and the embedding's, of 64 bf16 values over 2 ranks, latency 10 us +
    # 128 B / 10 GB/s; greedy token pick: all-gather of one [1, 2] fp64 row from the other rank (16 B) and a
    # broadcast of 2 int64 (16 B), 5 us each (half an all-reduce's latency: half its ring steps).
    pick = 2 * 5e-6 + (16 + 16) / 10e9
    comm = 5 * (10e-6 + 128 / 10e9) + pick
    assert q.decode_comm == pytest.approx(comm, rel=1e-12)
    assert q.decode == pytest.approx(max(q.decode_memory, q.decode_compute) + comm, rel=1e-12)
    assert q.tokens_per_s == pytest.approx(1 / q.decode)
    # prefill FLOPs: per layer 2*100*(64*8*6 + 4*8*64 + 3*64*64) + 4*100*100*4*8, 2 layers, logits 2*64*500.
    flops = 2 * (2 * 100 * (64 * 8 * 6 + 4 * 8 * 64 + 3 * 64 * 64) + 4 * 100 * 100 * 4 * 8) + 2 * 64 * 500
    prefill_comm = 5 * (10e-6 + 100 * 64 * 2 / 10e9) + pick
    assert q.ttft == pytest.approx(max(flops / 0.5e12, weights / 100e9) + prefill_comm, rel=1e-12)
    # A measured per-layer overhead adds 2 layers x 300 us to both.
    from dataclasses import replace

    slow = plan_one(TINY, 2, ClusterSpec(replace(DEVICE, layer_overhead_us=300.0), 2, 2), work)
    assert slow.decode - q.decode == pytest.approx(600e-6) and slow.ttft - q.ttft == pytest.approx(600e-6)
    assert slow.decode_overhead == pytest.approx(600e-6) and q.decode_overhead == 0


def test_decode_matrices_are_the_lean_paths_per_rank_shapes():
    # smollm2 (h 576, 9 heads of 64, 3 KV heads, MLP 1536, vocabulary 49152): tp=1 reads fused QKV (9 + 6) x 64,
    # the output 576 x 576, fused gate-up 2 x 1536; tp=2's busiest rank holds 5 heads and KV heads 0 and 1.
    smol = preset("smollm2")
    assert decode_matrices(smol, 1) == ([(960, 576), (576, 576), (3072, 576), (576, 1536)], (49152, 576))
    assert decode_matrices(smol, 2) == ([(576, 576), (576, 320), (1536, 576), (576, 768)], (24576, 576))
    layer, head = decode_matrices(TINY, 2)
    # the matrices are the rank's weights less the norms and the (untied) input embedding
    assert sum(o * i for o, i in layer) * 2 + head[0] * head[1] == weight_params_per_rank(TINY, 2) - 4 * 64 - 64 - 500 * 64
    assert decode_collectives(smol, 1) == 0 and decode_collectives(smol, 2) == 2 * 30 + 3


def test_decode_read_rate_shared_by_the_hosts_ranks():
    # 20 GB/s alone, 30 GB/s for the host: 2 ranks get 15 each, 1 rank 20 (its own cap), 4 ranks 7.5;
    # without a host cap every rank reads at its own rate; without a measured rate, hbm_gbps.
    from dataclasses import replace

    cpu = replace(DEVICE, decode_read_gbps=20.0, decode_read_host_gbps=30.0)
    assert [decode_read_gbps(ClusterSpec(cpu, g, g)) for g in (1, 2, 4)] == [20.0, 15.0, 7.5]
    assert decode_read_gbps(ClusterSpec(cpu, 8, 2)) == 15.0  # 2 ranks to a node
    assert decode_read_gbps(ClusterSpec(replace(cpu, decode_read_host_gbps=0.0), 4, 4)) == 20.0
    assert decode_read_gbps(ClusterSpec(DEVICE, 4, 4)) == 100.0
    work = InferenceWorkload(batch=1, prompt_len=100, max_new_tokens=100)
    q = plan_one(TINY, 2, ClusterSpec(cpu, 2, 2), work)
    read = weight_params_per_rank(TINY, 2) * 2 + kv_cache_bytes(TINY, 2, 1, 150)
    assert q.decode_memory == pytest.approx(read / 15e9, rel=1e-12)


def test_measured_decode_collective_replaces_the_link_model():
    # 500 us per collective measured inside a decode step: 2 layers x 2 + 3 = 7 collectives at tp=2, none at tp=1.
    from dataclasses import replace

    dev = replace(DEVICE, decode_collective_us=500.0, layer_overhead_us=100.0)
    work = InferenceWorkload(batch=1, prompt_len=100, max_new_tokens=100)
    q = plan_one(TINY, 2, ClusterSpec(dev, 2, 2), work)
    assert q.decode_comm == pytest.approx(7 * 500e-6, rel=1e-12)
    assert q.decode == pytest.approx(max(q.decode_memory, q.decode_compute) + 7 * 500e-6 + 2 * 100e-6, rel=1e-12)
    assert plan_one(TINY, 1, ClusterSpec(dev, 1, 1), work).decode_comm == 0


def test_latency_target_picks_the_highest_throughput_that_meets_it():
    cluster = ClusterSpec(DEVICE, num_devices=8, devices_per_node=8)
    free = plan_inference(TINY, cluster, InferenceWorkload(4, 64, 64))
    assert free[0].tokens_per_s == max(q.tokens_per_s for q in free)
    slowest_ok = sorted(q.decode for q in free)[1] * 1e3  # a target that only the two fastest layouts meet
    picked = plan_inference(TINY, cluster, InferenceWorkload(4, 64, 64, latency_target_ms=slowest_ok))[0]
    assert picked.meets(slowest_ok)
    assert picked.tokens_per_s == max(q.tokens_per_s for q in free if q.decode * 1e3 <= slowest_ok)


def test_unreachable_latency_target_picks_the_fastest_that_fits(capsys):
    """With a target no tp meets, the plan is the fastest fitting tp (it used to be the highest throughput
    while the note named the fastest)."""
    cluster = ClusterSpec(DEVICE, num_devices=8, devices_per_node=8)
    free = plan_inference(TINY, cluster, InferenceWorkload(4, 64, 64, reserve_gib=0))
    fastest = min((q for q in free if q.fits), key=lambda q: q.decode)
    target = fastest.decode * 1e3 / 2
    picked = plan_inference(TINY, cluster, InferenceWorkload(4, 64, 64, latency_target_ms=target, reserve_gib=0))
    assert picked[0] == fastest
    decodes = [q.decode for q in picked if q.fits]
    assert decodes == sorted(decodes)
    args = ["plan", "--inference", "--model", "llama3-70b", "--gpus", "8", "--device", "h100-80gb",
            "--batch", "8", "--prompt-len", "2048", "--max-new-tokens", "512", "--latency-target-ms", "1"]
    assert cli.main([*args, "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    # Llama 3 70B: tp=2 has the highest throughput, tp=8 the lowest latency; the two rules disagree here
    assert max((p for p in plans if p["fits"]), key=lambda p: p["tokens_per_s"])["tp"] == 2 and plans[0]["tp"] == 8
    assert plans[0]["decode_ms_per_token"] == min(p["decode_ms_per_token"] for p in plans if p["fits"])
    assert cli.main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"No tp meets 1 ms per token; picked the fastest that fits, tp={plans[0]['tp']} at" in out
    r = plans[0]["replicas"]
    assert f"tp={plans[0]['tp']} x {r} replica{'s' if r != 1 else ''}" in out


def test_prompt_beyond_positions_is_refused():
    cluster = ClusterSpec(DEVICE, num_devices=2, devices_per_node=2)
    with pytest.raises(ValueError, match=r"--prompt-len \+ --max-new-tokens \(200 \+ 100\) = 300 is longer than the 256 "
                                         r"positions of tiny; use a total <= 256"):
        plan_inference(TINY, cluster, InferenceWorkload(1, 200, 100))


def test_cli(capsys):
    args = ["plan", "--inference", "--model", "llama3-70b", "--gpus", "8", "--device", "h100-80gb",
            "--batch", "8", "--prompt-len", "2048", "--max-new-tokens", "512"]
    assert cli.main([*args, "--latency-target-ms", "30"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "tokens/s" in out and "KV heads per rank" in out
    assert cli.main([*args, "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert {p["tp"] for p in plans} == {1, 2, 4, 8} and plans[0]["fits"]
    assert next(p for p in plans if p["tp"] == 1)["fits"] is False  # 141 GiB of weights on one H100
    # only layouts that fit are ranked (1, 2, 3 for tp 2..8); tp=1 is listed without a rank
    assert [p["rank"] for p in plans if p["fits"]] == [1, 2, 3]
    assert next(p for p in plans if p["tp"] == 1)["rank"] is None
    assert cli.main(args) == 0
    row = next(line.split() for line in capsys.readouterr().out.splitlines() if line.split()[1:2] == ["1"])
    assert row[0] == "-"
    assert cli.main(["plan", "--inference", "--model", "llama3-405b", "--gpus", "1", "--device", "h100-80gb",
                     "--batch", "1", "--prompt-len", "16", "--max-new-tokens", "16"]) == 3
    capsys.readouterr()
    assert cli.main(["plan", "--inference", "--model", "llama3-8b", "--gpus", "1"]) == 2
    assert "--inference needs --batch, --prompt-len, --max-new-tokens" in capsys.readouterr().err


def test_cli_top_limits_the_plans_shown(capsys):
    """``--top N`` shows the first N plans in the inference table and JSON, as in training (0: all)."""
    args = ["plan", "--inference", "--model", "llama3-70b", "--gpus", "16", "--gpus-per-node", "8",
            "--batch", "1", "--prompt-len", "128", "--max-new-tokens", "64", "--json"]
    assert cli.main([*args, "--top", "0"]) == 0
    every = json.loads(capsys.readouterr().out)
    assert len(every) > 3
    assert cli.main([*args, "--top", "3"]) == 0
    assert json.loads(capsys.readouterr().out) == every[:3]
    assert cli.main([*args[:-1], "--top", "2"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] in (["1"], ["2"], ["3"])]
    assert [r[0] for r in rows] == ["1", "2"]
    assert cli.main([*args, "--top", "-1"]) == 2
    assert "--top (-1) must be >= 0" in capsys.readouterr().err
