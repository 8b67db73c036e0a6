"""/metrics of a real cluster's gateway: every DESIGN.md metric name
is exported, worker numbers are summed over all workers, and the Grafana dashboard
(deploy/grafana/pdcluster-dashboard.json) queries only names that are exported, with a panel
for each topic the issue lists."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "pdcluster-dashboard.json"
DESIGN = REPO.parent / "shared" / "DESIGN.md"  # the workspace's design page, when present

#: DESIGN.md "Decisions / Metrics", name → its labels.
DESIGN_METRICS = {
    "pdcluster_time_to_first_token_seconds": (),
    "pdcluster_time_per_output_token_seconds": (),
    "pdcluster_e2e_request_latency_seconds": (),
    "pdcluster_prompt_tokens_total": (),
    "pdcluster_generation_tokens_total": (),
    "pdcluster_prefix_cache_queried_tokens_total": (),
    "pdcluster_prefix_cache_hit_tokens_total": ("tier",),
    "pdcluster_kv_transfer_bytes_total": ("backend",),
    "pdcluster_requests_rejected_total": ("reason",),
    "pdcluster_kv_blocks": ("tier", "state"),
    "pdcluster_requests_running": ("role",),
    "pdcluster_requests_waiting": ("role",),
}
#: Dashboard topics → a word its panel title must contain.
TOPICS = {"TTFT": "TTFT", "TPOT": "TPOT", "throughput": "Throughput",
          "hit ratio per tier": "hit ratio per tier", "KV transfer rate": "KV transfer",
          "queues": "Queues", "rejections": "Rejections", "gateway queue time": "queue time"}
PROMQL_WORDS = {"by", "without", "sum", "rate", "irate", "increase", "histogram_quantile",
                "scalar", "avg", "max", "min", "count", "on", "ignoring", "and", "or", "unless",
                "bool", "offset", "le"}


@pytest.fixture(scope="module")
def samples(api_base, http) -> list:
    assert http.post("/completions", json={"model": "stories260K", "prompt": "Once upon a",
                                           "max_tokens": 4}).status_code == 200
    text = httpx.get(api_base.removesuffix("/v1") + "/metrics", timeout=10).text
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


@pytest.fixture(scope="module")
def http(api_base):
    with httpx.Client(base_url=api_base, timeout=60) as client:
        yield client


def test_every_design_metric_is_exported_with_its_labels(samples):
    if DESIGN.exists():  # the list above is DESIGN.md's, exactly
        listed = set(re.findall(r"`(pdcluster_[a-z0-9_]+)(?:\{[^}]*\})?`", DESIGN.read_text()))
        assert listed == set(DESIGN_METRICS)
    for name, labels in DESIGN_METRICS.items():
        found = [s for s in samples if s.name in (name, f"{name}_count")]
        assert found, f"{name} missing from /metrics"
        assert all(set(labels) <= set(s.labels) for s in found), (name, found[:2])


def _scrape(api_base: str) -> dict:
    text = httpx.get(api_base.removesuffix("/v1") + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_worker_gauges_are_summed_over_every_worker(cluster, api_base, samples):
    """Independent reference: each worker's own stats(), summed here (taken while the
    cluster is idle: stats unchanged before and after the scrape)."""
    workers = cluster.prefill + cluster.decode
    assert {i.role for i in workers} == {"prefill", "decode"}

    def free_blocks() -> int:
        return sum(s.num_free_blocks
                   for s in ray.get([i.handle.stats.remote() for i in workers]))

    for _ in range(10):
        before, scraped, after = free_blocks(), _scrape(api_base), free_blocks()
        if before == after:
            break
    key = ("pdcluster_kv_blocks", (("state", "free"), ("tier", "device")))
    assert before == after and scraped[key] == before


def _metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers outside {matchers}, [ranges] and
    by/without (...) label lists, that are not functions or PromQL words."""
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", " ", expr)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        word = m.group()
        if word in PROMQL_WORDS or expr[m.end():].lstrip().startswith("("):
            continue
        names.add(word)
    return names


def test_dashboard_queries_only_exported_metrics_and_covers_every_topic(samples):
    dashboard = json.loads(DASHBOARD.read_text())
    exported = {s.name for s in samples}
    panels = dashboard["panels"]
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = _metric_names(target["expr"])
            assert names, target["expr"]
            assert names <= exported, (panel["title"], names - exported)
    titles = [p["title"] for p in panels]
    for topic, word in TOPICS.items():
        assert any(word in t for t in titles), f"no panel for {topic}"


def test_metric_name_extraction_sees_selectors_only():
    assert _metric_names('histogram_quantile(0.99, sum by (le) (rate(a_bucket{x="y"}[5m])))'
                         ) == {"a_bucket"}
    assert _metric_names("sum by (tier) (rate(b[1m])) / scalar(sum(rate(c[1m])))") == {"b", "c"}
