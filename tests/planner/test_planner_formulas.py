"""The planner's formulas against the papers they come from and against numbers worked by hand.
No process group, no torch."""
import pytest

from tensorpar.planner.cluster import ClusterSpec, DeviceSpec
from tensorpar.planner.cost import step_cost
from tensorpar.planner.flops import (layer_forward_flops, logit_forward_flops, model_flops, narayanan_eq3,
                                     recompute_forward_flops)
from tensorpar.planner.layout import Assumptions, Layout, Workload
from tensorpar.planner.memory import (in_flight, layer_activation_terms, memory_per_device, stage_params,
                                      output_activation_bytes, stage_memory)
from tensorpar.planner.model_spec import ModelSpec, preset
from tensorpar.planner.partition import RankHeads, head_partition, stage_layers
from tensorpar.planner.traffic import dp_collectives, layer_tp_wire_elements, tp_collectives

GPT3 = preset("gpt3-175b")
S, B = 2048, 1  # sequence length, micro-batch


def table2(tp, sp, recompute):
    """Bytes per layer of Korthikanti et al. 2022, Table 2, for GPT-3 at micro-batch 1."""
    heads = RankHeads(GPT3.num_heads // tp, GPT3.num_heads // tp)
    terms = layer_activation_terms(GPT3, heads, micro_batch=B, seq_len=S, tp=tp, sequence_parallel=sp,
                                   recompute=recompute, assume=Assumptions(attention="eager"))
    return sum(terms.values())


@pytest.mark.parametrize("t", [1, 2, 8])
def test_korthikanti_table2_rows(t):
    s, b, h, a = S, B, GPT3.hidden_size, GPT3.num_heads
    sbh = s * b * h
    assert table2(t, False, "none") == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-12)
    assert table2(t, False, "selective") == pytest.approx(sbh * (10 + 24 / t), rel=1e-12)
    assert table2(t, False, "full") == pytest.approx(2 * sbh, rel=1e-12)
    if t > 1:
        assert table2(t, True, "none") == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)), rel=1e-12)
        assert table2(t, True, "selective") == pytest.approx(sbh * 34 / t, rel=1e-12)
        assert table2(t, True, "full") == pytest.approx(2 * sbh / t, rel=1e-12)
    if t == 1:  # the no-parallelism row: 34 + 5as/h
        assert table2(1, False, "none") == pytest.approx(sbh * (34 + 5 * a * s / h), rel=1e-12)


def test_output_layer_terms_korthikanti_section_4_4():
    # With sequence parallelism: 4sbh/t (1 + V/h) on the last stage.
    t, s, b, h, v = 8, S, B, GPT3.hidden_size, GPT3.vocab_size
    terms = output_activation_bytes(GPT3, micro_batch=b, seq_len=s, tp=t, sequence_parallel=True,
                                    assume=Assumptions())
    assert sum(terms.values()) == pytest.approx(4 * s * b * h / t * (1 + v / h), rel=1e-12)


def test_first_stage_holds_all_layers_and_interleaving_factor():
    # 1F1B: stage 0 holds p micro-batches of L/p layers = L layers; interleaved: L (1 + (p-1)/(pv)).
    p, v, m = 8, 3, 64
    assert in_flight(0, p, 1, m) * (GPT3.num_layers / p) == GPT3.num_layers
    assert in_flight(0, p, v, m) * (GPT3.num_layers / p) == pytest.approx(
        GPT3.num_layers * (1 + (p - 1) / (p * v)), rel=1e-12)
    assert in_flight(p - 1, p, 1, m) == 1
    assert in_flight(0, p, 1, 3) == 3  # fewer micro-batches than stages


def test_first_stage_activation_total():
    lay = Layout(tp=8, pp=8, dp=16, micro_batch=B, sequence_parallel=True, recompute="selective")
    stage0 = stage_memory(GPT3, lay, Workload(1536, S), Assumptions())[0]
    sbh = S * B * GPT3.hidden_size
    # L layers of sbh 34/t, plus p embedding dropout masks of sbh/t (Korthikanti section 4.4: sbhp/t)
    assert stage0.activations == pytest.approx(GPT3.num_layers * sbh * 34 / 8 + 8 * sbh / 8, rel=1e-12)


