"""The client and runner against a real HTTP stub server (tests/loadtest/conftest.py): failures
and stalls are recorded and counted, never fatal; /metrics hit ratios are measured."""

import asyncio
import json
import time

import pytest

from pdcluster.loadtest.cli import main
from pdcluster.loadtest.client import ClientConfig
from pdcluster.loadtest.runner import RunConfig, run_benchmark
from pdcluster.loadtest.tokens import BlockTokens, TokenSpace
from pdcluster.loadtest.workload import BenchRequest, Workload

# What the stub does, keyed by prompt length.
MODES = {7: "fail", 9: "stall", 11: "stall_mid", 13: "error_mid"}


def by_prompt_len(body: dict) -> str:
    return MODES.get(len(body["prompt"]), "ok")


def workload(lengths: list[int], output_len: int = 6) -> Workload:
    blocks = BlockTokens(TokenSpace(), seed=0)
    return Workload([BenchRequest(i, blocks.get(i, n), output_len, arrival_s=0.01 * i)
                     for i, n in enumerate(lengths)])


def test_failures_and_stalls_are_recorded_not_fatal(stub_server):
    stub_server.behavior = by_prompt_len
    lengths = [20] * 10 + [7, 7, 9, 9, 11, 13]
    client = ClientConfig(api_url=f"{stub_server.url}/v1/completions", model="stub-model",
                          timeout_s=1.0)
    run = RunConfig(metrics_url=f"{stub_server.url}/metrics", progress=False,
                    scrape_interval_s=0.2)
    start = time.perf_counter()
    result = asyncio.run(run_benchmark(workload(lengths), client, run))
    # the stalled ones were cut at the client's 1 s timeout, not waited for the stub's 30 s
    # stall (a generous 20x of the timeout; the "timeout" errors below say which)
    assert time.perf_counter() - start < 20 * client.timeout_s
    assert result["completed"] == 10 and result["failed"] == 6
    errors = {r["prompt_len"]: r["error"] for r in result["requests"] if not r["success"]}
    assert errors[7].startswith("HTTP 500")
    assert "timeout" in errors[9] and "timeout" in errors[11]
    assert "injected mid-stream error" in errors[13]
    ok = [r for r in result["requests"] if r["success"]]
    assert all(r["output_tokens"] == 6 and len(r["itl_s"]) == 5 for r in ok)
    assert result["total_output_tokens"] == 60
    assert result["total_input_tokens"] == 200
    assert all(b["ignore_eos"] and b["max_tokens"] == 6 and b["stream"]
               and b["stream_options"] == {"include_usage": True}
               and "return_token_ids" not in b for b in stub_server.bodies)


def test_output_tokens_counted_from_chunks_without_usage(stub_server):
    client = ClientConfig(api_url=f"{stub_server.url}/v1/completions", model="stub-model",
                          stream_usage=False, return_token_ids=True)
    result = asyncio.run(run_benchmark(workload([20, 30], output_len=5), client,
                                       RunConfig(progress=False)))
    assert [r["output_tokens"] for r in result["requests"]] == [5, 5]
    assert all(b["return_token_ids"] and "stream_options" not in b for b in stub_server.bodies)
    assert result["prefix_cache_hit_ratio"] is None      # no metrics_url → null
    assert result["prefix_cache_timeline"] is None


def test_unreachable_server_counts_failures():
    client = ClientConfig(api_url="http://127.0.0.1:9/v1/completions", model="m", timeout_s=2)
    result = asyncio.run(run_benchmark(workload([20, 20]), client,
                                       RunConfig(metrics_url="http://127.0.0.1:9/metrics",
                                                 progress=False)))
    assert result["completed"] == 0 and result["failed"] == 2
    assert result["prefix_cache_hit_ratio"] is None


def test_cli_trace_replay_end_to_end(stub_server, tmp_path):
    """`bench run --trace` against the stub: JSON with vLLM's keys, report with plots, and the
    measured hit ratio equal to the offline bound (the stub's cache is infinite)."""
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 40 * i, "input_length": 600 + 512 * (i % 4), "output_length": 128,
             "hash_ids": [0] + [100 * (i % 3) + k for k in range(1, 2 + i % 4)]}
            for i in range(24)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    rc = main(["run", "--base-url", stub_server.url, "--trace", str(trace), "--start", "2",
               "--num-requests", "20", "--length-scale", "1/32", "--time-scale", "0.5",
               "--max-concurrency", "1", "--goodput", "ttft:1000", "tpot:100",
               "--result-dir", str(out), "--result-filename", "replay.json",
               "--scrape-interval", "0.1", "--disable-tqdm"])
    assert rc == 0
    result = json.loads((out / "replay.json").read_text())
    for key in ("completed", "failed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput",
                "request_goodput", "dropped", "prefix_cache_hit_ratio",
                "offline_prefix_hit_ratio", "requests",
                *[f"{s}_{m}_ms" for s in ("mean", "median", "std", "p90", "p99")
                  for m in ("ttft", "tpot", "itl", "e2el")]):
        assert key in result, key
    assert result["completed"] == 20 and result["failed"] == 0 and result["dropped"] == 0
    assert result["model_id"] == "stub-model"            # from /v1/models
    assert result["offline_prefix_hit_ratio"] > 0.2
    assert result["prefix_cache_hit_ratio"] == pytest.approx(result["offline_prefix_hit_ratio"])
    assert set(result["prefix_cache_hit_ratio_by_tier"]) == {"device", "host"}
    assert len(result["requests"]) == 20 and result["requests"][0]["index"] == 2
    md = (out / "replay.md").read_text()
    for png in ("ttft_cdf", "tpot_cdf", "throughput", "hit_ratio"):
        path = out / f"replay_{png}.png"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.name in md


def test_cli_sweep_over_concurrency(stub_server, tmp_path):
    out = tmp_path / "sweep"
    rc = main(["sweep", "--base-url", stub_server.url, "--model", "stub-model",
               "--num-requests", "12", "--input-len", "32:64", "--output-len", "4",
               "--max-concurrencies", "1,4", "--metrics-url", "none",
               "--result-dir", str(out), "--label", "s", "--disable-tqdm"])
    assert rc == 0
    summary = next(p for p in out.glob("s-sweep-max_concurrency-*.json")
                   if "max_concurrency1" not in p.name and "max_concurrency4" not in p.name)
    points = json.loads(summary.read_text())["points"]
    assert [p["load"] for p in points] == [1, 4]
    assert all(p["completed"] == 12 for p in points)
    assert list(out.glob("*_latency_vs_load.png"))
