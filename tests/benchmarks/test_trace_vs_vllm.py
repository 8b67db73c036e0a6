"""benchmarks/trace_vs_vllm.py without servers: the trace's requests and their arrivals, the
prefix-cache counters of both servers' /metrics, and the SLO attainment of pooled rounds."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

from pdcluster.loadtest.client import RequestRecord

ROOT = Path(__file__).resolve().parents[2]


def _load_bench():
    path = ROOT / "benchmarks/trace_vs_vllm.py"
    spec = importlib.util.spec_from_file_location("trace_vs_vllm_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


@pytest.fixture(scope="module")
def records():
    if not bench.TRACE.exists():
        pytest.skip(f"{bench.TRACE} not present")
    return bench.read_trace(bench.TRACE, 0, 150)


def test_trace_arrivals_rescaled_to_the_rate(records):
    workload = bench.trace_requests(records, 16, 2.0, "trace", 0)
    times = [r.arrival_s for r in workload.requests]
    n = len(times)
    assert n + workload.dropped == 150 and workload.dropped > 0
    assert times[0] == 0 and times[-1] == pytest.approx(n / 2.0)
    assert times == sorted(times)
    assert all(len(r.prompt) + r.output_len <= bench.MAX_MODEL_LEN for r in workload.requests)
    assert workload.params["arrivals"] == "trace"


def test_one_timestamp_falls_back_to_poisson(records):
    workload = bench.trace_requests(records[:10], 16, 2.0, "trace", 0)
    assert workload.params["arrivals"].startswith("poisson")
    assert workload.requests[-1].arrival_s == pytest.approx(10 / 2.0)


def test_prompts_share_the_trace_prefix_at_scaled_blocks(records):
    a = bench.trace_requests(records, 16, 1.0, "trace", 0).requests
    assert records[0].hash_ids[0] == records[1].hash_ids[0]
    assert records[0].hash_ids[1] != records[1].hash_ids[1]
    assert a[0].prompt[:32] == a[1].prompt[:32] and a[0].prompt[32:64] != a[1].prompt[32:64]
    same = bench.trace_requests(records, 16, 2.0, "poisson", 0).requests
    other = bench.trace_requests(records, 16, 1.0, "trace", 1).requests
    assert [r.prompt for r in same] == [r.prompt for r in a]
    assert a[0].prompt[:32] != other[0].prompt[:32]


def test_prefix_counters_of_both_servers():
    vllm = """# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0
"""
    pdcluster = """# TYPE pdcluster_prefix_cache_queried_tokens counter
pdcluster_prefix_cache_queried_tokens_total 400.0
# TYPE pdcluster_prefix_cache_hit_tokens counter
pdcluster_prefix_cache_hit_tokens_total{tier="device"} 30.0
pdcluster_prefix_cache_hit_tokens_total{tier="host"} 10.0
"""
    assert bench.parse_prefix_counters(vllm) == (1000.0, 250.0)
    assert bench.parse_prefix_counters(pdcluster) == (400.0, 40.0)
    assert bench.parse_prefix_counters("# TYPE other counter\nother_total 1.0\n") is None


def _record(ttft: float, tokens: int, success: bool = True, cached: int | None = None
            ) -> dict:
    return RequestRecord(index=0, prompt_len=64, expected_output_len=tokens, arrival_s=0.0,
                         success=success, ttft_s=ttft, e2el_s=ttft + 0.1 * (tokens - 1),
                         itl_s=[0.1] * (tokens - 1), output_tokens=tokens,
                         cached_tokens=cached).to_json()


def test_attainment_over_pooled_rounds():
    args = argparse.Namespace(slo_ttft_s=2.0, slo_tpot_ms=200.0)

    def run(requests, queried, hit):
        ok = sum(r["success"] for r in requests)
        return {"requests": requests, "duration": 10.0, "request_goodput": None,
                "completed": ok, "failed": len(requests) - ok, "metrics_queried": queried,
                "metrics_hit": hit, "offline_prefix_hit_ratio": 0.3}

    rounds = [run([_record(1.0, 10, cached=32), _record(3.0, 10)], 100, 10),
              run([_record(0.5, 1, cached=0), _record(0.0, 0, success=False)], 100, 30)]
    row = bench.summarize(rounds, args)
    assert row["ttft_attainment"] == 0.5  # 1.0 s and 0.5 s of four sent
    assert row["tpot_attainment"] == 0.75  # a one-token reply has TPOT 0; the failure misses
    assert row["attainment"] == 0.5
    assert row["goodput"] == pytest.approx(2 / 20.0)
    assert row["usage_hit_ratio"] == pytest.approx(32 / 128)  # only replies reporting it
    assert row["metrics_hit_ratio"] == pytest.approx(40 / 200)
    assert (row["completed"], row["failed"]) == (3, 1)
