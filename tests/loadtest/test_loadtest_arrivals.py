"""Arrival schedules: trace time scaling, Poisson/gamma rates, synthetic lengths and prefixes."""

import math

import numpy as np
import pytest

from pdcluster.loadtest.arrivals import (parse_rate_steps, rate_arrivals, stepped_arrivals,
                                         trace_arrivals)
from pdcluster.loadtest.prefix import offline_prefix_hits
from pdcluster.loadtest.synthetic import parse_length, synthetic_workload
from pdcluster.loadtest.tokens import TokenSpace


def test_trace_time_scale_multiplies_gaps():
    assert trace_arrivals([500, 1500, 3500], 1.0) == [0.0, 1.0, 3.0]
    assert trace_arrivals([500, 1500, 3500], 0.5) == [0.0, 0.5, 1.5]
    assert trace_arrivals([500, 1500, 3500], 2.0) == [0.0, 2.0, 6.0]
    assert trace_arrivals([], 0.5) == []
    with pytest.raises(ValueError):
        trace_arrivals([0], -1)


def test_poisson_mean_rate_and_exponential_gaps():
    rate, n = 10.0, 20000
    times = np.array(rate_arrivals(n, rate, 1.0, np.random.default_rng(1), normalize=False))
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)   # exponential: CV 1
    normalized = rate_arrivals(n, rate, 1.0, np.random.default_rng(1))
    assert normalized[-1] == pytest.approx(n / rate)                  # vLLM's rescaling
    assert all(b >= a for a, b in zip(normalized, normalized[1:]))


def test_gamma_burstiness_and_limits():
    n = 20000
    bursty = np.diff(rate_arrivals(n, 5.0, 0.25, np.random.default_rng(2), normalize=False))
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.08)   # CV = 1/sqrt(k)
    assert rate_arrivals(3, math.inf) == [0.0, 0.0, 0.0]
    assert rate_arrivals(3, 2.0, math.inf) == pytest.approx([0.5, 1.0, 1.5])
    with pytest.raises(ValueError):
        rate_arrivals(3, 0.0)


def test_length_specs(tmp_path):
    rng = np.random.default_rng(0)
    assert set(parse_length("128").sample(rng, 50).tolist()) == {128}
    uniform = parse_length("10:20").sample(rng, 2000)
    assert uniform.min() == 10 and uniform.max() == 20
    hist = tmp_path / "h.csv"
    hist.write_text("length,count\n5,3\n# a bin\n100,200,1\n")
    drawn = parse_length(f"@{hist}").sample(rng, 4000)
    assert np.mean(drawn == 5) == pytest.approx(0.75, abs=0.03)
    assert drawn[drawn != 5].min() >= 100 and drawn.max() <= 200
    for bad in ("x", "5:1", "0"):
        with pytest.raises(ValueError):
            parse_length(bad)


def test_synthetic_shared_prefix_and_drops():
    w = synthetic_workload(40, parse_length("64"), parse_length("8"), TokenSpace(),
                           shared_prefix_fraction=0.5, num_prefix_groups=2, seed=3)
    p = [r.prompt for r in w.requests]
    assert all(len(x) == 64 for x in p)
    assert p[0][:32] == p[2][:32] and p[1][:32] == p[3][:32] and p[0][:32] != p[1][:32]
    assert p[0][32:] != p[2][32:]
    # Two groups' prefixes are each sent once uncached: 38 of 40 requests hit 32 tokens.
    assert offline_prefix_hits(p, 16).ratio == pytest.approx(38 * 32 / (40 * 64))
    dropped = synthetic_workload(10, parse_length("100:300"), parse_length("50"), TokenSpace(),
                                 max_model_len=250, seed=0)
    assert dropped.dropped + len(dropped.requests) == 10 and dropped.dropped > 0
    assert all(r.prompt_len + r.output_len <= 250 for r in dropped.requests)


def test_rate_steps_place_each_steps_arrivals_in_its_own_span():
    steps = parse_rate_steps("2:10,8:5,1:20")
    assert steps == [(2.0, 10.0), (8.0, 5.0), (1.0, 20.0)]
    times = stepped_arrivals(steps, rng=np.random.default_rng(1))
    assert len(times) == 20 + 40 + 20
    assert all(0 < t <= 10 for t in times[:20])
    assert all(10 < t <= 15 for t in times[20:60])
    assert all(15 < t <= 35 for t in times[60:])
    assert times == sorted(times)
    for bad in ("2", "2:0", "x:10", "-1:5", "2:10,"):
        with pytest.raises(ValueError, match="RATE:SECONDS"):
            parse_rate_steps(bad)