def test_narayanan_eq3_is_full_recompute_flops():
    batch, s = 1536, S
    tokens = batch * s
    full = RankHeads(GPT3.num_heads, GPT3.num_kv_heads)
    layer = layer_forward_flops(GPT3, full, GPT3.ffn_hidden_size, tokens, s)
    per_layer = 3 * (layer["linear"] + layer["attention"]) + recompute_forward_flops(layer, "full", "eager")
    executed = GPT3.num_layers * per_layer + 3 * logit_forward_flops(GPT3, GPT3.vocab_size, tokens)
    eq3 = narayanan_eq3(batch, s, GPT3.num_layers, GPT3.hidden_size, GPT3.vocab_size)
    assert executed == pytest.approx(eq3, rel=1e-12)
    # Model FLOPs (for MFU) leave the recomputation out: 72 instead of 96 for the layers.
    assert model_flops(GPT3, tokens, s) == pytest.approx(
        72 * tokens * GPT3.num_layers * GPT3.hidden_size ** 2 * (1 + s / (6 * GPT3.hidden_size))
        + 6 * tokens * GPT3.vocab_size * GPT3.hidden_size, rel=1e-12)


@pytest.mark.parametrize("name,expected", [
    ("gpt3-175b", 174.6e9), ("llama3-8b", 8.03e9), ("llama3-70b", 70.55e9),
    ("llama3-405b", 405.85e9), ("smollm2-135m", 134.5e6), ("smollm2-1.7b", 1.711e9),
])
def test_preset_parameter_counts(name, expected):
    # Published sizes: GPT-3 "175B" (174.6B with the padded vocabulary), Llama 3 8.03B / 70.6B / 405.9B,
    # SmolLM2 134.5M / 1.71B.
    assert preset(name).total_params() == pytest.approx(expected, rel=2e-3)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_tp_traffic_per_layer_is_8bsh(t):
    lay = Layout(tp=t, pp=1, dp=1, micro_batch=2)
    work, assume = Workload(2, 1024), Assumptions()
    layer = [c for c in tp_collectives(GPT3, lay, work, assume, layers=1, first_stage=False, last_stage=False)]
    wire_elements = sum(c.wire_bytes for c in layer) / assume.activation_bytes
    assert wire_elements == pytest.approx(layer_tp_wire_elements(2, 1024, GPT3.hidden_size, t), rel=1e-12)
    assert {c.kind for c in layer} == {"all_reduce"} and sum(c.calls for c in layer) == 4
    # Sequence parallelism: the same bytes on the critical path, plus a hidden re-gather of 2 bsh (t-1)/t.
    sp = tp_collectives(GPT3, Layout(t, 1, 1, 2, sequence_parallel=True), work, assume,
                        layers=1, first_stage=False, last_stage=False)
    timed = sum(c.wire_bytes for c in sp if not c.hidden) / assume.activation_bytes
    hidden = sum(c.wire_bytes for c in sp if c.hidden) / assume.activation_bytes
    assert timed == pytest.approx(layer_tp_wire_elements(2, 1024, GPT3.hidden_size, t), rel=1e-12)
    assert hidden == pytest.approx(2 * 2 * 1024 * GPT3.hidden_size * (t - 1) / t, rel=1e-12)


def test_dp_traffic():
    params = 1_000_000
    assume = Assumptions()
    (ar,) = dp_collectives(params, Layout(1, 1, 8, 1), assume)
    assert ar.wire_bytes == pytest.approx(2 * 7 / 8 * params * assume.grad_bytes)
    rs, ag = dp_collectives(params, Layout(1, 1, 8, 1, distributed_optimizer=True), assume)
    assert rs.wire_bytes + ag.wire_bytes == pytest.approx(ar.wire_bytes)
    assert dp_collectives(params, Layout(1, 1, 1, 1), assume) == []


