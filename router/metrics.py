"""Prometheus metrics of the gateway (the field's names, vLLM's where it has
one, with a `pdcluster_` prefix).

Latency histograms and token counters are recorded here, per request. Worker-side numbers
(prefix-cache queries and hits per tier, KV blocks, KV transfer bytes, queue lengths) are pulled
from every worker's `stats()` at scrape time and summed, so /metrics covers the cluster.
Exported with prometheus_client directly (`ray.util.metrics` would prefix `ray_`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdcluster.router.conductor import InstanceRegistry
from pdcluster.router.inflight import InflightGate

if TYPE_CHECKING:
    from pdcluster.router.pipeline import MigrationStats

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
STATS_TIMEOUT_S = 2.0
#: requests whose latencies GatewayMetrics keeps for `recent`
RECENT_REQUESTS = 4096
#: `reason` labels of pdcluster_requests_rejected_total: bad input (gateway), more sequences
#: than one request may run, SLO admission (router.admission), the in-flight gate
#: (router.inflight).
KNOWN_REJECT_REASONS = ("invalid_request", "unknown_model", "body_too_large", "unavailable",
                        "too_many_sequences", "ttft_slo", "tbt_slo", "decode_kv_full",
                        "overloaded", "preempted", "draining")


class GatewayMetrics:
    """Per-request metrics recorded by the gateway, in their own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("pdcluster_time_to_first_token_seconds",
                              "Time to first token, seconds", buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pdcluster_time_per_output_token_seconds",
                              "Mean time per output token after the first, seconds, per request",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdcluster_e2e_request_latency_seconds",
                             "End-to-end request latency, seconds", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.queue_time = Histogram("pdcluster_request_queue_time_seconds",
                                    "Time a sequence waited in the gateway's fair queue for a "
                                    "slot, seconds", buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdcluster_prompt_tokens", "Prompt tokens received",
                                     registry=r)
        self.generation_tokens = Counter("pdcluster_generation_tokens", "Tokens generated",
                                         registry=r)
        self.rejected = Counter("pdcluster_requests_rejected", "Requests rejected, by reason",
                                ["reason"], registry=r)
        for reason in KNOWN_REJECT_REASONS:  # present at 0, so rate() has a series from start
            self.rejected.labels(reason=reason)
        self.recent_ttft: deque = deque(maxlen=RECENT_REQUESTS)
        self.recent_tpot: deque = deque(maxlen=RECENT_REQUESTS)

    def observe_request(self, ttft_s: float, e2e_s: float, num_output_tokens: int) -> None:
        tpot = (e2e_s - ttft_s) / (num_output_tokens - 1) if num_output_tokens > 1 else None
        self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)
        self.generation_tokens.inc(num_output_tokens)
        if tpot is not None:
            self.tpot.observe(tpot)
            self.recent_tpot.append((time.monotonic(), tpot))

    def first_token(self, ttft_s: float) -> None:
        """A request's first token came `ttft_s` after it did (kept for `recent`)."""
        self.recent_ttft.append((time.monotonic(), ttft_s))

    def recent(self, since: float) -> tuple[list[float], list[float]]:
        """(TTFTs of the first tokens, TPOTs of the requests ended) after `since`
        (time.monotonic()), seconds, of the last RECENT_REQUESTS each: what an autoscaler's
        interval measured."""
        return ([v for t, v in list(self.recent_ttft) if t > since],
                [v for t, v in list(self.recent_tpot) if t > since])


