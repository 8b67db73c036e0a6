"""`--prefill-tp 2 --decode-tp 2` through the launcher: each instance is two Ray actors (rank 0
the worker, rank 1 a TPFollower) in one STRICT_PACK placement group, forming a gloo group.
Greedy output against HF (TP=1 equals HF in tests/engine); the prefill publishes full-head
blocks gathered from its ranks, the decode scatters them; a prefix reloaded from G2 is
scattered to the prefill's ranks; a dead follower restarts its instance as a whole.

Runs on a local one-node Ray of its own, in its own pytest process (see tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import ray

from pdcluster.deploy.config import ServeConfig
from pdcluster.deploy.launcher import Cluster
from pdcluster.engine.config import BUNDLED_MODEL
from pdcluster.engine.model_config import ModelConfig
from pdcluster.engine.protocol import SamplingParams
from tests.faults import FAULTY

pytestmark = pytest.mark.slow

STORY = ("Once upon a time, there was a little boy named Tim. Tim had a big red ball. He liked "
         "to play with it in the park every day with his friend Sue.")
LAYERS = ModelConfig.from_pretrained(BUNDLED_MODEL).num_hidden_layers


@pytest.fixture(scope="module")
def cluster(local_cluster):
    config = ServeConfig(pd_decider="always", prefill_tp=2, decode_tp=2, ray_namespace="pdc-tp")
    with local_cluster(config, FAULTY) as c:
        yield c


def generate(cluster: Cluster, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    async def one(i: int) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        return [t async for d in cluster.pipeline.generate(f"tp-{time.monotonic_ns()}-{i}",
                                                             prompts[i], params)
                for t in d.token_ids]

    async def all_of() -> list[list[int]]:
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    return asyncio.run(all_of())


def test_tp2_instances_serve_hf_greedy_output(cluster, hf):
    prompts = [hf.encode(STORY), hf.encode("Lily and Ben went to the park."),
               hf.encode("One day, a big dog")]
    assert len(prompts[0]) > 32 and len(prompts[0]) % 16  # full blocks and a tail
    expected = [hf.greedy(p, 24) for p in prompts]
    assert generate(cluster, prompts, 24) == expected
    for instance in (cluster.prefill[0], cluster.decode[0]):
        info = ray.get(instance.handle.tp_info.remote())
        ranks = info["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1] and len({r["pid"] for r in ranks}) == 2
        assert len({r["node_id"] for r in ranks}) == 1  # STRICT_PACK
        assert {r["kv_heads"] for r in ranks} == {2}  # of the model's 4
        assert info["num_all_reduces"] > 0 and info["num_all_reduces"] % (2 * LAYERS) == 0
    decode = ray.get(cluster.decode[0].handle.stats.remote())
    assert decode.kv_connector_stats["kv_bytes_fetched_total"] > 0


def test_prefix_reloaded_from_g2_is_scattered_to_the_ranks(cluster, hf):
    prompt = hf.encode(STORY + " They played all day.")
    expected = hf.greedy(prompt, 16)
    assert generate(cluster, [prompt], 16) == [expected]
    prefill = cluster.prefill[0].handle
    assert ray.get(prefill.reset_prefix_cache.remote())
    before = ray.get(prefill.stats.remote()).prefix_cache_hit_tokens_total.get("host", 0)
    assert generate(cluster, [prompt], 16) == [expected]
    after = ray.get(prefill.stats.remote()).prefix_cache_hit_tokens_total.get("host", 0)
    assert after > before  # loaded from this node's G2 arena into both ranks' heads


def test_dead_follower_restarts_the_instance_as_a_whole(cluster, hf):
    decode = cluster.decode[0].handle
    old = ray.get(decode.tp_info.remote())["ranks"]
    os.kill(old[1]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 300  # a restart re-imports torch and reloads: slow on 2 busy cores
    while True:
        try:
            new = ray.get(decode.tp_info.remote(), timeout=30)["ranks"]
            if new[0]["pid"] != old[0]["pid"]:
                break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        assert time.monotonic() < deadline, "decode instance did not restart"
        time.sleep(0.5)
    assert len(new) == 2 and not {r["pid"] for r in new} & {r["pid"] for r in old}
    prompt = hf.encode("One day, a big dog")
    assert generate(cluster, [prompt], 12) == [hf.greedy(prompt, 12)]
