"""Ranks sharing a host's cores (tensorpar.planner.sharing) and the calibrated-device terms of the cost model: the
shared-core schedule, the measured AdamW time per parameter and a separate tp link. Expected values are worked by
hand (schedule makespans from Narayanan et al. 2021, section 2.2) or counted on the model torch builds."""
import dataclasses

import pytest

from tensorpar.planner.cluster import ClusterSpec, DeviceSpec
from tensorpar.planner.sharing import pipeline_makespan, schedule_order, thread_share


@pytest.fixture(autouse=True)
def _threads_from_the_cores(monkeypatch):
    """rank_device follows TENSORPAR_THREADS (the ranks' rule): these tests give each rank cores // ranks threads."""
    monkeypatch.delenv("TENSORPAR_THREADS", raising=False)


def test_thread_share_is_processor_sharing():
    assert thread_share(1, 2) == 1.0
    assert thread_share(2, 2) == 1.0
    assert thread_share(4, 2) == 0.5
    assert thread_share(4, 2, 2.0) == pytest.approx(2 / 6)
    assert thread_share(0, 2, 5.0) == 1.0   # nothing of ours runs
    with pytest.raises(ValueError, match="cores"):
        thread_share(1, 0)


@pytest.mark.parametrize("ours,external,groups,share", [
    (4, 10, 1, 0.25),    # 2 groups: a core each; our 4 threads share ours
    (4, 10, 3, 0.125),   # 4 groups: half a core each
    (1, 10, 1, 1.0),     # our one thread needs less than its group's core
    (4, 1, 1, 0.25),     # the other group's one thread keeps a core, we get the other
    (2, 2, 2, 1 / 3),    # 3 groups of demand 2, 1, 1 on 2 cores: 2/3 of a core each
])
def test_scheduling_groups_share_the_cores_first(ours, external, groups, share):
    """Linux autogroup: cores water-filled equally over the groups (ours + the others), then over a group's threads."""
    assert thread_share(ours, 2, external, groups) == pytest.approx(share)


def test_competition_sampler_reads_proc():
    from tensorpar.train.autoplan import CompetitionSampler

    s = CompetitionSampler()
    got = s.sample()
    if got is None:
        pytest.skip("no /proc here")
    threads, groups = got
    assert threads >= 0 and 0 <= groups <= threads   # every group counted holds a runnable thread
    s.samples = [(1.0, 4, 2), (2.0, 6, 2), (3.0, 100, 9)]
    assert s.mean_between(0.5, 2.5) == (5, 2) and s.mean_between(5, 6) is None


def test_schedule_orders():
    # 1F1B, p = 2, m = 3: rank 0 warms up with one forward, rank 1 (last) alternates from the start
    o = schedule_order("1f1b", 2, 1, 3)
    assert o[0] == [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("F", 2, 0), ("B", 1, 0), ("B", 2, 0)]
    assert o[1] == [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0), ("F", 2, 0), ("B", 2, 0)]
    assert schedule_order("gpipe", 2, 1, 2)[1] == [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)]
    # interleaved, p = 2, v = 2, m = 2: rank 0 warms up with (v-1) p + 2 (p-1) = 4 forwards: mb 0, 1 on chunk 0,
    # then mb 0, 1 on chunk 1; its backwards start on chunk 1
    o = schedule_order("interleaved-1f1b", 2, 2, 2)
    assert o[0][:4] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1)]
    assert [op for op in o[0] if op[0] == "B"] == [("B", 0, 1), ("B", 1, 1), ("B", 0, 0), ("B", 1, 0)]
    assert all(len(ops) == 2 * 2 * 2 for ops in o)
    with pytest.raises(ValueError, match="multiple of pp"):
        schedule_order("interleaved-1f1b", 2, 2, 3)


@pytest.mark.parametrize("schedule,p,v,m", [("1f1b", 2, 1, 4), ("gpipe", 2, 1, 4), ("1f1b", 4, 1, 4),
                                            ("1f1b", 4, 1, 16), ("interleaved-1f1b", 2, 2, 4),
                                            ("interleaved-1f1b", 4, 2, 8)])
def test_one_device_per_rank_gives_the_textbook_bubble(schedule, p, v, m):
    """Speed 1 (a core per rank), forward 1 and backward 2 per stage: (m + (p-1)/v) (F + B)."""
    fwd = [[1 / v] * v for _ in range(p)]
    bwd = [[2 / v] * v for _ in range(p)]
    t = pipeline_makespan(schedule_order(schedule, p, v, m), fwd, bwd, 0.0, lambda n: 1.0)
    assert t == pytest.approx((m + (p - 1) / v) * 3)


