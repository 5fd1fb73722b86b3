"""bench/bench_serve.py's latency-under-load helpers, without servers: the one percentile helper against numpy's
percentile, the seeded Poisson arrival schedule (its mean gap, its reproducibility and its scaling with the rate)
and the time per output token of a streamed request."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


def test_pct_equals_numpy_percentile():
    from bench_serve import pct
    xs = list(np.random.default_rng(0).exponential(size=37))
    for q in (1, 50, 90, 99):
        # both interpolate linearly between order statistics: equal up to float rounding
        assert pct(xs, q) == pytest.approx(np.percentile(xs, q), rel=1e-12)
    assert pct([3.0], 99) == 3.0
    assert np.isnan(pct([], 50))


def test_poisson_arrivals_seeded_scaled_and_mean_gap():
    from bench_serve import poisson_arrivals
    a = poisson_arrivals(20000, 4.0, seed=1)
    assert a == poisson_arrivals(20000, 4.0, seed=1)
    assert a != poisson_arrivals(20000, 4.0, seed=2)
    assert all(y > x for x, y in zip(a, a[1:])) and a[0] > 0
    # the same seed at rate 2 is the rate-4 schedule stretched 2x (every backend sees one pattern)
    assert poisson_arrivals(50, 2.0, seed=1) == pytest.approx([2 * t for t in a[:50]], rel=1e-12)
    # exponential gaps of mean 1/rate: the mean of 20000 has a relative standard error of 1/sqrt(20000) = 0.7 %;
    # 3 % is over 4 standard errors; the gaps' coefficient of variation is 1 for an exponential
    gaps = np.diff([0.0] + a)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)
    with pytest.raises(ValueError, match="rate must be > 0"):
        poisson_arrivals(3, 0.0, seed=0)


def test_tpot_is_first_to_last_over_tokens_minus_one():
    from bench_serve import tpot
    assert tpot(0.9, 10) == pytest.approx(0.1)
    assert tpot(0.0, 1) is None
