"""The PD decider on a real cluster (`--pd-decider threshold:N`): short prompts are prefilled on
their decode instance, long ones disaggregated, both with transformers' greedy output, and the
decisions are on /metrics. A conversation's next turn, prefilled on the decode that ran the
previous one, finds its history in that decode's own prefix cache."""

from __future__ import annotations

import os

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from pdcluster.deploy.config import ServeConfig
from pdcluster.deploy.launcher import Cluster
from pdcluster.kvstore.pool_config import KVPoolConfig
from pdcluster.deploy.serve import gateway_app
from tests.background_server import BackgroundServer
from tests.integration.test_scoring import PROMPTS, check_scores, score
from tests.integration.test_structured_outputs import NUM_REQUESTS, run_all_kinds
from tests.markers import starts

THRESHOLD = 48


@pytest.fixture(scope="module")
@starts("ray", "server")
def base_url(cluster):
    """The session cluster first (it owns the session's Ray), then ours beside it, in a
    namespace of its own."""
    config = ServeConfig(ray_num_cpus=4, cpu_bind="none", pd_decider=f"threshold:{THRESHOLD}",
                         ray_namespace=f"pdc-decider-{os.getpid()}",
                         # an index of its own: the session cluster's is on the same node
                         kvpool=KVPoolConfig(index_url=f"ray://pdc-decider-index-{os.getpid()}"))
    with Cluster(config) as cluster, BackgroundServer(gateway_app(config, cluster)) as server:
        yield server.url, cluster


def metric(base: str, name: str) -> dict[tuple, float]:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return {tuple(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name}


def complete(base: str, prompt: list[int], n: int) -> dict:
    response = httpx.post(f"{base}/v1/completions", timeout=120, json={
        "model": "stories260K", "prompt": prompt, "max_tokens": n, "temperature": 0,
        "return_token_ids": True})
    assert response.status_code == 200, response.text
    return response.json()


def test_short_prompts_stay_on_the_decode_and_long_ones_are_disaggregated(base_url, hf):
    base, cluster = base_url
    short = hf.encode("Once upon a time, there was a cat.")
    long = hf.encode("Once upon a time, there was a little girl named Lily. She loved to play "
                     "outside in the park with her friends. One day, she saw a big red ball "
                     "under a tree and ran to get it.")
    assert len(short) <= THRESHOLD < len(long)
    before = ray.get(cluster.prefill[0].handle.stats.remote()).num_requests_total
    for prompt in (short, long):
        body = complete(base, prompt, 12)
        assert body["choices"][0]["token_ids"] == hf.greedy(prompt, 12)
    after = ray.get(cluster.prefill[0].handle.stats.remote()).num_requests_total
    assert after - before == 1  # only the long one went to the prefill instance
    decisions = metric(base, "pdcluster_pd_decisions_total")
    assert decisions[(("path", "local"),)] >= 1
    assert decisions[(("path", "disaggregated"),)] >= 1


def test_the_next_turn_finds_its_history_in_the_decode_s_own_cache(base_url, hf):
    base, _ = base_url
    prompt = hf.encode("The dog ran fast.")
    first = complete(base, prompt, 24)
    reply = first["choices"][0]["token_ids"]
    follow = prompt + reply + hf.encode(" Then", add_special_tokens=False)
    assert len(follow) - (len(prompt) + len(reply) - 1) // 16 * 16 <= THRESHOLD
    second = complete(base, follow, 8)
    assert second["choices"][0]["token_ids"] == hf.greedy(follow, 8)
    # everything the first turn held in full blocks: its prompt and reply but the last token
    cached = (len(prompt) + len(reply) - 1) // 16 * 16
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == cached > 0
    hits = metric(base, "pdcluster_prefix_cache_hit_tokens_total")
    assert hits[(("tier", "device"),)] >= cached


def test_seeded_outputs_are_the_same_on_either_path(base_url, api_base, hf):
    """The same seeded request, disaggregated on the session cluster and prefilled on the
    decode here: token-identical (the sampler draws from per-(seed, step) streams)."""
    base, _ = base_url
    prompt = hf.encode("A little bird sang a song.")
    assert len(prompt) <= THRESHOLD
    body = {"model": "stories260K", "prompt": prompt, "max_tokens": 20, "temperature": 0.9,
            "seed": 7, "return_token_ids": True}
    here = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()
    there = httpx.post(f"{api_base}/completions", json=body, timeout=120).json()
    assert here["choices"][0]["token_ids"] == there["choices"][0]["token_ids"]
    decisions = metric(base, "pdcluster_pd_decisions_total")
    assert decisions[(("path", "local"),)] >= 1


def test_logprobs_agree_on_either_path(base_url, api_base, hf):
    """KV the decode computed for itself and KV a prefill computed and sent differ by fp32
    rounding at most: the logprobs of the same greedy request agree within 1e-4."""
    base, _ = base_url
    prompt = hf.encode("The moon was big and round.")
    body = {"model": "stories260K", "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "logprobs": 1, "return_token_ids": True}
    here = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()["choices"][0]
    there = httpx.post(f"{api_base}/completions", json=body, timeout=120).json()["choices"][0]
    assert here["token_ids"] == there["token_ids"] == hf.greedy(prompt, 16)
    mine, theirs = here["logprobs"]["token_logprobs"], there["logprobs"]["token_logprobs"]
    assert len(mine) == 16
    assert max(abs(a - b) for a, b in zip(mine, theirs)) < 1e-4


def test_structured_outputs_validate_when_the_decode_prefills_them(base_url):
    """tests/integration/test_structured_outputs.py's checks, on the decode-local path: every
    one of these short chat prompts is prefilled on its decode (the --pd-decider never path)."""
    base, _ = base_url
    before = metric(base, "pdcluster_pd_decisions_total")
    run_all_kinds(f"{base}/v1")
    after = metric(base, "pdcluster_pd_decisions_total")
    local = (("path", "local"),)
    assert after[local] - before.get(local, 0) == 3 * NUM_REQUESTS
    assert after.get((("path", "disaggregated"),), 0) == before.get((("path", "disaggregated"),), 0)


def test_prompt_scores_are_the_same_when_the_decode_prefills_them(base_url, hf):
    """tests/integration/test_scoring.py's check, on the decode-local path."""
    base, _ = base_url
    before = metric(base, "pdcluster_pd_decisions_total").get((("path", "local"),), 0)
    for prompt in PROMPTS[:4]:
        assert len(hf.encode(prompt)) <= THRESHOLD
        check_scores(score(f"{base}/v1", prompt), prompt, hf)
    assert metric(base, "pdcluster_pd_decisions_total")[(("path", "local"),)] - before == 4
