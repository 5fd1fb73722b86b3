"""The planner and the runtime share one set of split rules (issue 9.1): over a grid of shapes the
planner accepts a tp exactly when tensorpar's layers can split the model over it (HeadLayout for the
heads, Partition for the MLP columns and the vocabulary), and its per-rank head counts are the layers'."""
import itertools

import pytest

from tensorpar.layers.attention import HeadLayout
from tensorpar.planner.cluster import ClusterSpec, DeviceSpec
from tensorpar.planner.layout import Assumptions, Layout, Workload, problems
from tensorpar.planner.model_spec import ModelSpec
from tensorpar.planner.partition import head_partition, max_ffn_columns, max_vocab_rows
from tensorpar.shard import Partition

DEVICE = DeviceSpec("grid", memory_gib=80, peak_tflops=100, intra_node_gbps=100, inter_node_gbps=10)
ASSUME = Assumptions(allow_cross_node_tp=True)


def runtime_accepts(heads: int, kv: int, ffn: int, vocab: int, tp: int) -> bool:
    try:
        HeadLayout.make(heads, kv, 4, tp)
        Partition.make(ffn, tp, name="intermediate_size")
        Partition.make(vocab, tp, name="vocab_size")
    except ValueError:
        return False
    return True


def planner_accepts(heads: int, kv: int, ffn: int, vocab: int, tp: int) -> bool:
    model = ModelSpec("grid", num_layers=2, hidden_size=4 * heads, num_heads=heads, num_kv_heads=kv,
                      ffn_hidden_size=ffn, vocab_size=vocab)
    found = problems(Layout(tp=tp, pp=1, dp=1, micro_batch=1), model, ClusterSpec(DEVICE, tp, tp),
                     Workload(1, 16), ASSUME)
    return not found


GRID = [(h, kv, ffn, vocab, tp)
        for h in (1, 2, 3, 4, 6, 8, 9, 12, 15)
        for kv in (k for k in range(1, h + 1) if h % k == 0)
        for ffn, vocab in ((7, 100), (10, 5), (12, 13), (1000, 49152), (1001, 50257))
        for tp in range(1, 10)]


def test_planner_acceptance_equals_runtime_acceptance_over_a_grid():
    disagree = [shape for shape in GRID if planner_accepts(*shape) != runtime_accepts(*shape)]
    assert not disagree, f"{len(disagree)} shapes differ, e.g. (heads, kv, ffn, vocab, tp) = {disagree[:5]}"
    accepted = sum(runtime_accepts(*shape) for shape in GRID)
    assert 0 < accepted < len(GRID)  # the grid has both kinds
    # An MLP size not divisible by tp is accepted by both (here 1001 over tp = 2..9 and 10 over tp = 3, 4 ...).
    assert planner_accepts(8, 8, 1001, 50257, 8) and runtime_accepts(8, 8, 1001, 50257, 8)


@pytest.mark.parametrize("heads,kv", [(h, kv) for h in (1, 4, 6, 9, 12, 15) for kv in range(1, h + 1) if h % kv == 0])
def test_per_rank_heads_are_the_layers_heads(heads, kv):
    for tp in range(1, heads + 1):
        layers = HeadLayout.make(heads, kv, 4, tp)
        planner = head_partition(heads, kv, tp)
        assert [r.q for r in planner] == [layers.local_heads(r) for r in range(tp)]
        assert [r.kv for r in planner] == [layers.local_kv_heads(r) for r in range(tp)]
        assert [r.uniform for r in planner] == [layers.uniform_group(r) is not None for r in range(tp)]


@pytest.mark.parametrize("n,tp", list(itertools.product((7, 10, 1001, 50257), range(1, 8))))
def test_busiest_shard_sizes_are_the_runtime_ones(n, tp):
    sizes = Partition.make(n, tp).sizes
    assert max_ffn_columns(n, tp) == max(sizes) == max_vocab_rows(n, tp)


def test_rejection_carries_the_runtimes_message():
    model = ModelSpec("m", num_layers=2, hidden_size=32, num_heads=8, num_kv_heads=8, ffn_hidden_size=6,
                      vocab_size=100)
    found = problems(Layout(tp=8, pp=1, dp=1, micro_batch=1), model, ClusterSpec(DEVICE, 8, 8), Workload(1, 16),
                     ASSUME)
    assert [p.rule for p in found] == ["split"]
    assert "cannot split intermediate_size of size 6 over tp_size=8 ranks" in found[0].message
