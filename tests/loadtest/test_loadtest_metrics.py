"""Metric definitions on synthetic timelines with known answers (vLLM `bench serve` semantics)."""

import numpy as np
import pytest

from pdcluster.loadtest.client import RequestRecord
from pdcluster.loadtest.metrics import compute_metrics, parse_goodput, percentile_key, request_tpot


def rec(index, ttft, itl, out, start=0.0, prompt_len=10, success=True):
    """A successful request: first token at ttft, then one token event per ITL gap."""
    return RequestRecord(index=index, prompt_len=prompt_len, expected_output_len=out,
                         arrival_s=start, start_s=start, success=success,
                         error="" if success else "boom", ttft_s=ttft, itl_s=list(itl),
                         e2el_s=ttft + sum(itl), output_tokens=out if success else 0)


def test_tpot_excludes_first_token():
    # A slow first token (1 s) then 4 tokens 10 ms apart: TPOT is 10 ms, not E2EL / 5.
    r = rec(0, 1.0, [0.01] * 4, out=5)
    assert request_tpot(r) == pytest.approx(0.01)
    m = compute_metrics([r], duration_s=2.0)
    assert m["mean_tpot_ms"] == pytest.approx(10.0)
    assert m["mean_e2el_ms"] == pytest.approx(1040.0)
    assert m["mean_ttft_ms"] == pytest.approx(1000.0)


def test_tpot_skips_single_token_requests():
    m = compute_metrics([rec(0, 0.1, [], out=1), rec(1, 0.2, [0.03, 0.05], out=3)], 1.0)
    assert m["mean_tpot_ms"] == pytest.approx(40.0)  # only the 3-token request: (0.08)/2
    assert m["median_tpot_ms"] == pytest.approx(40.0)


def test_itl_counts_each_gap_pooled_over_requests():
    gaps_a, gaps_b = [0.01, 0.02, 0.09], [0.04, 0.05]
    m = compute_metrics([rec(0, 0.1, gaps_a, out=4), rec(1, 0.2, gaps_b, out=3)], 1.0,
                        percentiles=(50, 90, 99))
    pooled = np.array(gaps_a + gaps_b)
    assert m["mean_itl_ms"] == pytest.approx(pooled.mean() * 1000)   # 5 gaps, not 2 means
    assert m["median_itl_ms"] == pytest.approx(40.0)
    assert m["p90_itl_ms"] == pytest.approx(np.percentile(pooled, 90) * 1000)
    # TPOT is per request, so it differs from the pooled ITL mean.
    assert m["mean_tpot_ms"] == pytest.approx(np.mean([0.12 / 3, 0.09 / 2]) * 1000)


def test_percentiles_match_numpy():
    rng = np.random.default_rng(7)
    ttfts = rng.exponential(0.2, size=101)
    records = [rec(i, float(t), [0.01 * (1 + i % 3)] * 3, out=4) for i, t in enumerate(ttfts)]
    m = compute_metrics(records, 10.0, percentiles=(25, 90, 99, 99.9))
    e2els = np.array([r.e2el_s for r in records])
    tpots = np.array([request_tpot(r) for r in records])
    for p in (25, 90, 99, 99.9):
        key = percentile_key(p)
        assert m[f"{key}_ttft_ms"] == pytest.approx(np.percentile(ttfts, p) * 1000)
        assert m[f"{key}_e2el_ms"] == pytest.approx(np.percentile(e2els, p) * 1000)
        assert m[f"{key}_tpot_ms"] == pytest.approx(np.percentile(tpots, p) * 1000)
    assert m["std_ttft_ms"] == pytest.approx(np.std(ttfts) * 1000)
    assert m["median_ttft_ms"] == pytest.approx(np.median(ttfts) * 1000)
    assert "p99.9_ttft_ms" in m and "p25_itl_ms" in m


def test_goodput_counts_requests_meeting_both_slos():
    records = [
        rec(0, 0.100, [0.02] * 4, out=5),    # ttft 100 ok, tpot 20 ok      → good
        rec(1, 0.100, [0.08] * 4, out=5),    # ttft ok, tpot 80 > 50        → bad
        rec(2, 0.600, [0.01] * 4, out=5),    # ttft 600 > 500, tpot ok      → bad
        rec(3, 0.200, [], out=1),            # one token: tpot counts as 0  → good
        rec(4, 0.500, [0.05] * 2, out=3),    # exactly at both SLOs         → good
        rec(5, 0.010, [], out=0, success=False),  # failed: never good
    ]
    m = compute_metrics(records, duration_s=2.0,
                        goodput_slos_ms=parse_goodput(["ttft:500", "tpot:50"]))
    assert m["request_goodput"] == pytest.approx(3 / 2.0)
    only_ttft = compute_metrics(records, 2.0, goodput_slos_ms={"ttft": 500})
    assert only_ttft["request_goodput"] == pytest.approx(4 / 2.0)
    assert compute_metrics(records, 2.0)["request_goodput"] is None


def test_counts_and_throughputs():
    records = [rec(0, 0.1, [0.01] * 3, out=4, prompt_len=100),
               rec(1, 0.1, [0.01] * 7, out=8, prompt_len=50),
               rec(2, 0.0, [], out=0, prompt_len=999, success=False)]
    m = compute_metrics(records, duration_s=4.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["total_input_tokens"] == 150          # failed requests' prompts don't count
    assert m["total_output_tokens"] == 12
    assert m["request_throughput"] == pytest.approx(0.5)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_token_throughput"] == pytest.approx(162 / 4.0)
    assert m["max_concurrent_requests"] == 2


def test_all_failed_reports_zeros_like_vllm():
    m = compute_metrics([rec(0, 0.0, [], out=0, success=False)], 1.0)
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["mean_ttft_ms"] == 0.0 and m["p99_itl_ms"] == 0.0


def test_parse_goodput_rejects_bad_input():
    assert parse_goodput(["ttft:200", "e2el:3000"]) == {"ttft": 200.0, "e2el": 3000.0}
    for bad in (["ttft"], ["itl:5"], ["tpot:-1"], ["ttft:abc"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
