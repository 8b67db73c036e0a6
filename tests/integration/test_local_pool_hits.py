"""Where the PD decider runs a request does not change what it can reuse: on 2 prefill + 2
decode instances with the default `--pd-decider cost`, a multi-turn chat hits, in turns ≥ 2,
every full block that earlier prompts and replies left cached (what `--pd-decider always`
hits), with turns prefilled on a prefill or kept local on a decode. A decode that never saw a
conversation loads it from the pool (tests/integration/test_decode_prefix_cache.py shows that
path on its own); the hits by tier are printed."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdcluster.deploy.config import ServeConfig
from pdcluster.deploy.launcher import Cluster
from pdcluster.deploy.serve import gateway_app
from pdcluster.kvstore.pool_config import KVPoolConfig
from pdcluster.loadtest.client import ClientConfig
from pdcluster.loadtest.conversations import synthetic_conversations
from pdcluster.loadtest.multiturn import run_conversations
from pdcluster.loadtest.runner import RunConfig
from pdcluster.loadtest.synthetic import parse_length
from pdcluster.loadtest.tokens import TokenSpace
from tests.background_server import BackgroundServer
from tests.markers import starts


@pytest.fixture(scope="module")
@starts("ray", "server")
def base_url(cluster):
    """The session cluster first (it owns the session's Ray), then ours beside it, in a
    namespace of its own with an index of its own."""
    config = ServeConfig(ray_num_cpus=4, actor_num_cpus=0.1, cpu_bind="none",
                         prefill_instances=2, decode_instances=2, ray_namespace=f"pdc-local-pool-{os.getpid()}",
                         kvpool=KVPoolConfig(index_url=f"ray://pdc-local-pool-{os.getpid()}"))
    assert config.pd_decider == "cost"  # the default is what is tested
    with Cluster(config) as cluster, BackgroundServer(gateway_app(config, cluster)) as server:
        yield server.url


def samples(base: str, name: str) -> dict[tuple, float]:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return {tuple(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name}


def test_turns_kept_local_hit_what_the_pool_holds(base_url):
    convs = synthetic_conversations(6, 4, parse_length("40"), parse_length("8"),
                                    parse_length("24"), TokenSpace(), seed=73)
    # a reply's blocks reach the pool shortly after its last token (the publish is off the
    # token path): the user answers after a short think
    convs = replace(convs, conversations=[
        replace(c, turns=(c.turns[0], *(replace(t, think_s=0.3) for t in c.turns[1:])))
        for c in convs.conversations])
    client = ClientConfig(api_url=f"{base_url}/v1/completions", model="stories260K")
    # one request at a time, the conversations' turns alternating
    run = RunConfig(metrics_url=f"{base_url}/metrics", progress=False, scrape_interval_s=0,
                    max_concurrency=1)
    result = asyncio.run(run_conversations(convs, client, run))
    assert result["completed"] == 24 and result["failed"] == 0
    later = next(row for row in result["turns"] if row["turn"] == "2+")
    decisions = samples(base_url, "pdcluster_pd_decisions_total")
    hits = samples(base_url, "pdcluster_prefix_cache_hit_tokens_total")
    print(f"turns >= 2: hit ratio {later['hit_ratio']:.3f}, bound "
          f"{later['offline_bound_hit_ratio']:.3f}; decisions {decisions}; hits by tier {hits}")
    assert decisions[(("path", "local"),)] >= 1
    assert later["offline_bound_hit_ratio"] > 0.6
    assert later["hit_vs_bound"] == pytest.approx(1.0, abs=1e-9)
    assert sum(hits.values()) >= later["cached_tokens"]