def test_sends_delay_a_single_micro_batch():
    """p = 2, m = 1: F0, send, F1, B1, send, B0 in a chain: 1 + h + 1 + 2 + h + 2."""
    t = pipeline_makespan(schedule_order("1f1b", 2, 1, 1), [[1.0], [1.0]], [[2.0], [2.0]], 0.25, lambda n: 1.0)
    assert t == pytest.approx(6.5)


def test_shared_cores_absorb_the_bubble():
    """4 ranks (2 stages of 2) on 2 cores: a waiting stage frees its cores, the other runs at full speed, so the
    pipeline takes the total work / cores = 4 ranks x m x 3 / 2 = 6 m, against (m + 1) x 3 / (1/2) with a
    bubble; 4 single-rank stages with m = 1 run one at a time at full speed (no sharing): 4 x 3."""
    def speed(stages_per_host_ranks):
        return lambda n: thread_share(n * stages_per_host_ranks, 2)

    t = pipeline_makespan(schedule_order("1f1b", 2, 1, 4), [[1.0]] * 2, [[2.0]] * 2, 0.0, speed(2))
    assert t == pytest.approx(6 * 4)
    t = pipeline_makespan(schedule_order("1f1b", 4, 1, 1), [[1.0]] * 4, [[2.0]] * 4, 0.0, speed(1))
    assert t == pytest.approx(12.0)


def _small():
    from tensorpar.train import autoplan
    from tensorpar.train.config import TrainConfig
    from tensorpar.hf.presets import preset_config

    cfg = TrainConfig(model="small", seq_len=64, batch_size=8)
    return autoplan, cfg, preset_config("small", 256, 64)


CAL = dict(cores=2, cuda=False, backend="cpu (1 threads)", matmul_tflops=0.02, hbm_gbps=4.0, memory_gib=16.0,
           train_layer_overhead_us=2000.0, train_micro_batch_overhead_us=3000.0, optimizer_ns_per_param=8.0,
           collective={"backend": "gloo", "bandwidth_gbps": 0.5, "latency_us": 100.0,
                       "by_backend": {"gloo": {"backend": "gloo", "bandwidth_gbps": 0.5, "latency_us": 100.0},
                                      "shm": {"backend": "shm", "bandwidth_gbps": 2.0, "latency_us": 10.0}}})


def _score(lay, device):
    from tensorpar.planner.enumerate import score

    autoplan, cfg, config = _small()
    return score(lay, *autoplan.planner_inputs(cfg, config, device, 4)).cost.step


@pytest.mark.parametrize("external,share", [(0.0, 0.5), (2.0, 2 / 6)])
def test_without_a_pipeline_every_term_runs_at_the_all_busy_share(external, share):
    """tp = 2, dp = 2 on 2 cores: all 4 ranks always busy, so every part of the step takes 1 / share of its time
    on a device per rank (the same rates, host_cores 0)."""
    from tensorpar.planner.layout import Layout

    autoplan, _, _ = _small()
    shared = dataclasses.replace(autoplan.rank_device(CAL, 4), external_threads=external)
    alone = dataclasses.replace(shared, host_cores=0.0)
    lay = Layout(tp=2, pp=1, dp=2, micro_batch=2)
    a, b = _score(lay, shared), _score(lay, alone)
    assert a.total == pytest.approx(b.total / share)
    assert a.optimizer == pytest.approx(b.optimizer / share) and a.dp_comm == pytest.approx(b.dp_comm / share)
    assert a.bubble == 0.0


def test_pipeline_on_shared_cores_costs_less_than_the_textbook_bubble():
    from tensorpar.planner.layout import Layout

    autoplan, _, _ = _small()
    shared = autoplan.rank_device(CAL, 4)
    lay = Layout(tp=2, pp=2, dp=1, micro_batch=2)   # 2 micro-batches of 2 stages of 2 ranks
    a = _score(lay, shared)
    alone = _score(lay, dataclasses.replace(shared, host_cores=0.0))
    # every rank at half speed throughout (a device per rank at the all-busy share) would take alone / 0.5, with
    # a bubble of (p-1) micro-batch times; the freed cores absorb it here (2 stages of 2 ranks on 2 cores)
    assert alone.bubble > 0 and a.bubble == 0.0
    assert a.total < alone.total / 0.5


def test_optimizer_time_is_the_measured_time_per_parameter():
    """pp = dp = tp = 1: the optimizer term is every parameter of the model (torch's count, the tied embedding
    once) x the measured 8 ns; 1 rank on 2 cores runs alone (threads_per_rank 2: 2 ns x 8 / 2)."""
    from transformers import LlamaForCausalLM

    from tensorpar.planner.enumerate import score
    from tensorpar.planner.layout import Layout

    autoplan, cfg, config = _small()
    n = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    device = autoplan.rank_device(CAL, 1)
    assert device.threads_per_rank == 2
    step = score(Layout(tp=1, pp=1, dp=1, micro_batch=8), *autoplan.planner_inputs(cfg, config, device, 1)).cost.step
    assert step.optimizer == pytest.approx(n * 8e-9 / 2, rel=1e-3)


