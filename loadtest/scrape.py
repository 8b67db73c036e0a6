"""Prefix-cache counters from the server's Prometheus `/metrics`.

pdcluster exports
    pdcluster_prefix_cache_queried_tokens_total            prompt tokens looked up
    pdcluster_prefix_cache_hit_tokens_total{tier="..."}    of those, served from tier
                                                           (device, host, ssd, remote)
and `pdcluster_kv_transfer_bytes_total{backend="..."}`, the KV bytes decode workers received.
The measured hit ratio of a run is Δhit / Δqueried between a scrape before the first request
and one after the last, overall (hits summed over tiers) and per tier; a sampler also scrapes
every few seconds for the hit ratio over time. Counters are summed over any other labels (e.g.
one series per instance). An endpoint without the queried counter — another server, or
pdcluster before its metrics exist — yields None, and the result reports null.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

QUERIED = "pdcluster_prefix_cache_queried_tokens"
HIT = "pdcluster_prefix_cache_hit_tokens"
TRANSFER_BYTES = "pdcluster_kv_transfer_bytes"


@dataclass(frozen=True)
class CacheCounters:
    """One scrape: `t_s` seconds after the benchmark start; token counts since server start."""

    t_s: float
    queried: float
    hit_by_tier: dict[str, float] = field(default_factory=dict)
    transfer_bytes_by_backend: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"t_s": self.t_s, "queried": self.queried, "hit_by_tier": self.hit_by_tier,
                "transfer_bytes_by_backend": self.transfer_bytes_by_backend}


def parse_counters(text: str, t_s: float = 0.0) -> CacheCounters | None:
    """The prefix-cache counters in a Prometheus text exposition; None without the queried one.

    Raises:
        ValueError: the text is not Prometheus text format.
    """
    queried: float | None = None
    hits: dict[str, float] = {}
    transfer: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if sample.name.endswith("_created"):
                continue
            if name == QUERIED:
                queried = (queried or 0.0) + sample.value
            elif name == HIT:
                tier = sample.labels.get("tier", "all")
                hits[tier] = hits.get(tier, 0.0) + sample.value
            elif name == TRANSFER_BYTES:
                backend = sample.labels.get("backend", "all")
                transfer[backend] = transfer.get(backend, 0.0) + sample.value
    if queried is None:
        return None
    return CacheCounters(t_s=t_s, queried=queried, hit_by_tier=hits,
                         transfer_bytes_by_backend=transfer)


async def scrape(session: aiohttp.ClientSession, metrics_url: str, t_s: float = 0.0,
                 timeout_s: float = 10.0) -> CacheCounters | None:
    """GET `metrics_url` and parse it; None when unreachable, not 200, or without counters."""
    try:
        async with asyncio.timeout(timeout_s):
            async with session.get(metrics_url) as response:
                if response.status != 200:
                    return None
                text = await response.text()
        return parse_counters(text, t_s)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return None


def hit_ratios(before: CacheCounters | None, after: CacheCounters | None) -> dict:
    """Δhit/Δqueried between two scrapes: {"overall", "by_tier", "queried_tokens",
    "hit_tokens"}; ratios None when either scrape is missing, nothing was queried, or a
    counter went backwards (server restart)."""
    empty = {"overall": None, "by_tier": None, "queried_tokens": None, "hit_tokens": None}
    if before is None or after is None:
        return empty
    d_queried = after.queried - before.queried
    d_hit = {t: v - before.hit_by_tier.get(t, 0.0) for t, v in after.hit_by_tier.items()}
    if d_queried <= 0 or any(v < 0 for v in d_hit.values()):
        return {**empty, "queried_tokens": max(d_queried, 0.0)}
    return {"overall": sum(d_hit.values()) / d_queried,
            "by_tier": {t: v / d_queried for t, v in sorted(d_hit.items())},
            "queried_tokens": d_queried, "hit_tokens": sum(d_hit.values())}


def transfer_bytes(before: CacheCounters | None, after: CacheCounters | None) -> float | None:
    """KV bytes decode workers received between two scrapes, summed over backends; None when
    either scrape is missing or a counter went backwards."""
    if before is None or after is None:
        return None
    moved = {b: v - before.transfer_bytes_by_backend.get(b, 0.0)
             for b, v in after.transfer_bytes_by_backend.items()}
    return None if any(v < 0 for v in moved.values()) else sum(moved.values())


class CounterSampler:
    """Scrapes every `interval_s` in the background until stopped; keeps successful scrapes."""

    def __init__(self, session: aiohttp.ClientSession, metrics_url: str, t0: float,
                 interval_s: float) -> None:
        self._session, self._url, self._t0, self._interval = session, metrics_url, t0, interval_s
        self.samples: list[CacheCounters] = []
        self._task: asyncio.Task | None = None

    async def sample_now(self) -> CacheCounters | None:
        counters = await scrape(self._session, self._url, time.perf_counter() - self._t0)
        if counters is not None:
            self.samples.append(counters)
        return counters

    def start(self) -> None:
        if self._interval > 0:
            self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.sample_now()