def test_head_partition_uneven_and_gqa():
    # group 1 straddles: duplicated, and local groups are unequal ([3, 2] and [1, 3])
    assert head_partition(9, 3, 2) == [RankHeads(5, 2, uniform=False), RankHeads(4, 2, uniform=False)]
    assert head_partition(32, 8, 16) == [RankHeads(2, 1)] * 16
    assert head_partition(8, 2, 8) == [RankHeads(1, 1)] * 8  # tp > kv heads: replicated
    assert [r.q for r in head_partition(9, 3, 4)] == [3, 2, 2, 2]
    with pytest.raises(ValueError, match=r"tp \(10\) exceeds the number of query heads \(9\)"):
        head_partition(9, 3, 10)


def test_stage_layers_uneven():
    sizes = stage_layers(126, 16)
    assert sum(sizes) == 126 and max(sizes) - min(sizes) == 1 and sizes[0] == min(sizes)
    assert stage_layers(96, 4, 2) == [24] * 4


# ---- one small layout worked by hand ---------------------------------------------------------------
TINY = ModelSpec(name="tiny-gpt", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=4, ffn_hidden_size=256,
                 vocab_size=1000, mlp="gelu", norm="layernorm", bias=True, dropout=True, tied_embeddings=True,
                 learned_positions=128, kernels="megatron")
TINY_LAYOUT = Layout(tp=2, pp=2, dp=2, micro_batch=1)
TINY_WORK = Workload(global_batch=8, seq_len=128)


def test_hand_worked_memory():
    # Per-rank layer params: qkv 64*16*6 = 6144, out 2*16*64 = 2048, mlp 2*64*128 = 16384, norms 256,
    # biases 96 + 64 + 128 + 64 = 352 -> 25184. Stage 0: 2 layers + 500 vocab rows * 64 + 128 positions * 64
    # = 90560 params. Activations per layer, sbh (10 + 24/t + 5as/(ht)) = 8192 * 42 = 344064 bytes; stage 0
    # holds 2 micro-batches of 2 layers plus 2 embedding dropout masks of 8192 bytes: 1392640.
    mem = memory_per_device(TINY, TINY_LAYOUT, TINY_WORK, Assumptions())
    assert mem.stage == 0
    assert (mem.weights, mem.gradients, mem.optimizer, mem.activations) == (181120, 181120, 1086720, 1392640)
    assert mem.total == 2841600
    last = stage_memory(TINY, TINY_LAYOUT, TINY_WORK, Assumptions())[1]
    # 2 layers + final LayerNorm 128 + tied embedding copy 32000 = 82496 params at 16 bytes; activations
    # 2 * 344064 + final norm input 16384 + output input 16384 + fp32 logits 4 * 128 * 500.
    assert last.total == 82496 * 16 + 688128 + 16384 + 16384 + 256000