def test_tp_group_on_its_own_backend():
    """rank_device(tp_backend="shm"): the tp group's collectives use the measured shared-memory link, the dp group's
    gloo: the tp part equals that of a device whose every link is shm, the dp part that of an all-gloo device."""
    from tensorpar.planner.layout import Layout

    autoplan, _, _ = _small()
    mixed = autoplan.rank_device(CAL, 4, tp_backend="shm")
    assert (mixed.tp_link_gbps, mixed.tp_link_latency_us) == (2.0, 10.0) and "shm" in mixed.tp_link_label
    gloo = autoplan.rank_device(CAL, 4)
    shm = autoplan.rank_device(CAL, 4, backend="shm")
    lay = Layout(tp=2, pp=1, dp=2, micro_batch=2)
    m, g, s = _score(lay, mixed), _score(lay, gloo), _score(lay, shm)
    assert m.tp_comm == pytest.approx(s.tp_comm) and m.tp_comm < g.tp_comm
    assert m.dp_comm == pytest.approx(g.dp_comm) and m.dp_comm > s.dp_comm
    cluster = ClusterSpec(mixed, 4, 4)
    assert cluster.link(2, "tp") == pytest.approx((2.0e9, 10e-6))
    assert cluster.link(2, "dp") == pytest.approx((0.5e9, 100e-6))
    with pytest.raises(ValueError, match="collective backend 'nccl' was not calibrated"):
        autoplan.rank_device(CAL, 4, tp_backend="nccl")


def test_device_fields_are_checked():
    with pytest.raises(ValueError, match="device threads_per_rank"):
        DeviceSpec("x", 1, 1, 1, 1, threads_per_rank=0)
    with pytest.raises(ValueError, match="device host_cores"):
        DeviceSpec("x", 1, 1, 1, 1, host_cores=-1)
    with pytest.raises(ValueError, match="device optimizer_ns_per_param"):
        DeviceSpec("x", 1, 1, 1, 1, optimizer_ns_per_param=-1)


def test_layer_efficiency_makes_the_planner_reproduce_the_measured_layer():
    """measure_layer_efficiency times a decoder layer (forward + backward) and returns the matmul efficiency e at
    which the planner's layer time, F / (e peak) + elementwise + fixed overhead, equals that measurement."""
    from tensorpar.planner.cluster import ClusterSpec, DeviceSpec
    from tensorpar.planner.cost import layer_times
    from tensorpar.planner.layout import Assumptions, Layout, Workload
    from transformers import LlamaConfig

    from tensorpar.planner.model_spec import from_hf_config
    from tensorpar.train.autoplan import EFFICIENCY_LAYER, measure_layer_efficiency

    peak, hbm, overhead = 0.2, 10.0, 500.0   # a fast matmul peak: the measured layer is slower, e < 1
    got = measure_layer_efficiency(peak, hbm, overhead, reps=1)
    e = got["layer_matmul_efficiency"]
    assert 0.05 <= e <= 1 and got["layer_seconds"] > 0
    L = EFFICIENCY_LAYER
    spec = from_hf_config(LlamaConfig(vocab_size=256, num_hidden_layers=1, max_position_embeddings=L["seq"],
                                      tie_word_embeddings=True, **{k: v for k, v in L.items()
                                                                   if k not in ("batch", "seq")}).to_dict())
    device = DeviceSpec("d", 1.0, peak, 0.0, 0.0, matmul_efficiency=e, hbm_gbps=hbm, local_link_gbps=1.0,
                        train_layer_overhead_us=overhead)
    assume = Assumptions(activation_bytes=4, param_bytes=4, grad_bytes=4, optimizer_bytes=8, attention="sdpa")
    t = layer_times(spec, Layout(tp=1, pp=1, dp=1, micro_batch=L["batch"]), ClusterSpec(device, 1, 1),
                    Workload(L["batch"], L["seq"]), assume).total
    if 0.05 < e < 1:
        assert t == pytest.approx(got["layer_seconds"], rel=1e-6)


