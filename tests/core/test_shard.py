"""Shard math and parallel-config validation: pure functions, no process group."""
import pytest

from tensorpar.layers.attention import HeadLayout
from tensorpar.parallel import ParallelConfig
from tensorpar.shard import Partition, UnitSelection, split_sizes


def test_even_and_near_even():
    assert split_sizes(8, 4) == [2, 2, 2, 2]
    assert split_sizes(7, 2) == [4, 3]          # first n % tp ranks get one more
    assert split_sizes(11, 4) == [3, 3, 3, 2]
    assert sum(split_sizes(49152, 3)) == 49152


def test_weighted():
    assert split_sizes(9, 2, weights=[2, 1]) == [6, 3]
    assert split_sizes(10, 2, weights=[2, 1]) == [7, 3]   # 6.67/3.33: largest remainder to rank 0
    assert split_sizes(12, 3, weights=[1, 1, 2]) == [3, 3, 6]


def test_units_never_cut():
    assert split_sizes(9 * 64, 2, unit=64) == [5 * 64, 4 * 64]
    with pytest.raises(ValueError, match="multiple of its unit"):
        split_sizes(100, 2, unit=64)


def test_too_few_rows():
    with pytest.raises(ValueError, match=r"hidden of size 5 over tp_size=8") as e:
        split_sizes(5, 8, name="hidden")
    assert "tp_size <= 5" in str(e.value)


@pytest.mark.parametrize("weights", [[1], [1, 2, 3], [1, 0], [1, -1]])
def test_bad_weights(weights):
    with pytest.raises(ValueError, match="weights"):
        split_sizes(10, 2, weights=weights)


def test_partition_ranges():
    p = Partition.make(11, 4)
    assert p.offsets == (0, 3, 6, 9)
    assert p.range(3) == (9, 11)
    assert p.indices(1) == [3, 4, 5]


def test_world_size_mismatch_lists_every_degree():
    with pytest.raises(ValueError, match=r"dp=2 x pp=1 x tp=3 = 6") as e:
        ParallelConfig(tp=3, dp=2).validate(4)
    assert "world size 4" in str(e.value)
    with pytest.raises(ValueError):
        ParallelConfig(tp=0)


def test_head_layout_smollm2_shapes():
    # 9 query heads, 3 KV heads (groups of 3), head_dim 64
    lay = HeadLayout.make(9, 3, 64, 2)
    assert lay.q_heads.sizes == (5, 4)
    assert lay.kv_heads.units == ((0, 1), (1, 2))        # kv head 1 straddles ranks 0 and 1: duplicated
    assert lay.kv_index(0) == [0, 0, 0, 1, 1]
    assert lay.kv_index(1) == [0, 1, 1, 1]
    lay4 = HeadLayout.make(9, 3, 64, 4)
    assert lay4.q_heads.sizes == (3, 2, 2, 2)
    assert lay4.kv_heads.units == ((0,), (1,), (1, 2), (2,))
    lay9 = HeadLayout.make(9, 3, 64, 9)                   # tp > kv heads: every kv head replicated
    assert [len(u) for u in lay9.kv_heads.units] == [1] * 9
    assert lay.kv_rows.owner_mask(1)[:64] == [False] * 64 and lay.kv_rows.owner_mask(1)[64:] == [True] * 64


def test_head_layout_errors():
    with pytest.raises(ValueError, match=r"tp_size \(10\) exceeds the number of attention heads \(9\)"):
        HeadLayout.make(9, 3, 64, 10)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        HeadLayout.make(9, 2, 64, 2)


def test_unit_selection():
    s = UnitSelection(3, 2, ((0, 1), (1, 2)))
    assert s.indices(1) == [2, 3, 4, 5]
    assert s.sizes == (4, 4) and not s.is_disjoint and s.n == 6


def test_uniform_groups_are_detected():
    assert HeadLayout.make(9, 3, 64, 1).uniform_group(0) == 3
    lay = HeadLayout.make(9, 3, 64, 3)
    assert [lay.uniform_group(r) for r in range(3)] == [3, 3, 3]
    lay = HeadLayout.make(9, 3, 64, 2)                      # [0,0,0,1,1] and [0,1,1,1]: gathered per head
    assert [lay.uniform_group(r) for r in range(2)] == [None, None]


@pytest.mark.parametrize("tp", range(1, 10))
def test_smollm2_heads_on_any_tp_up_to_9(tp):
    lay = HeadLayout.make(9, 3, 64, tp)
    assert sum(lay.q_heads.sizes) == 9 and max(lay.q_heads.sizes) - min(lay.q_heads.sizes) <= 1
    for r in range(tp):  # every local query head finds its own KV head among the rank's KV heads
        s, _ = lay.q_heads.range(r)
        kv = lay.kv_heads.units[r]
        assert [kv[i] for i in lay.kv_index(r)] == [h // 3 for h in range(s, s + lay.q_heads.sizes[r])]
