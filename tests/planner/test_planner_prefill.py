"""Time to first token (issue 23.5): the prefill model with measured constants (tensorpar.planner.prefill), the
fit of those constants (tensorpar.planner.calibrate.prefill.fit_prefill) and their scaling into a rank's device.
Numbers worked by hand on a made-up device; no process group."""
from dataclasses import replace

import pytest

from tensorpar.planner.calibrate.prefill import fit_prefill
from tensorpar.planner.cluster import ClusterSpec, DeviceSpec
from tensorpar.planner.inference import InferenceWorkload, plan_one
from tensorpar.planner.model_spec import ModelSpec

DEVICE = DeviceSpec("test", memory_gib=1.0, peak_tflops=1.0, intra_node_gbps=10.0, inter_node_gbps=1.0,
                    intra_node_latency_us=10.0, matmul_efficiency=0.5, hbm_gbps=100.0, layer_overhead_us=50.0)
# 2 layers, h 64, 8 heads of 8 (2 KV heads), SwiGLU MLP 128, vocabulary 1000
TINY = ModelSpec("tiny", num_layers=2, hidden_size=64, num_heads=8, num_kv_heads=2, ffn_hidden_size=128,
                 vocab_size=1000, max_positions=256)
MEASURED = replace(DEVICE, prefill_read_gbps=10.0, prefill_tflops=0.1, prefill_attention_tflops=0.05,
                   prefill_layer_overhead_us=200.0)


def test_first_token_with_measured_prefill_constants_by_hand():
    """tp = 2, one prompt of 100 tokens, fp32. The old model ignored the measured prefill constants: max(FLOPs at
    0.5 x peak, one read of the weights at hbm_gbps) + layers x the decode floor = 1.9e-5 + 2 x 50e-6 s before the
    collectives, against 5.5e-4 s here."""
    q = plan_one(TINY, 2, ClusterSpec(MEASURED, 2, 2), InferenceWorkload(1, 100, 10, weight_bytes=4, kv_bytes=4))
    # the busiest rank's layer matrices: QKV (4 + 2) x 8 = 48 x 64, output 64 x 32, gate-up 128 x 64, down 64 x 64
    layer_params = 48 * 64 + 64 * 32 + 128 * 64 + 64 * 64                      # 17408
    matmul_layer = layer_params * 4 / 10e9 + 2 * 100 * layer_params / 0.1e12  # read once + 100 rows of FLOPs
    head = 500 * 64 * 4 / 10e9 + 2 * 1 * 500 * 64 / 0.1e12                    # the vocabulary shard, the last row
    attention = 2 * (4 * 100 * 100 * 4 * 8) / 0.05e12                         # QK^T and PV of 4 heads, 2 layers
    overhead = 2 * 200e-6
    # 5 all-reduces of 100 x 64 fp32 over 2 ranks (10 us + 25600 B / 10 GB/s), the token pick (2 x 5 us + 32 B)
    comm = 5 * (10e-6 + 100 * 64 * 4 / 10e9) + 2 * 5e-6 + 32 / 10e9
    assert q.ttft_parts["matmul"] == pytest.approx(2 * matmul_layer + head, rel=1e-12)
    assert q.ttft_parts["attention"] == pytest.approx(attention, rel=1e-12)
    assert q.ttft_parts["overhead"] == pytest.approx(overhead, rel=1e-12)
    assert q.ttft_parts["tp_comm"] == pytest.approx(comm, rel=1e-12)
    assert q.ttft == pytest.approx(2 * matmul_layer + head + attention + overhead + comm, rel=1e-12)
    assert q.to_json()["ttft_breakdown_ms"]["attention"] == pytest.approx(attention * 1e3, abs=1e-4)
    # the decode prediction does not read the prefill constants
    assert q.decode == plan_one(TINY, 2, ClusterSpec(DEVICE, 2, 2),
                                InferenceWorkload(1, 100, 10, weight_bytes=4, kv_bytes=4)).decode


