"""Mixture of experts in the planner (issue 15.4): expert parallelism (ep) as a layout dimension. Expert
weights and their optimizer state divide by ep, the all-to-all volume per layer follows top-k and the
capacity factor, and rule breaks are explained. Worked by hand on a tiny model; no torch."""
import pytest

from tensorpar.planner.cluster import ClusterSpec, DeviceSpec
from tensorpar.planner.cost import step_cost
from tensorpar.planner.enumerate import search
from tensorpar.planner.layout import Assumptions, Layout, Workload, problems
from tensorpar.planner.memory import memory_per_device
from tensorpar.planner.model_spec import ModelSpec
from tensorpar.planner.traffic import ep_collectives

MOE = ModelSpec("tiny-moe", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=4, ffn_hidden_size=32,
                vocab_size=100, num_experts=8, experts_per_token=2)
DEVICE = DeviceSpec("test", memory_gib=80, peak_tflops=1.0, intra_node_gbps=100, inter_node_gbps=10,
                    matmul_efficiency=0.5)
CLUSTER = ClusterSpec(DEVICE, num_devices=8, devices_per_node=8)
WORK = Workload(global_batch=8, seq_len=16)


def test_expert_weights_and_optimizer_divide_by_ep():
    assume = Assumptions()
    expert_per_layer = 8 * 3 * 64 * 32  # 8 experts of gate, up, down
    base = memory_per_device(MOE, Layout(tp=1, pp=1, dp=8, micro_batch=1, distributed_optimizer=True), WORK, assume)
    for ep in (2, 4, 8):
        mem = memory_per_device(MOE, Layout(tp=1, pp=1, dp=8, micro_batch=1, distributed_optimizer=True, ep=ep),
                                WORK, assume)
        held = 2 * expert_per_layer * (1 - 1 / ep)  # expert params no longer on this rank (2 layers)
        assert base.weights - mem.weights == pytest.approx(2 * held)  # 2 bytes each
        # Dense state shards over dp = 8, expert state over dp / ep replicas holding the same experts.
        dense = base.weights / 2 - 2 * expert_per_layer
        assert mem.optimizer == pytest.approx(12 * dense / 8 + 12 * 2 * expert_per_layer / ep / (8 // ep))
        assert mem.activations == base.activations  # balanced routing: the same expert-tokens per rank


def test_all_to_all_volume_per_layer():
    assume = Assumptions(capacity_factor=1.25)
    layout = Layout(tp=1, pp=1, dp=8, micro_batch=2, ep=4)
    calls = ep_collectives(MOE, layout, WORK, assume, layers=2)
    elements = 2 * 16 * 2 * 1.25 * 64  # tokens x top-k x capacity x hidden
    assert [(c.calls, c.elements, c.group) for c in calls] == [(4, elements, 4), (4, elements, 4)]
    assert sum(c.wire_bytes for c in calls) == pytest.approx(8 * elements * 2 * 3 / 4)
    assert ep_collectives(MOE, Layout(tp=1, pp=1, dp=8, micro_batch=2, ep=1), WORK, assume, layers=2) == []
    full = ep_collectives(MOE, Layout(tp=1, pp=1, dp=8, micro_batch=2, ep=4, recompute="full"), WORK, assume,
                          layers=2)
    assert full[0].calls == 8  # the forward dispatch and combine run again in backward
    cost = step_cost(MOE, layout, CLUSTER, Workload(global_batch=64, seq_len=16), assume)
    # 64 / (dp 8 x micro-batch 2) = 4 micro-batches; 8 all-to-alls of 5120 bf16 elements per micro-batch, 10 us each + 3/4 of the bytes at 100 GB/s.
    assert cost.step.ep_comm == pytest.approx(4 * 8 * (10e-6 + 0.75 * elements * 2 / 100e9), rel=1e-12)


def test_ep_rules():
    assume = Assumptions()
    dense = ModelSpec("dense", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=4, ffn_hidden_size=32,
                      vocab_size=100)
    rules = lambda model, **kw: [p.message for p in problems(Layout(**kw), model, CLUSTER, WORK, assume)]  # noqa: E731
    assert any("needs a mixture-of-experts model" in m for m in rules(dense, tp=1, pp=1, dp=8, micro_batch=1, ep=2))
    odd = ModelSpec("moe6", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=4, ffn_hidden_size=32,
                    vocab_size=100, num_experts=6, experts_per_token=2)
    assert any("must divide the 6 experts" in m for m in rules(odd, tp=1, pp=1, dp=8, micro_batch=1, ep=4))
    assert any("must divide dp (2)" in m for m in rules(MOE, tp=4, pp=1, dp=2, micro_batch=1, ep=4))
    assert rules(MOE, tp=2, pp=1, dp=4, micro_batch=1, ep=4) == []


def test_search_tries_every_ep_and_explains_it():
    from tensorpar.planner.explain import explain

    found = search(MOE, CLUSTER, WORK, Assumptions())
    eps = {p.layout.ep for p in found.ranked}
    assert eps == {1, 2, 4, 8}
    assert all(8 % p.layout.ep == 0 and p.layout.dp % p.layout.ep == 0 for p in found.ranked)
    lines = explain(found)
    assert any(line.startswith("ep=") for line in lines)
