"""Multi-turn load on the real cluster: the usage's cached prompt tokens, and conversations whose
later turns find their replies cached because the decode worker published them."""

import asyncio
from dataclasses import replace

import httpx

from pdcluster.loadtest.client import ClientConfig
from pdcluster.loadtest.conversations import synthetic_conversations
from pdcluster.loadtest.multiturn import run_conversations
from pdcluster.loadtest.runner import RunConfig
from pdcluster.loadtest.synthetic import parse_length
from pdcluster.loadtest.tokens import BlockTokens, TokenSpace

BS = 16


def _cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_usage_reports_the_prompt_tokens_found_cached(api_base):
    prompt = BlockTokens(TokenSpace(), seed=71).get(0, 40)
    body = {"model": "stories260K", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    with httpx.Client(base_url=api_base, timeout=60) as client:
        first = client.post("/completions", json=body).json()
        again = client.post("/completions", json=body).json()
        streamed = client.post("/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True}})
        two = client.post("/completions", json={**body, "n": 2, "seed": 1}).json()
    assert _cached(first) == 0
    # full blocks only, and the last prompt token is always computed: (40 - 1) // 16 blocks
    assert _cached(again) == (len(prompt) - 1) // BS * BS == 32
    usage_chunks = [line for line in streamed.text.splitlines() if '"usage"' in line]
    assert len(usage_chunks) == 1 and '"cached_tokens": 32' in usage_chunks[0]
    assert _cached(two) == 32          # a prompt counts once, as in prompt_tokens


def test_later_turns_hit_the_replies_the_decode_published(api_base):
    base = api_base.removesuffix("/v1")
    convs = synthetic_conversations(4, 3, parse_length("40"), parse_length("8"),
                                    parse_length("24"), TokenSpace(), seed=72)
    # a reply's blocks reach the pool shortly after its last token (the publish is off the
    # token path): a user who answers within milliseconds may find them still on their way
    think = 0.3
    convs = replace(convs, conversations=[
        replace(c, turns=(c.turns[0], *(replace(t, think_s=think) for t in c.turns[1:])))
        for c in convs.conversations])
    client = ClientConfig(api_url=f"{api_base}/completions", model="stories260K")
    run = RunConfig(metrics_url=f"{base}/metrics", progress=False, scrape_interval_s=0)
    result = asyncio.run(run_conversations(convs, client, run))
    assert result["completed"] == 12 and result["failed"] == 0
    later = next(row for row in result["turns"] if row["turn"] == "2+")
    # each turn ≥ 2 holds its previous prompt and reply, 40 + 24 - 1 ≥ 3 full blocks of 16,
    # which only the decode's publish can serve (prompt blocks alone are 2)
    assert later["offline_bound_hit_ratio"] > 0.6
    assert later["hit_vs_bound"] >= 0.9
    # the per-request reports and the cluster's Prometheus counters agree
    assert sum(r["cached_tokens"] for r in result["requests"]) == \
        result["prefix_cache_hit_tokens"]