def test_first_token_without_prefill_constants_keeps_the_lower_bound():
    """A preset (no prefill constants): max(FLOPs / (0.5 x 1 TFLOP/s), weights / 100 GB/s) + the collectives +
    layers x layer_overhead_us, as before; at tp = 1 no collective."""
    q = plan_one(TINY, 1, ClusterSpec(DEVICE, 1, 1), InferenceWorkload(1, 100, 10, weight_bytes=2, kv_bytes=2))
    layer = 2 * 100 * (64 * 8 * 12 + 8 * 8 * 64 + 3 * 64 * 128) + 4 * 100 * 100 * 8 * 8
    flops = 2 * layer + 2 * 64 * 1000
    weights = (2 * (64 * 8 * 12 + 8 * 8 * 64 + 3 * 64 * 128 + 2 * 64) + 2 * 1000 * 64 + 64) * 2
    assert q.ttft == pytest.approx(max(flops / 0.5e12, weights / 100e9) + 2 * 50e-6, rel=1e-12)


def test_fit_prefill_recovers_the_rates_by_hand():
    """A layer of 1e6 fp32 weights (4 MB) at 10 GB/s and 2e6 FLOPs per token at 0.1 TFLOP/s: 16 rows take
    4e-4 + 16 x 2e-5 s, 256 rows 4e-4 + 256 x 2e-5 s; attention 1e9 FLOPs in 20 ms: 0.05 TFLOP/s."""
    sample = {"tokens": [16, 256], "layer_s": [4e-4 + 16 * 2e-5, 4e-4 + 256 * 2e-5], "layer_bytes": 4e6,
              "layer_flops_per_token": 2e6, "attention_s": 0.02, "attention_flops": 1e9}
    got = fit_prefill(sample)
    assert got == pytest.approx({"prefill_read_gbps": 10.0, "prefill_tflops": 0.1, "prefill_attention_tflops": 0.05},
                                rel=1e-9)
    # no fixed part left (noise where the FLOPs dominate): the read is not priced rather than negative
    assert fit_prefill(dict(sample, layer_s=[16 * 2e-5, 256 * 2e-5]))["prefill_read_gbps"] == 0.0
    with pytest.raises(RuntimeError, match="no rate to fit"):
        fit_prefill(dict(sample, layer_s=[1e-3, 1e-3]))


def test_fit_prefill_never_gives_a_rate_its_device_file_could_not_be_read_back_with(tmp_path):
    """Noise can leave a fixed part of a few nanoseconds (a read rate of millions of GB/s) or a slope of almost 0 (a
    FLOP rate of millions of TFLOP/s); ``plan --calibrate --json`` would write a file that ``--device-file`` then
    refuses as implausible. The read is left unpriced (0) and the FLOP rates refused in the fit instead."""
    from tensorpar.planner.cluster import device_from_dict
    from tensorpar.planner.plausible import PLAUSIBLE_DEVICE
    sample = {"tokens": [16, 256], "layer_s": [4e-4 + 16 * 2e-5, 4e-4 + 256 * 2e-5], "layer_bytes": 4e6,
              "layer_flops_per_token": 2e6, "attention_s": 0.02, "attention_flops": 1e9}
    tiny_fixed = dict(sample, layer_s=[16 * 2e-5 + 1e-14, 256 * 2e-5 + 1e-14])
    got = fit_prefill(tiny_fixed)
    assert got["prefill_read_gbps"] == 0.0 and got["prefill_tflops"] == pytest.approx(0.1)
    for k, v in got.items():
        lo, hi = PLAUSIBLE_DEVICE[k][1:3]
        assert v == 0.0 or lo <= v <= hi
    device_from_dict({"name": "cpu", "memory_gib": 24, "peak_tflops": 0.1, "intra_node_gbps": 10,
                     "inter_node_gbps": 1, **got}, "calibrated.json")
    with pytest.raises(RuntimeError, match="no rate to fit for the matmuls"):
        fit_prefill(dict(sample, layer_s=[1e-3, 1e-3 + 1e-15]))
    with pytest.raises(RuntimeError, match="no rate to fit for the attention"):
        fit_prefill(dict(sample, attention_s=1e-12))


