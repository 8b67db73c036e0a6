"""`--kv-pool mooncake-store` across two Ray nodes (`ray.cluster_utils.Cluster`) with a real
`mooncake_master`: a prefix computed by the prefill on node A is found by the prefill on node
B through the store's existence check and loaded from the store; another tenant's request
finds nothing. Node A runs prefill A and its KV store; node B prefill B, the decode worker and
its KV store. Outputs are checked against HF.
"""

from __future__ import annotations

import time

import pytest
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pdcluster.decode_worker.actor import decode_actor
from pdcluster.deploy.launcher import block_layout
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.protocol import PrefillRequest, SamplingParams
from pdcluster.kvstore.actor import start_kvstore_actor
from pdcluster.kvstore.config import KVStoreConfig
from pdcluster.kvstore.pool_config import KVPoolConfig
from pdcluster.prefill_worker.actor import prefill_actor
from tests.kvstore.mooncake_master import MooncakeMaster
from tests.markers import starts
from tests.multinode.test_kv_pool_multinode import (check_baseline, decode, hits, story_prompt,
                                                    two_node_cluster)

from tests.real_parts import MOONCAKE_HINT, import_real_part

import_real_part("mooncake.store", "Mooncake Store", MOONCAKE_HINT)

pytestmark = pytest.mark.slow

NS = "pdc-mooncake-store"


@pytest.fixture(scope="module")
@starts("ray", "server")
def nodes(tmp_path_factory):
    master = MooncakeMaster(tmp_path_factory.mktemp("mooncake"))
    master.start()
    cluster, node_of = two_node_cluster(NS)
    engine = EngineConfig(num_kv_blocks=256)
    kv = KVStoreConfig(token="mooncake-store-test-token", rpc_timeout_s=3)
    pool = KVPoolConfig(backend="mooncake-store", mooncake_master=master.address,
                        dram_cache_bytes=32 << 20)
    stores = {r: start_kvstore_actor(n, kv, pool, block_layout(engine), NS)
              for r, n in node_of.items()}
    ray.get([s.address.remote() for s in stores.values()])

    def pinned(actor_cls, resource, *args, **opts):
        return actor_cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            node_of[resource], soft=False), num_cpus=1, **opts).remote(*args)

    env = {"stores": stores,
           "prefill_a": pinned(prefill_actor(), "node_a", "prefill-a", engine, kv, pool, NS),
           "prefill_b": pinned(prefill_actor(), "node_b", "prefill-b", engine, kv, pool, NS),
           "decode": pinned(decode_actor(), "node_b", "decode-b", engine, kv, NS)}
    ray.get([env[k].stats.remote() for k in ("prefill_a", "prefill_b", "decode")])
    yield env
    ray.shutdown()
    cluster.shutdown()
    master.stop()


def prefill(worker, request_id: str, prompt: list[int], cache_salt: str | None = None):
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=1)
    _, result = worker.prefill.options(num_returns=2).remote(
        PrefillRequest(request_id, tuple(prompt), params, cache_salt=cache_salt))
    return ray.get(result)


def stored(worker, count: int, timeout_s: float = 20.0) -> None:
    """Wait until `worker` put `count` blocks into the store (after each request's params)."""
    deadline = time.monotonic() + timeout_s
    while ray.get(worker.stats.remote()).kv_connector_stats["kv_mooncake_store_puts_total"] < count:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_a_prefix_from_node_a_is_loaded_from_the_store_on_node_b(nodes, hf):
    env, prompt = nodes, story_prompt(hf, "Mooncake store.", min_tokens=200)
    want = hf.greedy(prompt, 12)
    on_a = prefill(env["prefill_a"], "ms-a", prompt)
    shared = (len(prompt) - 1) // 16 * 16
    assert on_a.num_cached_tokens == 0 and on_a.first_token == want[0]
    stored(env["prefill_a"], len(prompt) // 16)

    # another tenant: the same prompt under its salt has no block in the store
    other = prefill(env["prefill_b"], "ms-other", prompt, cache_salt="another tenant")
    assert other.num_cached_tokens == 0 and other.first_token == want[0]

    on_b = prefill(env["prefill_b"], "ms-b", prompt)  # no plan: the worker asks the store
    assert on_b.num_cached_tokens == shared and len(prompt) - shared >= 1
    assert hits(env["prefill_b"]).get("mooncake_store") == shared
    assert on_b.first_token == on_a.first_token
    assert abs(on_b.first_logprob.logprob - on_a.first_logprob.logprob) < 1e-5
    tokens, _ = decode(env, on_b, prompt)
    assert tokens == want
    check_baseline(env)
