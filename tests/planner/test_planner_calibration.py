"""The planner's predictions against real training steps of a Hugging Face Llama sharded by tensorpar
on gloo ranks (CPU): activation memory within 15% of the measured peak, and tensor-parallel traffic
equal to the core's collective counter."""
import pytest
import torch

from tensorpar import comm
from tensorpar.grads import grad_norm, sync_duplicated_grads, sync_sequence_parallel_grads
from tensorpar.hf.apply import parallelize
from tensorpar.hf.plan import make_plan
from tensorpar.layers import vocab_parallel_cross_entropy
from tensorpar.planner.calibrate import peak_memory_bytes
from tensorpar.planner.layout import Assumptions, Layout, Workload
from tensorpar.planner.memory import memory_per_device
from tensorpar.planner.model_spec import from_dims
from tensorpar.planner.traffic import tp_collectives, tp_step_collectives
from tests._ranks import run_tp

FP32 = Assumptions(activation_bytes=4, param_bytes=4, grad_bytes=4, attention="eager")


def build(ctx, shape, sequence_parallel):
    """The tensorpar-sharded model of ``shape`` on this rank, and the planner's spec of it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=shape["hidden"], intermediate_size=shape["ffn"], num_hidden_layers=shape["layers"],
                      num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                      head_dim=shape["hidden"] // shape["heads"], vocab_size=shape["vocab"],
                      tie_word_embeddings=shape.get("tied", False))
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = parallelize(LlamaForCausalLM(cfg).float(), make_plan(cfg, ctx.tp.size, sequence_parallel=sequence_parallel),
                        ctx.tp)
    return model


def batch(shape):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=gen)
    return ids, torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=gen)


def spec(shape):
    return from_dims(layers=shape["layers"], hidden=shape["hidden"], heads=shape["heads"], kv_heads=shape["kv_heads"],
                     ffn=shape["ffn"], vocab=shape["vocab"], tied_embeddings=shape.get("tied", False))


def job_peak(ctx, shape):
    torch.set_num_threads(1)
    model = build(ctx, shape, False)
    ids, targets = batch(shape)

    def step():
        logits = model(input_ids=ids).logits
        vocab_parallel_cross_entropy(logits, targets, ctx.tp, partition=model.tensorpar_plan.vocab).backward()

    return peak_memory_bytes(step, baseline=[*model.parameters(), ids, targets])[1]


def job_count(ctx, shape, sequence_parallel):
    model = build(ctx, shape, sequence_parallel)
    ids, targets = batch(shape)
    with comm.counting(ctx.tp) as counter:
        logits = model(input_ids=ids).logits
        vocab_parallel_cross_entropy(logits, targets, ctx.tp, partition=model.tensorpar_plan.vocab).backward()
        sync_sequence_parallel_grads(model.parameters(), ctx.tp)
        sync_duplicated_grads(model.parameters(), ctx.tp)
        grad_norm(model.parameters(), ctx.tp)
    return counter.summary()


PEAK_SHAPE = dict(hidden=256, heads=8, kv_heads=2, ffn=640, layers=4, vocab=512, batch=4, seq=256)


@pytest.mark.parametrize("tp", [1, 2])
def test_activation_memory_within_15_percent_of_measured_peak(pools, tp):
    peaks = run_tp(pools, tp, job_peak, PEAK_SHAPE)
    layout = Layout(tp=tp, pp=1, dp=1, micro_batch=PEAK_SHAPE["batch"])
    predicted = memory_per_device(spec(PEAK_SHAPE), layout, Workload(PEAK_SHAPE["batch"], PEAK_SHAPE["seq"]), FP32)
    assert max(peaks) == pytest.approx(predicted.activations, rel=0.15), (peaks, predicted.activation_terms)


def predicted_counts(shape, tp, sequence_parallel):
    layout = Layout(tp=tp, pp=1, dp=1, micro_batch=shape["batch"], sequence_parallel=sequence_parallel)
    model, work = spec(shape), Workload(shape["batch"], shape["seq"])
    collectives = (tp_collectives(model, layout, work, FP32, layers=shape["layers"], first_stage=True, last_stage=True)
                   + tp_step_collectives(model, layout, FP32, layers=shape["layers"], last_stage=True))
    out = {}
    for c in collectives:
        kind = out.setdefault(c.kind, {"calls": 0, "elements": 0, "bytes": 0, "wire_bytes": 0.0})
        kind["calls"] += c.calls
        kind["elements"] += c.calls * c.elements
        kind["bytes"] += c.payload_bytes
        kind["wire_bytes"] += c.wire_bytes
    return out


@pytest.mark.parametrize("tp,sequence_parallel,shape", [
    (2, False, dict(hidden=32, heads=8, kv_heads=2, ffn=48, layers=2, vocab=37, batch=2, seq=12)),
    (2, True, dict(hidden=32, heads=8, kv_heads=2, ffn=48, layers=2, vocab=37, batch=2, seq=12, tied=True)),
    # 9 query / 3 KV heads at tp=2: heads 5/4, KV head 1 on both ranks; vocab 41 split 21/20
    (2, False, dict(hidden=36, heads=9, kv_heads=3, ffn=40, layers=2, vocab=41, batch=2, seq=12)),
    # 6 query / 2 KV heads at tp=3: KV head 0 straddles ranks 0 and 1, with sequence parallelism
    (3, True, dict(hidden=24, heads=6, kv_heads=2, ffn=42, layers=3, vocab=37, batch=2, seq=12)),
], ids=["tp2", "tp2-sp-tied", "tp2-gqa-straddle", "tp3-sp-straddle"])
def test_tp_traffic_equals_counter(pools, tp, sequence_parallel, shape):
    counted = run_tp(pools, tp, job_count, shape, sequence_parallel)
    predicted = predicted_counts(shape, tp, sequence_parallel)
    for rank_counts in counted:
        assert sorted(rank_counts) == sorted(predicted)
        for kind, want in predicted.items():
            got = rank_counts[kind]
            counted_sizes = (got["calls"], got["elements"], got["bytes"])
            assert counted_sizes == (want["calls"], want["elements"], want["bytes"]), kind
            assert got["wire_bytes"] == pytest.approx(want["wire_bytes"], rel=1e-12), kind


def test_calibrate_collectives_and_device_file(tmp_path):
    """Two gloo processes on loopback time all-reduces; the fit feeds a device file the planner reads."""
    import json

    from tensorpar.planner.calibrate import measure_collectives, measure_matmul
    from tensorpar.planner.cluster import device_from_file

    coll = measure_collectives(sizes=(4096, 1 << 16, 1 << 20), backends=("gloo", "shm"))
    assert [s["bytes"] for s in coll["samples"]] == [4096, 1 << 16, 1 << 20]
    assert all(s["seconds"] > 0 for s in coll["samples"])
    assert coll["bandwidth_gbps"] > 0 and coll["latency_us"] >= 0
    assert coll["backend"] == "gloo" and sorted(coll["by_backend"]) == ["gloo", "shm"]
    shm = coll["by_backend"]["shm"]
    assert shm["backend"] == "shm" and all(s["seconds"] > 0 for s in shm["samples"]) and shm["bandwidth_gbps"] > 0
    with pytest.raises(ValueError, match="collective backends"):
        measure_collectives(backends=("nccl",))
    _, matmul = measure_matmul(sizes=(128,), min_seconds=0.01)
    device = {"name": "here", "memory_gib": 16, "peak_tflops": matmul[0]["tflops"],
              "intra_node_gbps": coll["bandwidth_gbps"], "inter_node_gbps": coll["bandwidth_gbps"],
              "intra_node_latency_us": coll["latency_us"], "inter_node_latency_us": coll["latency_us"]}
    path = tmp_path / "device.json"
    path.write_text(json.dumps({"device": device}))
    assert device_from_file(path).peak_tflops == matmul[0]["tflops"]


def test_memory_bandwidth_and_calibrated_device_fields(tmp_path):
    """--calibrate's device: measured copy bandwidth as hbm_gbps, the link as a labelled local link, the
    NVLink and inter-node fields left 0 (not measured), read back by --device-file."""
    import json

    from tensorpar.planner.calibrate import measure_memory_bandwidth
    from tensorpar.planner.cluster import ClusterSpec, device_from_file

    bandwidth = measure_memory_bandwidth(nbytes=1 << 22, min_seconds=0.01)
    assert bandwidth > 0
    from tensorpar.planner.calibrate import measure_optimizer
    assert 0 < measure_optimizer(1 << 16, min_seconds=0.01) < 1e6   # ns per parameter of torch's AdamW
    device = {"name": "calibrated cpu", "memory_gib": 16, "peak_tflops": 0.01, "intra_node_gbps": 0.0,
              "inter_node_gbps": 0.0, "matmul_efficiency": 1.0, "hbm_gbps": bandwidth, "local_link_gbps": 1.0,
              "local_link_latency_us": 100.0, "local_link_label": "this machine's local link: measured"}
    path = tmp_path / "device.json"
    path.write_text(json.dumps({"device": device}))
    spec = device_from_file(path)
    assert spec.hbm_gbps == bandwidth and spec.intra_node_gbps == 0.0
    assert ClusterSpec(spec, 2, 8).link(2) == pytest.approx((1e9, 100e-6))


@pytest.mark.slow  # CI time (2026-12-02: suite 20.5 min); a representative case stays in CI
def test_measure_pipeline_send_cpu_and_link():
    """Two gloo ranks: the ping-pong link fit and the CPU of a 1F1B schedule's send or receive are measured (> 0)
    and land in --calibrate's device fields."""
    from tensorpar.planner.calibrate import P2P_SIZES, measure_pipeline

    got = measure_pipeline(rounds=1)
    assert [s["bytes"] for s in got["p2p_samples"]] == list(P2P_SIZES)
    assert all(s["seconds"] > 0 for s in got["p2p_samples"])
    assert got["p2p_latency_us"] >= 0 and got["p2p_bandwidth_gbps"] >= 0
    assert got["pipeline_p2p_op_cpu_us"] > 0 and len(got["pipeline_cpu_slopes_us"]) == 2
    assert got["pipeline_p2p_op_cpu_shared_us"] > 0 and got["pipeline_shared_ranks"] >= 4
    assert len(got["pipeline_shared_cpu_slopes_us"]) == got["pipeline_shared_ranks"]
