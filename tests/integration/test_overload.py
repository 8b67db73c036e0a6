"""Overload: capacity measured in the test, then 3× that rate against a gateway with a
small in-flight bound. Only 200/429/503 answers, rejections counted by reason in /metrics, the
bound never exceeded, every worker's RSS under its configured pools + 1 GiB.

The overload phase lasts OVERLOAD_S = 60 s, as the issue asks. p99 TTFT of admitted requests is a
performance figure: printed, not asserted (admission is off here; with `--admission arrival`
tests/multinode/test_conductor_live.py checks the decision-level property).
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import numpy as np
import psutil
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from pdcluster.deploy.launcher import block_layout
from pdcluster.deploy.serve import gateway_app
from pdcluster.loadtest.arrivals import rate_arrivals
from pdcluster.loadtest.client import ClientConfig
from pdcluster.loadtest.runner import RunConfig, run_benchmark
from pdcluster.loadtest.workload import BenchRequest, Workload
from tests.background_server import BackgroundServer
from tests.markers import starts

# a load sized to this machine's capacity, measured in the test: run alone (scripts/test.sh)
pytestmark = [pytest.mark.slow, pytest.mark.exclusive]

MODEL = "stories260K"
MAX_INFLIGHT = 6
SLO_TTFT_S = 1.0          # the SLO that defines capacity (p99 TTFT)
STEP_S = 5.0              # seconds of arrivals per rate step of the capacity search
RATES = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
OVERLOAD_S = 60.0
GIB = 1 << 30


@pytest.fixture(scope="module")
@starts("server")
def overload_gateway(cluster):
    """Base URL of a gateway over the session cluster with max_inflight_requests=MAX_INFLIGHT."""
    config = cluster.config.model_copy(update={"max_inflight_requests": MAX_INFLIGHT})
    with BackgroundServer(gateway_app(config, cluster)) as server:
        yield server.url


def _workload(rate: float, duration_s: float, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    n = max(1, int(rate * duration_s))
    arrivals = rate_arrivals(n, rate, rng=rng)
    requests = [BenchRequest(i, rng.integers(3, 512, size=int(rng.integers(16, 64))).tolist(),
                             16, t) for i, t in enumerate(arrivals)]
    return Workload(requests, description=f"{n} requests at {rate:g}/s")


def _run(base: str, workload: Workload) -> dict:
    client = ClientConfig(api_url=f"{base}/v1/completions", model=MODEL, timeout_s=120)
    return asyncio.run(run_benchmark(workload, client, RunConfig(progress=False)))


def _p99_ttft(records: list[dict]) -> float:
    ttfts = [r["ttft_s"] for r in records if r["success"]]
    return float(np.percentile(ttfts, 99)) if ttfts else float("inf")


def _scrape(base: str) -> dict:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def _worker_limits(cluster) -> dict[int, tuple[str, int]]:
    """pid → (name, RSS limit in bytes): the configured pools of each actor plus 1 GiB.

    Prefill/decode: the paged KV cache (num_kv_blocks blocks of the deployment's layout).
    KV store: the node's G2 arena plus its tail-block budget.
    """
    cfg = cluster.config
    cache_bytes = cfg.engine.num_kv_blocks * block_layout(cfg.engine).nbytes
    limits = {}
    for instance in cluster.prefill + cluster.decode:
        pid = ray.get(instance.handle.info.remote())["pid"]
        limits[pid] = (instance.worker_id, cache_bytes + GIB)
    store_bytes = cfg.kvpool.dram_cache_bytes + cfg.kvstore.tail_capacity_bytes
    for node_id, handle in cluster.kvstores.items():
        pid = ray.get(handle.__ray_call__.remote(lambda _self: __import__("os").getpid()))
        limits[pid] = (f"kvstore-{node_id[:8]}", store_bytes + GIB)
    return limits


class _Sampler:
    """Samples every worker's RSS and the gateway's in-flight gauge until stopped."""

    def __init__(self, base: str, pids: list[int]) -> None:
        self.base = base
        self.procs = [psutil.Process(pid) for pid in pids]
        self.max_rss = {pid: 0 for pid in pids}
        self.max_inflight = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "_Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            for proc in self.procs:
                self.max_rss[proc.pid] = max(self.max_rss[proc.pid], proc.memory_info().rss)
            inflight = _scrape(self.base).get(
                ("pdcluster_requests_running", (("role", "gateway"),)), 0.0)
            self.max_inflight = max(self.max_inflight, inflight)


def test_three_times_capacity_only_sheds_load(cluster, overload_gateway):
    base = overload_gateway
    capacity, figures = None, []
    for step, rate in enumerate(RATES):
        result = _run(base, _workload(rate, STEP_S, seed=step))
        p99 = _p99_ttft(result["requests"])
        ok = result["failed"] == 0 and p99 <= SLO_TTFT_S
        figures.append(f"{rate:g}/s: p99 TTFT {p99:.3f} s, failed {result['failed']}")
        if not ok:
            break
        capacity = rate
    print("capacity search:", "; ".join(figures))
    # below the lowest step nothing meets the SLO on this machine: overload from that step
    capacity = capacity or RATES[0]
    overload_rate = 3 * capacity

    limits = _worker_limits(cluster)
    before = _scrape(base)
    with _Sampler(base, list(limits)) as sampler:
        result = _run(base, _workload(overload_rate, OVERLOAD_S, seed=99))
    after = _scrape(base)

    records = result["requests"]
    statuses = [r["http_status"] for r in records]
    print(f"capacity {capacity:g} req/s (p99 TTFT <= {SLO_TTFT_S} s); at {overload_rate:g} req/s "
          f"for {OVERLOAD_S:g} s: {len(records)} sent, {statuses.count(200)} admitted, "
          f"{statuses.count(503)} x 503, {statuses.count(429)} x 429; p99 TTFT of admitted "
          f"{_p99_ttft(records):.3f} s; max gateway in flight {sampler.max_inflight:g}")
    assert set(statuses) <= {200, 429, 503}, f"unexpected statuses {sorted(set(statuses))}"
    admitted = [r for r in records if r["http_status"] == 200]
    assert admitted, "no request was admitted"
    assert all(r["success"] and r["output_tokens"] == 16 for r in admitted), \
        [r["error"] for r in admitted if not r["success"]][:3]
    shed = [r for r in records if r["http_status"] == 503]
    assert all('"code": "overloaded"' in r["error"] or '"code":"overloaded"' in r["error"]
               for r in shed), [r["error"] for r in shed][:3]
    key = ("pdcluster_requests_rejected_total", (("reason", "overloaded"),))
    assert after[key] - before.get(key, 0) == len(shed)
    assert sampler.max_inflight <= MAX_INFLIGHT
    for pid, (name, limit) in limits.items():
        rss = sampler.max_rss[pid]
        print(f"{name}: max RSS {rss / GIB:.2f} GiB (limit {limit / GIB:.2f} GiB)")
        assert 0 < rss <= limit, f"{name} RSS {rss} > {limit}"


@pytest.fixture(scope="module")
@starts("server")
def unqueued_gateway(cluster):
    """As overload_gateway, with no queue behind the gate: full gate, full queue."""
    config = cluster.config.model_copy(update={"max_inflight_requests": MAX_INFLIGHT,
                                               "max_queued_sequences": 0})
    with BackgroundServer(gateway_app(config, cluster)) as server:
        yield server.url


def test_overloaded_answer_has_retry_after_and_openai_body(unqueued_gateway):
    """Fill the gate (and its queue, here of 0) with slow streams, then one more request is
    refused at once."""
    base = unqueued_gateway
    body = {"model": MODEL, "prompt": list(range(3, 40)), "max_tokens": 400,
            "ignore_eos": True, "stream": True}

    async def main() -> httpx.Response:
        async with httpx.AsyncClient(base_url=base, timeout=120) as http:
            streams = [http.stream("POST", "/v1/completions", json=body)
                       for _ in range(MAX_INFLIGHT)]
            responses = [await s.__aenter__() for s in streams]
            try:
                assert [r.status_code for r in responses] == [200] * MAX_INFLIGHT
                extra = await http.post("/v1/completions", json={**body, "stream": False})
            finally:
                for s in streams:
                    await s.__aexit__(None, None, None)
            return extra

    extra = asyncio.run(main())
    assert extra.status_code == 503
    assert int(extra.headers["retry-after"]) >= 1
    error = extra.json()["error"]
    assert error["code"] == "overloaded" and error["type"] == "service_unavailable"