class ClusterStatsCollector:
    """Sums worker stats into Prometheus families. Use `await scrape()`, then expose."""

    def __init__(self, instances: InstanceRegistry, gate: InflightGate | None = None,
                 pd_decisions: Callable[[], Mapping[str, int]] | None = None,
                 migrations: Callable[[], MigrationStats] | None = None) -> None:
        self.instances = instances
        self.gate = gate
        self.pd_decisions = pd_decisions
        self.migrations = migrations

    async def scrape(self) -> list[Metric]:
        stats_p = await _gather_stats(self.instances.by_role("prefill"))
        stats_d = await _gather_stats(self.instances.by_role("decode"))
        stats_kv = await _gather_stats(self.instances.by_role("kvstore"))
        queried = CounterMetricFamily("pdcluster_prefix_cache_queried_tokens",
                                      "Prompt tokens looked up in the prefix cache")
        # prompts are computed by prefill workers, and on decode workers when colocated or
        # when the PD decider keeps a request there
        queried.add_metric([], sum(s.prefix_cache_queried_tokens_total
                                   for s in stats_p + stats_d))
        hits = CounterMetricFamily("pdcluster_prefix_cache_hit_tokens",
                                   "Prompt tokens served from the prefix cache, by tier",
                                   labels=["tier"])
        by_tier: dict[str, int] = {"device": 0}
        for s in stats_p + stats_d:
            for tier, n in s.prefix_cache_hit_tokens_total.items():
                by_tier[tier] = by_tier.get(tier, 0) + n
        for tier, n in sorted(by_tier.items()):
            hits.add_metric([tier], n)
        transfer = CounterMetricFamily("pdcluster_kv_transfer_bytes",
                                       "KV bytes received by decode workers, by backend "
                                       "(grpc, torch, mooncake; arena = same-node shared "
                                       "memory; layer / layer-mooncake = layer streams over "
                                       "the store / TE)",
                                       labels=["backend"])
        by_backend: dict[str, int] = {"grpc": 0}
        for s in stats_d:
            for backend, n in s.kv_connector_stats.get("kv_bytes_fetched_by_backend", {}).items():
                by_backend[backend] = by_backend.get(backend, 0) + n
        for backend, n in sorted(by_backend.items()):
            transfer.add_metric([backend], n)
        transfer_errors = CounterMetricFamily(
            "pdcluster_kv_transfer_errors", "Failed KV transfer attempts of decode workers, by "
            "backend and kind (timeout: past its deadline; error: the rest)",
            labels=["backend", "kind"])
        errors: dict[tuple[str, str], int] = {("grpc", "timeout"): 0, ("grpc", "error"): 0}
        for s in stats_d:
            for backend, kinds in s.kv_connector_stats.get("kv_transfer_errors_by_backend",
                                                           {}).items():
                for kind, n in kinds.items():
                    errors[backend, kind] = errors.get((backend, kind), 0) + n
        for (backend, kind), n in sorted(errors.items()):
            transfer_errors.add_metric([backend, kind], n)
        load_failures = CounterMetricFamily(
            "pdcluster_kv_load_failures", "KV loads that failed for good, by role and what the "
            "KV load failure policy did: recompute (silent to the client) or fail",
            labels=["role", "action"])
        for role, stats in (("prefill", stats_p), ("decode", stats_d)):
            for action in ("recompute", "fail"):
                load_failures.add_metric([role, action], sum(
                    s.kv_load_failures_total.get(action, 0) for s in stats))
        published = CounterMetricFamily(
            "pdcluster_kv_published_blocks", "Full KV blocks decode workers offered the KV pool "
            "from finished sequences (kvstore.transport.pool.publish), by outcome: stored, or "
            "failed (a later turn recomputes them)", labels=["role", "outcome"])
        published.add_metric(["decode", "stored"], sum(
            s.kv_connector_stats.get("kv_blocks_published_total", 0) for s in stats_d))
        published.add_metric(["decode", "failed"], sum(
            s.kv_connector_stats.get("kv_publish_failures_total", 0) for s in stats_d))
        blocks = GaugeMetricFamily("pdcluster_kv_blocks", "KV blocks in worker caches",
                                   labels=["tier", "state"])
        for state, count in (("free", lambda s: s.num_free_blocks),
                             ("used", lambda s: s.num_used_blocks),
                             ("cached", lambda s: s.num_cached_blocks)):
            blocks.add_metric(["device", state], sum(count(s) for s in stats_p + stats_d))
        for tier in ("host", "ssd"):
            for state in ("free", "used", "cached"):
                blocks.add_metric([tier, state], sum(s.get("tiers", {}).get(tier, {}).get(state, 0)
                                                     for s in stats_kv))
        running = GaugeMetricFamily("pdcluster_requests_running", "Requests running, by role",
                                    labels=["role"])
        running.add_metric(["decode"], sum(s.num_active for s in stats_d))
        if self.gate is not None:  # sequences the gateway has admitted and not yet finished
            running.add_metric(["gateway"], self.gate.inflight)
        waiting = GaugeMetricFamily("pdcluster_requests_waiting", "Requests waiting, by role",
                                    labels=["role"])
        waiting.add_metric(["decode"], sum(s.num_waiting for s in stats_d))
        if self.gate is not None:  # sequences in the gateway's fair queue
            waiting.add_metric(["gateway"], self.gate.queued)
        metrics = [queried, hits, transfer, transfer_errors, load_failures, published, blocks,
                   running, waiting]
        if self.pd_decisions is not None:
            decisions = CounterMetricFamily(
                "pdcluster_pd_decisions", "Requests by the PD decider's path: disaggregated "
                "(prefill instance, then KV transfer) or local (prefilled on the decode "
                "instance)", labels=["path"])
            for path, n in sorted(self.pd_decisions().items()):
                decisions.add_metric([path], n)
            metrics.append(decisions)
        if self.migrations is not None:
            metrics += _migration_families(self.migrations())
        return metrics


def _migration_families(stats: MigrationStats) -> list[Metric]:
    """router.pipeline.Pipeline.migration_stats as counters: the mean tokens a migrated
    request recomputed is the ratio of the last two."""
    migrations = CounterMetricFamily(
        "pdcluster_migrations", "Requests moved to another worker because theirs died, hung or "
        "failed them (router.pipeline)")
    migrations.add_metric([], stats.migrations_total)
    resumed = CounterMetricFamily(
        "pdcluster_migration_tokens", "Tokens (prompt + output so far) that migrated requests "
        "resumed with, by how their new worker got their KV: loaded (prefix cache, KV pool: "
        "what the old worker published) or recomputed", labels=["source"])
    resumed.add_metric(["loaded"], stats.migration_loaded_tokens_total)
    resumed.add_metric(["recomputed"], stats.migration_recomputed_tokens_total)
    return [migrations, resumed]


async def _gather_stats(instances) -> list:
    """Each instance's stats(): a worker's SchedulerStats, a KV store's dict; those that did not
    answer in time are left out."""
    async def one(instance):
        try:
            return await asyncio.wait_for(instance.handle.stats.remote(), STATS_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 — a dead or slow worker must not break /metrics
            log.warning("no stats from %s: %s", instance.worker_id, exc)
            return None

    return [s for s in await asyncio.gather(*(one(i) for i in instances)) if s is not None]


class _Families:
    """One scrape's families as a prometheus_client Collector, which generate_latest reads."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


def exposition(gateway: GatewayMetrics, cluster_families: list[Metric]) -> bytes:
    """The Prometheus text format of the gateway's metrics plus a cluster scrape."""
    return generate_latest(gateway.registry) + generate_latest(_Families(cluster_families))
