"""Percentiles and summaries of the serving benchmark: exact on known lists."""

from __future__ import annotations

import math
import random

import pytest

from benchmarks.serve.stats import SLO, Dist, percentile


def test_percentiles_of_a_known_list_are_exact():
    xs = [float(i) for i in range(1, 12)]  # 1..11: rank (n-1)q lands on whole ranks
    assert percentile(xs, 0.5) == 6.0
    assert percentile(xs, 0.9) == 10.0
    assert percentile(xs, 0.0) == 1.0 and percentile(xs, 1.0) == 11.0
    # Between ranks: linear interpolation (numpy's default method).
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([0.1, 0.2, 0.3, 0.4, 1.4], 0.99) == pytest.approx(0.4 + 0.96 * 1.0)
    assert math.isnan(percentile([], 0.5))
    with pytest.raises(ValueError):
        percentile(xs, 1.5)


def test_order_does_not_matter_and_matches_numpy():
    np = pytest.importorskip("numpy")
    rng = random.Random(7)
    xs = [rng.expovariate(3.0) for _ in range(101)]
    shuffled = xs[:]
    rng.shuffle(shuffled)
    for q in (0.5, 0.9, 0.99):
        assert percentile(shuffled, q) == pytest.approx(float(np.percentile(xs, q * 100)), abs=1e-15)


def test_dist_of_a_synthetic_latency_list():
    lat = [0.100, 0.200, 0.300, 0.400, 0.500, 0.600, 0.700, 0.800, 0.900, 1.000, 5.000]
    d = Dist.of(lat)
    assert d.count == 11
    assert d.p50 == 0.6
    assert d.p90 == 1.0
    assert d.p99 == pytest.approx(1.0 + 0.9 * 4.0)
    assert d.min == 0.1 and d.max == 5.0
    assert d.mean == pytest.approx(sum(lat) / 11)
    empty = Dist.of([]).as_dict()
    assert empty["count"] == 0 and empty["p50"] is None


def test_slo_bounds():
    slo = SLO(ttft_s=0.5, tpot_s=0.1)
    assert slo.met(0.4, 0.09, 3.0)
    assert not slo.met(0.6, 0.09, 3.0)
    assert not slo.met(0.4, 0.11, 3.0)
    assert slo.met(0.4, None, 3.0)  # a one-token output has no TPOT
    assert not slo.met(None, None, 1.0)  # no first token: no TTFT to meet
    assert SLO().met(None, None, 100.0)
    assert not SLO(e2e_s=1.0).met(0.1, 0.01, 1.5)