def test_hand_worked_step_time():
    device = DeviceSpec("test", memory_gib=1, peak_tflops=1.0, intra_node_gbps=100, inter_node_gbps=10,
                        intra_node_latency_us=10, inter_node_latency_us=20)
    hw = ClusterSpec(device, num_devices=8, devices_per_node=4)
    cost = step_cost(TINY, TINY_LAYOUT, hw, TINY_WORK, Assumptions(efficiency=0.5))
    # Grid arange(8).view(dp=2, pp=2, tp=2): TP and pipeline groups inside a 4-device node, DP across nodes.
    # Last stage (the slowest) per micro-batch: compute (2 * 25165824 + 24576000) FLOPs / 5e11 = 1.49815296e-4.
    # TP: Megatron kernels overlap the layers' backward all-reduces with the weight-gradient matmuls
    # (Korthikanti et al. 2022, 6.2), leaving 4 forward all-reduces (4 * 10us + 65536 wire bytes / 1e11), the
    # output layer's backward all-reduce (10us + 16384 / 1e11) and 3 cross-entropy ones (30us + 1536 / 1e11)
    # = 8.083456e-05; sends 2 * 10us + 16384 B / 1e11. No hbm_gbps: no elementwise or optimizer term.
    assert cost.bottleneck_stage == 1
    assert cost.step.compute == pytest.approx(4 * 1.49815296e-4, rel=1e-12)
    # 4 micro-batches, plus the gradient-norm all-reduce of one fp32 (10us + 4 B / 1e11) once per step.
    assert cost.step.tp_comm == pytest.approx(4 * 8.083456e-05 + 1.000004e-5, rel=1e-12)
    assert cost.step.pp_comm == pytest.approx(4 * 2.016384e-5, rel=1e-12)
    assert cost.step.bubble == pytest.approx(0.00025081369600000005, rel=1e-12)  # (p-1)/v = 1 micro-batch time
    # DP: stage 0 all-reduces 90560 bf16 grads across nodes (2e-5 + 181120 / 1e10) and the tied
    # embedding copy with the last stage inside the node (1e-5 + 64000 / 1e11).
    assert cost.step.dp_comm == pytest.approx(3.8112e-5 + 1.064e-5, rel=1e-12)
    assert cost.step.optimizer == 0.0
    assert cost.step.total == pytest.approx(0.0013128205200000002, rel=1e-12)
    assert cost.model_flops == 2_003_828_736
    assert cost.mfu == pytest.approx(2_003_828_736 / (0.0013128205200000002 * 8 * 1e12), rel=1e-12)


def test_alpha_beta_fit_recovers_latency_and_bandwidth():
    from tensorpar.planner.calibrate import fit_alpha_beta

    samples = [{"bytes": n, "seconds": 25e-6 + n / 12e9} for n in (4096, 65536, 1 << 20, 1 << 24)]
    latency, bandwidth = fit_alpha_beta(samples, world=2)  # ring all-reduce on 2 ranks: wire = payload
    assert latency == pytest.approx(25e-6, rel=1e-9)
    assert bandwidth == pytest.approx(12e9, rel=1e-9)


# ---------------------------------------------------------------- issue 27 item 15: matmul shapes, NICs per node

@pytest.mark.parametrize("name", ["gpt3-175b", "llama3-70b", "moe"])
@pytest.mark.parametrize("t", [1, 8])
def test_layer_gemms_add_up_to_the_layer_flops(name, t):
    """The shapes the step time costs one by one are the FLOPs of eq. 3's layer term (and its generalisations);
    the backward's input- and weight-gradient products are twice the forward."""
    from dataclasses import replace

    from tensorpar.planner.flops import backward_gemms, layer_gemms
    from tensorpar.planner.partition import busiest_heads, max_ffn_columns

    model = (replace(preset("llama3-8b"), num_experts=8, experts_per_token=2) if name == "moe" else preset(name))
    heads = busiest_heads(model.num_heads, model.num_kv_heads, t)
    ffn = max_ffn_columns(model.ffn_hidden_size, t)
    gemms = layer_gemms(model, heads, ffn, 3 * 2048, 2048)
    flops = layer_forward_flops(model, heads, ffn, 3 * 2048, 2048)

    def total(g):
        return sum(2 * m * k * n * c for m, k, n, c in g)

    for part in ("linear", "attention"):
        assert total(gemms[part]) == pytest.approx(flops[part], rel=1e-12)
        assert total(backward_gemms(gemms[part])) == pytest.approx(2 * flops[part], rel=1e-12)