def test_decode_device_gives_a_rank_its_threads_times_the_prefill_rates(tmp_path, monkeypatch):
    """The prefill rates are one thread's CPU-time rates: a rank of 2 threads gets twice them; the per-layer
    overhead (Python) is taken as measured."""
    from transformers import LlamaConfig

    from tensorpar.decode.floor import floor_job
    from tensorpar.planner.calibrate import decode_device as dd
    from tensorpar.planner.model_spec import from_hf_config

    data = {"decode_read_gbps": 8.0, "decode_read_host_gbps": 10.0, "decode_collective_us": 50.0,
            "layer_overhead_us": 300.0, "prefill_read_gbps": 6.0, "prefill_tflops": 0.08,
            "prefill_attention_tflops": 0.02, "prefill_layer_overhead_us": 700.0, "int8_reduce_cpu_us": 110.0,
            "loadavg_1min": 1.0}
    monkeypatch.setattr(dd, "measure_decode_constants", lambda *a, **k: dict(data))
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16).to_dict()
    cpu = DeviceSpec("cpu", 16.0, 0.05, 0.0, 0.0, matmul_efficiency=1.0, hbm_gbps=10.0, local_link_gbps=1.0,
                     host_cores=2.0, threads_per_rank=2)
    device, _ = dd.decode_device(cpu, from_hf_config(cfg, name="t"), cfg, 1, "shm", floor_job, tmp_path)
    assert (device.prefill_read_gbps, device.prefill_tflops, device.prefill_attention_tflops) == (12.0, 0.16, 0.04)
    assert device.prefill_layer_overhead_us == 700.0 and device.decode_read_gbps == 8.0
    assert device.int8_reduce_cpu_us == 110.0


def test_plan_auto_plans_with_the_threads_the_ranks_run(monkeypatch):
    """TENSORPAR_THREADS sets a rank's threads (tensorpar.parallel.set_rank_threads); --plan auto's device follows it:
    a calibrated rank of 2 threads (peak 0.2 TFLOP/s, copy 40 GB/s: one thread's x 2) planned for 1 thread has half
    of both and threads_per_rank 1, so the prefill rates (x threads_per_rank) are one thread's. Before, the planner
    assumed cores // ranks threads whatever the ranks ran."""
    from tensorpar.inference_plan import rank_threads

    cpu = DeviceSpec("cpu", 16.0, 0.2, 0.0, 0.0, matmul_efficiency=1.0, hbm_gbps=40.0, local_link_gbps=1.0,
                     host_cores=2.0, threads_per_rank=2)
    monkeypatch.delenv("TENSORPAR_THREADS", raising=False)
    assert rank_threads(cpu) is cpu
    monkeypatch.setenv("TENSORPAR_THREADS", "1")
    one = rank_threads(cpu)
    assert (one.threads_per_rank, one.peak_tflops, one.hbm_gbps) == (1, 0.1, 20.0)
    gpu = replace(cpu, host_cores=0.0)
    assert rank_threads(gpu) is gpu


def test_comparison_line_shows_the_first_tokens_cpu_time():
    """generate's last line: the first token's prediction against the wall clock and against rank 0's CPU time."""
    from tensorpar.inference_plan import comparison_line

    line = comparison_line({"layout": "tp=1", "decode_ms": 30.0, "ttft_ms": 120.0}, 0.2, 0.31, 32, 0.15)
    assert line == ("tensorpar: plan vs measured (tp=1): decode per token 30.00 ms predicted, 10.00 measured (+200% "
                    "off); first token 120.00 ms predicted, 200.00 measured (-40% off) (CPU 150.00 ms, -20%)")


def test_int8_all_reduce_cpu_time_is_measured_and_priced():
    """``--tp-comm int8``'s own CPU work per all-reduce (quantize, dequantize 2 ranks' partials, sum) is measured
    (one thread, [1, h]: tens to hundreds of microseconds on a CPU) and added to each compressed all-reduce: on the
    link test's 2 hosts at 100 us, 5 all-reduces of 72 B at 50 us + 72 B / 1.25e8 B/s + 115 us, the pick at 2 x
    50 us. Between the namespace hosts ~115 us x 61 per token was the int8 rows' remaining -9 % / -4 %."""
    from tensorpar.planner.calibrate.decode import measure_int8_reduce

    assert measure_int8_reduce(None, 64, calls=20)["int8_reduce_cpu_us"] > 0
    host = DeviceSpec("host", 1.0, 1.0, 0.0, 0.125, inter_node_latency_us=100.0, hbm_gbps=100.0,
                      local_link_gbps=2.0, local_link_latency_us=5.0, int8_reduce_cpu_us=115.0)
    work = InferenceWorkload(1, 8, 8, weight_bytes=4, kv_bytes=4, reserve_gib=0, tp_comm="int8")
    q = plan_one(TINY, 2, ClusterSpec(host, 2, 1), work)
    assert q.decode_comm == pytest.approx(5 * (50e-6 + 72 / 1.25e8 + 115e-6) + 2 * 50e-6 + 32 / 1.25e8, rel=1e-9)
