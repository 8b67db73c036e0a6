"""Runs a workload against an endpoint and assembles the result JSON.

One run: scrape `/metrics`, send every request at its arrival time (at most `max_concurrency`
in flight when set; later arrivals wait client-side, as in vLLM), wait for all, scrape again,
then compute the vLLM-compatible metrics, the measured and offline prefix-cache hit ratios and
the per-request records. `duration` runs from the first send slot to the last reply, as vLLM's
`benchmark_duration`. A sweep is a list of runs, one per request rate or concurrency.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from tqdm import tqdm

from pdcluster.loadtest.client import ClientConfig, RequestRecord, send_request
from pdcluster.loadtest.metrics import compute_metrics
from pdcluster.loadtest.prefix import offline_prefix_hits
from pdcluster.loadtest.scrape import CacheCounters, CounterSampler, hit_ratios, scrape
from pdcluster.loadtest.workload import BenchRequest, Workload


@dataclass(frozen=True)
class RunConfig:
    """How to drive one run.

    Attributes:
        max_concurrency: most requests in flight (None: unlimited).
        goodput_slos_ms: SLOs for `request_goodput`, e.g. {"ttft": 500, "tpot": 50}.
        percentiles: percentiles reported for every latency metric.
        metrics_url: the server's Prometheus endpoint; None to skip scraping.
        scrape_interval_s: period of the hit-ratio-over-time scrapes (0: start and end only).
        block_size: the server's KV block size, for the offline hit ratio.
        hit_denominator: "prompt" or "full_blocks" (see loadtest.prefix).
        hit_cap_last_token: cap offline hits so the last prompt token is computed (vLLM).
        progress: show a progress bar.
    """

    max_concurrency: int | None = None
    goodput_slos_ms: dict = field(default_factory=dict)
    percentiles: tuple[float, ...] = (90, 99)
    metrics_url: str | None = None
    scrape_interval_s: float = 2.0
    block_size: int = 16
    hit_denominator: str = "prompt"
    hit_cap_last_token: bool = True
    progress: bool = True


async def run_benchmark(workload: Workload, client: ClientConfig, run: RunConfig,
                        metadata: dict | None = None) -> dict:
    """Run `workload` and return the result dict (see README "pdcluster bench")."""
    measured = await measured_run(run, lambda session, t0: _dispatch(
        session, workload.requests, client, run, t0))
    return _result(workload, client, run, measured.value, measured.duration, measured.before,
                   measured.after, measured.samples,
                   {"started_at": measured.started_at, **(metadata or {})})


@dataclass
class MeasuredRun:
    """What `measured_run` returns: the body's value, its duration (s) and the /metrics
    scrapes before, after and in between (None / empty without a metrics URL)."""

    value: object
    duration: float
    before: CacheCounters | None
    after: CacheCounters | None
    samples: list[CacheCounters]
    #: time.time() at t0: where the requests' start_s offsets begin, on the wall clock
    started_at: float = 0.0


#: how long an idle connection is kept for reuse: well under uvicorn's `timeout_keep_alive`
#: (5 s, vLLM's and SGLang's default), so the client never sends on a connection the server is
#: closing, even when a loaded machine reads the end of a response a second or more after it
#: was sent (after a burst, all the connections it opened go idle, and are closed, at once;
#: the pool hands out the oldest first)
KEEPALIVE_S = 2.0


async def measured_run(run: RunConfig, body) -> MeasuredRun:
    """Runs `await body(session, t0)` in an HTTP session (at most `run.max_concurrency`
    connections), between a /metrics scrape before and one after, with the sampler scraping
    every `run.scrape_interval_s` meanwhile. `t0` is the start on the perf_counter clock."""
    connector = aiohttp.TCPConnector(limit=run.max_concurrency or 0, force_close=False,
                                     keepalive_timeout=KEEPALIVE_S)
    async with aiohttp.ClientSession(connector=connector, trust_env=False,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        before = await scrape(session, run.metrics_url) if run.metrics_url else None
        t0, started_at = time.perf_counter(), time.time()
        sampler = CounterSampler(session, run.metrics_url or "", t0, run.scrape_interval_s)
        if before is not None:
            sampler.samples.append(before)
            sampler.start()
        value = await body(session, t0)
        duration = time.perf_counter() - t0
        after = None
        if before is not None:
            await sampler.stop()
            after = await sampler.sample_now()
    return MeasuredRun(value, duration, before, after, sampler.samples, started_at)


async def _dispatch(session: aiohttp.ClientSession, requests: list[BenchRequest],
                    client: ClientConfig, run: RunConfig, t0: float) -> list[RequestRecord]:
    limiter = (asyncio.Semaphore(run.max_concurrency) if run.max_concurrency
               else contextlib.nullcontext())
    bar = tqdm(total=len(requests), disable=not run.progress, unit="req", dynamic_ncols=True)

    async def one(request: BenchRequest) -> RequestRecord:
        async with limiter:
            record = await send_request(session, client, request, t0)
        bar.update(1)
        if not record.success:
            bar.set_postfix_str(f"last error: {record.error[:60]}", refresh=False)
        return record

    tasks: list[asyncio.Task] = []
    try:
        for request in requests:
            delay = t0 + request.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(request)))
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        bar.close()


def _result(workload: Workload, client: ClientConfig, run: RunConfig,
            records: list[RequestRecord], duration: float, before, after, samples,
            metadata: dict) -> dict:
    metrics = compute_metrics(records, duration, run.goodput_slos_ms or None, run.percentiles)
    offline = offline_prefix_hits((r.prompt for r in workload.requests), run.block_size,
                                  run.hit_denominator, run.hit_cap_last_token)
    measured = hit_ratios(before, after)
    requests = []
    for record, hit, queried in zip(records, offline.hit, offline.queried):
        row = record.to_json()
        row["offline_prefix_hit_tokens"] = hit
        row["offline_prefix_queried_tokens"] = queried
        requests.append(row)
    return {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai",
        "api_url": client.api_url,
        "model_id": client.model,
        "workload": workload.description,
        "workload_params": workload.params,
        "num_prompts": len(workload.requests),
        "max_concurrency": run.max_concurrency,
        "goodput_slos_ms": run.goodput_slos_ms or None,
        **metadata,
        **metrics,
        "dropped": workload.dropped,
        "prefix_cache_hit_ratio": measured["overall"],
        "prefix_cache_hit_ratio_by_tier": measured["by_tier"],
        "prefix_cache_queried_tokens": measured["queried_tokens"],
        "prefix_cache_hit_tokens": measured["hit_tokens"],
        "offline_prefix_hit_ratio": offline.ratio,
        "offline_prefix_hit_definition": {"block_size": run.block_size,
                                          "denominator": run.hit_denominator,
                                          "cap_last_token": run.hit_cap_last_token},
        "prefix_cache_timeline": [s.to_json() for s in samples] if samples else None,
        "requests": requests,
    }


def rate_label(rate: float) -> float | str:
    """vLLM writes an infinite request rate as the string "inf" in the JSON."""
    return "inf" if math.isinf(rate) else rate


def save_json(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


def sweep_rows(results: list[dict], axis: str) -> list[dict]:
    """One row per sweep point: the load setting and its headline metrics (no request list)."""
    return [{"load": r.get(axis), **{k: v for k, v in r.items()
                                     if k not in ("requests", "prefix_cache_timeline")}}
            for r in results]
