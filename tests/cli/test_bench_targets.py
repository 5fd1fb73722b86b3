"""bench/bench_llamacpp.py's issue-28 targets, recomputed from the rows of the committed Xeon results files: the
1.1B model gets 1.1x llama.cpp at every precision, SmolLM2 (bound by fixed per-token costs) 1.0x llama.cpp F32 and
1.5x transformers for fp32 only, as issue 28 states them; a ratio just under its target (the 1.1B's fp32 tp=2 /
tp=1, 1.846) is not met by the median even though it prints as 1.85 at two decimals."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))


def _targets(name: str, model: str) -> dict:
    from bench_llamacpp import PRECISIONS, issue_targets
    res = json.loads((ROOT / "bench" / "results" / name).read_text())
    by = {r["config"]: r for r in res["rows"]}
    return {t["target"]: t for t in issue_targets(PRECISIONS, by, True, model)}


def test_smollm2_targets_are_the_issues_fixed_cost_ones():
    t = _targets("llamacpp-xeon.json", "smollm2")
    f32 = t["tensorpar fp32 tp=2 >= 1.0x llama.cpp F32, 2 threads"]
    assert f32["factor"] == 1.0 and f32["ratio_median"] == pytest.approx(28.01 / 31.03, abs=2e-3) and not f32["met"]
    hf = t["tensorpar fp32 tp=2 >= 1.5x transformers fp32, 2 threads"]
    assert hf["ratio_median"] == pytest.approx(28.01 / 17.18, abs=2e-3) and hf["met"]
    assert not any("llama.cpp BF16" in k or "llama.cpp Q8_0" in k for k in t)   # no such SmolLM2 target


def test_the_1_1b_targets_and_a_ratio_just_under_one():
    t = _targets("llamacpp-tinyllama-random-xeon.json", "tinyllama-random")
    q8 = t["tensorpar int8 + fp32 activations tp=2 >= 1.1x llama.cpp Q8_0, 2 threads"]
    assert q8["met"] and q8["ratio_median"] == pytest.approx(16.29 / 11.66, abs=2e-3)
    scale = t["tensorpar fp32: tp=2 >= 1.85x tp=1"]
    assert 1.845 < scale["ratio_median"] < 1.85 and scale["ratio_best_step"] >= 1.85
    assert scale["verdict"].startswith("inconclusive")
    assert not any("transformers" in k for k in t)


def test_the_machines_own_scaling_beside_the_scaling_target():
    """Rows carrying the read measured next to them: the machine's scaling is the per-round ratio of two threads'
    read (next to the tp=2 row) to one thread's (next to the tp=1 row), median over rounds; tensorpar's ratio is
    set against it, and the limit target carries the row's fraction of its own adjacent read."""
    from bench_llamacpp import _limit_target, _machine_scaling, _target

    one = {"config": "tp1", "median_tok_s": 10.0, "best_step_tok_s": 11.0,
           "adjacent_read_rounds": [20e9, 25e9, 30e9]}
    two = {"config": "tp2", "median_tok_s": 15.0, "best_step_tok_s": 17.0,
           "adjacent_read_rounds": [30e9, 40e9, 60e9], "limit_fraction": 0.7, "best_step_limit_fraction": 0.85,
           "adjacent_fraction": 0.83, "adjacent_fraction_rounds": [0.8, 0.83, 0.9]}
    t = _machine_scaling(_target("scale", two, one, 1.85), two, one)
    assert t["machine_scaling_rounds"] == pytest.approx([1.5, 1.6, 2.0])
    assert t["machine_scaling"] == pytest.approx(1.6) and t["machine_bound"]
    assert t["relative_to_machine"] == pytest.approx(1.5 / 1.6) and not t["met"]
    assert "machine_scaling" not in _machine_scaling(_target("scale", one, one, 1.0), {"config": "x"}, one)
    lim = _limit_target("limit", two, 0.8)
    assert lim["verdict"].startswith("inconclusive") and lim["adjacent_fraction"] == 0.83


def test_tp_scaling_pairs_against_the_machine():
    """bench_tp_scaling's pair arithmetic: tensorpar's scaling over the machine's (two threads' read around the
    tp=2 row over one thread's around the tp=1 row), steadiness (each row's reads within 10 %), the fractions of the
    read, llama.cpp beside tp=2, and the summaries over all, steady and machine-able pairs."""
    from bench_tp_scaling import pair_record, summary, with_llama
    one, two = {"tok_s": 10.0, "tokens": [1, 2, 3]}, {"tok_s": 19.0, "tokens": [1, 2, 4]}
    p = pair_record(one, two, [30e9, 30e9], [58e9, 62e9], 2e9, 2.1e9)
    assert p["tp_scaling"] == pytest.approx(1.9) and p["machine_scaling"] == pytest.approx(2.0)
    assert p["relative"] == pytest.approx(0.95) and p["steady"] and p["tokens_equal"] == 2
    assert p["tp1_fraction"] == pytest.approx(10 * 2e9 / 30e9) and p["tp2_fraction"] == pytest.approx(19 * 2.1e9 / 60e9)
    q = pair_record(one, {"tok_s": 12.0, "tokens": [1]}, [30e9, 30e9], [36e9, 50e9], 2e9, 2e9)
    assert not q["steady"] and q["machine_scaling"] == pytest.approx(43 / 30)
    p = with_llama(p, {"decode_tok_s": 15.2}, [57e9, 59e9], [30e9, 30e9], 2e9)
    assert p["vs_llama"] == pytest.approx(1.25) and p["llama_machine_scaling"] == pytest.approx(58 / 30)
    q = with_llama(q, {"decode_tok_s": 10.0}, [36e9, 36e9], [30e9, 30e9], 2e9)
    s = summary([p, q], 1.85)
    assert (s["pairs"], s["steady_pairs"], s["machine_able_pairs"]) == (2, 1, 1)
    assert s["machine_able_tp_scaling"] == pytest.approx(1.9) and s["pairs_meeting_target"] == 1
    assert s["vs_llama"] == pytest.approx((1.25 + 1.2) / 2) and s["vs_llama_min"] == pytest.approx(1.2)
    assert s["same_state_pairs"] == 1 and s["same_state_vs_llama"] == pytest.approx(1.25)   # q: 43 vs 36 GB/s


def job_keep(ctx, value, *, store):
    store["value"] = (value, ctx.rank)
    return sorted(store)


def job_read(ctx, *, store):
    return store.get("value")


def job_plain(ctx):
    return ctx.rank


def test_worker_pool_store_is_kept_per_rank_between_jobs(pools):
    """WorkerPool.run gives a job with a ``store`` parameter the rank's own dict, the same for every job of the pool
    (bench_tp_scaling keeps its loaded model there, not in module state); jobs without it are called as before."""
    pool = pools(2)
    assert pool.run(job_keep, 7) == [["value"], ["value"]]
    assert pool.run(job_plain) == [0, 1]
    assert pool.run(job_read) == [(7, 0), (7, 1)]