def test_a_matmul_writes_its_output_once_not_overlapped():
    """``[m, k] x [k, n]``: 2mkn FLOPs at efficiency x peak, plus m n x 2 bytes at the HBM bandwidth: k / (k + k0)
    of the main-loop rate with k0 = efficiency x peak / HBM (78 here), so a longer k runs closer to peak."""
    from tensorpar.planner.cost import gemm_seconds

    device = DeviceSpec("test", memory_gib=80, peak_tflops=312.0, intra_node_gbps=300, inter_node_gbps=25,
                        matmul_efficiency=0.5, hbm_gbps=2000.0)
    cluster, assume = ClusterSpec(device, 1, 1), Assumptions()
    rates = []
    for k in (768, 3200):
        main = 2 * 2048 * k * 4096 / (0.5 * 312e12)
        got = gemm_seconds([(2048, k, 4096, 3)], cluster, assume)
        assert got == pytest.approx(3 * main * (k + 78) / k, rel=1e-12)
        assert gemm_seconds([(2048, k, 4096, 3)], cluster, assume, write_output=False) == pytest.approx(3 * main)
        rates.append(3 * main / got)
    assert rates[0] == pytest.approx(768 / 846) and rates[1] == pytest.approx(3200 / 3278) and rates[1] > rates[0]
    no_hbm = ClusterSpec(DeviceSpec("test", 80, 312.0, 300, 25, matmul_efficiency=0.5), 1, 1)
    assert gemm_seconds([(2048, 768, 4096, 1)], no_hbm, assume) == pytest.approx(2 * 2048 * 768 * 4096 / 156e12)


def test_a_dp_group_uses_the_nics_of_its_ranks_in_a_node():
    """A ring leaving the node gets one NIC per group rank in the node (NCCL channels), at most the NVLink rate;
    a DP group has 8 / (tp pp) ranks in a DGX node. At tp = pp = 1 its all-reduce is 8x faster than at one NIC."""
    from tensorpar.planner.cluster import device_preset

    a100 = ClusterSpec(device_preset("a100-80gb"), 64, 8)
    assert a100.link(64, "dp", 1)[0] == 25e9 and a100.link(64, "dp", 8)[0] == 200e9
    assert a100.link(64, "dp", 16)[0] == 300e9 and a100.link(8, "dp", 8)[0] == 300e9   # NVLink caps; in-node
    device = DeviceSpec("test", memory_gib=80, peak_tflops=312.0, intra_node_gbps=300, inter_node_gbps=25,
                        inter_node_latency_us=0.0, hbm_gbps=2039.0)
    model, work = preset("smollm2-1.7b"), Workload(64, 2048)
    dp_comm = {}
    for per_node, (tp, dp) in ((8, (1, 64)), (1, (1, 64)), (4, (2, 32))):
        cluster = ClusterSpec(device, 64, 8) if per_node > 1 else ClusterSpec(device, 64, 1)
        lay = Layout(tp=tp, pp=1, dp=dp, micro_batch=1)
        dp_comm[per_node] = step_cost(model, lay, cluster, work, Assumptions()).step.dp_comm
    assert dp_comm[1] == pytest.approx(8 * dp_comm[8], rel=1e-12)
    for per_node, (tp, dp), nics in ((8, (1, 64), 8), (4, (2, 32), 4)):   # tp 2: 4 DP ranks (and NICs) per node
        lay = Layout(tp=tp, pp=1, dp=dp, micro_batch=1)
        wire = sum(c.wire_bytes for c in dp_collectives(stage_params(model, lay)[0], lay, Assumptions()))
        assert dp_comm[per_node] == pytest.approx(wire / (nics * 25e9), rel=1e-9)


def test_collective_fit_without_a_positive_slope_gives_a_finite_bandwidth(monkeypatch):
    """A loaded host can time a small all-reduce slower than a large one: no positive slope, an infinite fitted
    bandwidth, which a device file refuses. measure_collectives then reports the largest message's rate."""
    from tensorpar.planner.calibrate import links

    samples = [{"bytes": 4096, "seconds": 3e-3}, {"bytes": 1 << 16, "seconds": 1e-3},
               {"bytes": 1 << 20, "seconds": 2e-4}]
    assert links.fit_alpha_beta(samples, 2)[1] == float("inf")

    class Pool:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def run(self, fn, sizes, backend):
            return [samples, samples]
    import tensorpar.testing
    monkeypatch.setattr(tensorpar.testing, "WorkerPool", Pool)
    got = links.measure_collectives(sizes=(4096, 1 << 16, 1 << 20))
    assert got["bandwidth_gbps"] == pytest.approx((1 << 20) / 2e-4 / 1e9)
