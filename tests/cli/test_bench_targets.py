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
