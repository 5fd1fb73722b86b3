"""bench/link_job.py's fits without ranks: the link the planner gets between two hosts takes its bandwidth from the
back-to-back all-reduce medians and its latency from what one small all-reduce adds to a decode-like step (issue
23.5; bench/results/link_probe.md for why). Points on an exact line, so the fits must return it to float rounding."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


def line(latency_s: float, bandwidth: float, sizes) -> dict:
    return {b: latency_s + b / bandwidth for b in sizes}


def test_fit_returns_the_line_through_smallest_and_largest():
    from link_job import fit
    pts = line(150e-6, 0.125e9, (2304, 65536, 1 << 20, 1 << 22))
    pts[65536] = 3e-3   # a noisy middle size does not move the fit
    f = fit(pts)
    assert f["latency_us"] == pytest.approx(150.0, rel=1e-9)
    assert f["bandwidth_gbps"] == pytest.approx(0.125, rel=1e-9)


def test_link_fit_latency_is_the_in_step_cost_less_its_bytes():
    """Back to back the small call costs 0.4 ms; inside a step it adds 2.4 ms: the planner's latency is the latter
    less 2304 B at the back-to-back fit's 0.125 GB/s (18.432 us)."""
    from link_job import link_fit
    f = link_fit(line(400e-6, 0.125e9, (2304, 65536, 1 << 20, 1 << 22)), 2304, 2.4e-3)
    assert f["bandwidth_gbps"] == pytest.approx(0.125, rel=1e-9)
    assert f["latency_us"] == pytest.approx(2400.0 - 2304 / 0.125e9 * 1e6, rel=1e-9)
    assert f["b2b_latency_us"] == pytest.approx(400.0, rel=1e-9)
    # an in-step cost below the bytes' own time is not a negative latency
    assert link_fit(line(0.0, 1e6, (2304, 1 << 22)), 2304, 1e-3)["latency_us"] == 0.0


def test_calls_per_size_scale_down_above_64_kib():
    from link_job import calls_for
    assert [calls_for(s, 100) for s in (2304, 65536, 1 << 20, 1 << 22)] == [100, 100, 8, 8]
    assert calls_for(1 << 17, 100) == 50


def test_step_matmul_holds_a_tp2_ranks_weights_per_decode_collective(tmp_path):
    """bench_link_rates' in-step matmul ``[h, cols]`` holds a tp = 2 rank's weights per decode collective (SmolLM2's
    shape: 30 layers, h 576, 63 collectives per token), to the nearest column."""
    import json
    from bench_link_rates import step_shape
    from tensorpar.planner.inference import decode_collectives, weight_params_per_rank
    from tensorpar.planner.model_spec import from_hf_config
    cfg = {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
           "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True,
           "max_position_embeddings": 8192}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hidden, cols = step_shape(str(tmp_path))
    model = from_hf_config(tmp_path / "config.json")
    assert decode_collectives(model, 2) == 63 and hidden == 576
    per = weight_params_per_rank(model, 2) / 63
    assert abs(hidden * cols - per) <= hidden / 2