def test_pipeline_sends_are_a_tp_ranks_whole_hidden_state_in_tensorpar():
    """tensorpar's stages send each tp rank's whole [b, s, h] hidden state (tensorpar.pipeline.stages); Megatron's
    scatter/gather sends 1/t of it (Narayanan et al. 2021, 4.1), as does sequence parallelism ([b, s/t, h])."""
    import dataclasses as dc

    from tensorpar.planner.layout import Assumptions, Layout, Workload
    from tensorpar.planner.model_spec import preset
    from tensorpar.planner.traffic import pipeline_sends

    model = preset("gpt3-175b")  # Megatron kernels
    hf = dc.replace(model, kernels="hf")
    work, assume = Workload(8, 2048), Assumptions()
    lay = Layout(tp=8, pp=4, dp=1, micro_batch=1)
    bsh = 2048 * model.hidden_size
    (send,) = pipeline_sends(hf, lay, work, assume)
    assert send.elements == bsh and send.calls == 2
    assert pipeline_sends(model, lay, work, assume)[0].elements == bsh / 8
    assert pipeline_sends(hf, dc.replace(lay, sequence_parallel=True), work, assume)[0].elements == bsh / 8


def test_pipeline_send_cpu_and_link_of_a_calibrated_device():
    """One device per rank (host_cores 0), pp = 2: each stage does 2 sends or receives per micro-batch at v = 1 and
    6 at v = 2 (4 v, 2 fewer at either end of the model); each costs the measured pipeline_p2p_op_cpu_us of the
    stage's compute. The sends' delay uses the measured point-to-point latency (bandwidth: the link's when the
    fit did not resolve one)."""
    from tensorpar.planner.layout import Layout

    autoplan, _, _ = _small()
    plain = dataclasses.replace(autoplan.rank_device(CAL, 4), host_cores=0.0)
    op = dataclasses.replace(plain, pipeline_p2p_op_cpu_us=1000.0)
    m = 4  # batch 8 / (dp 1 x micro-batch 2)
    for v, ops in ((1, 2), (2, 6)):
        lay = Layout(tp=2, pp=2, dp=1, micro_batch=2, virtual_stages=v)
        a, b = _score(lay, plain), _score(lay, op)
        assert b.compute - a.compute == pytest.approx(m * ops * 1e-3, rel=1e-9)
    link = dataclasses.replace(plain, p2p_link_latency_us=2000.0)
    assert ClusterSpec(link, 4, 4).p2p_link(4) == pytest.approx((0.5e9, 2e-3))
    assert ClusterSpec(dataclasses.replace(link, p2p_link_gbps=3.0), 4, 4).p2p_link(4) == pytest.approx((3e9, 2e-3))
    assert ClusterSpec(plain, 4, 4).p2p_link(4) == ClusterSpec(plain, 4, 4).link(4)
    lay = Layout(tp=2, pp=2, dp=1, micro_batch=2)
    # 2 sends per micro-batch of 2 x 64 x 256 fp32 (each tp rank's whole hidden state)
    assert _score(lay, link).pp_comm == pytest.approx(m * 2 * (2e-3 + 2 * 64 * 256 * 4 / 0.5e9), rel=1e-9)
    with pytest.raises(ValueError, match="device pipeline_p2p_op_cpu_us"):
        DeviceSpec("x", 1, 1, 1, 1, pipeline_p2p_op_cpu_us=-1)
    # 4 ranks on 2 cores: the value measured with more ranks than cores is the one used (the other changes nothing)
    shared = autoplan.rank_device(CAL, 4)
    lay = Layout(tp=2, pp=2, dp=1, micro_batch=2)
    both = dataclasses.replace(shared, pipeline_p2p_op_cpu_us=100.0, pipeline_p2p_op_cpu_shared_us=1000.0)
    assert _score(lay, both).total == pytest.approx(
        _score(lay, dataclasses.replace(both, pipeline_p2p_op_cpu_us=5000.0)).total)
    assert _score(lay, both).total > _score(lay, dataclasses.replace(both, pipeline_p2p_op_cpu_shared_us=100.0)).total
    # one device per rank (host_cores 0): the 2-rank value
    alone = dataclasses.replace(both, host_cores=0.0)
    assert _score(lay, alone).compute - _score(lay, plain).compute == pytest.approx(m * 2 * 1e-4, rel=1e-9)


def test_rank_device_takes_the_pipeline_calibration():
    autoplan, _, _ = _small()
    cal = dict(CAL, pipeline={"p2p_latency_us": 1500.0, "p2p_bandwidth_gbps": 0.0, "pipeline_p2p_op_cpu_us": 300.0,
                              "pipeline_p2p_op_cpu_shared_us": 900.0})
    d = autoplan.rank_device(cal, 4)
    assert (d.p2p_link_latency_us, d.p2p_link_gbps, d.pipeline_p2p_op_cpu_us, d.pipeline_p2p_op_cpu_shared_us) == (
        1500.0, 0.0, 300.0, 900.0)
    assert autoplan.rank_device(CAL, 4).pipeline_p2p_op_cpu_us == 0.0  # an older calibration: not modelled
