"""One KV store actor per Ray node; workers reach their own node's store over gRPC."""

import os

import pytest

ray = pytest.importorskip("ray")
import torch  # noqa: E402

from kvstore.actor import (KVSTORE_ACTOR_PREFIX, local_kvstore_address,  # noqa: E402
                           start_kvstore_actors)
from kvstore.client import KVStoreClient  # noqa: E402
from kvstore.config import KVStoreConfig  # noqa: E402
from kvstore.errors import KVStoreError  # noqa: E402
from kvstore.hashing import block_keys, make_namespace  # noqa: E402
from kvstore.host_store import BlockLayout  # noqa: E402
from kvstore.pool_config import KVPoolConfig  # noqa: E402

pytestmark = pytest.mark.slow

# Own Ray namespace: these actors must not collide with a session cluster's KV stores.
NS = "pdcluster-kvstore-test"
LAYOUT = BlockLayout("bfloat16", (2, 16, 2, 8))
POOL = KVPoolConfig(dram_cache_bytes=1 << 20, index_url=f"ray://{NS}-index")


@pytest.fixture(scope="module")
def ray_cluster():
    if ray.is_initialized():  # the session's cluster fixture already runs a local Ray
        yield
        return
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@ray.remote(num_cpus=0)
class FakeWorker:
    """Stands in for a prefill/decode worker: finds its node's store, moves KV over gRPC."""

    def node_and_address(self) -> tuple[str, str, int]:
        return ray.get_runtime_context().get_node_id(), local_kvstore_address(NS), os.getpid()

    # NOTE: test inputs/outputs ride Ray's (pickling) control plane here; the KV bytes
    # themselves go worker -> KV store -> worker over gRPC only.
    def put(self, keys: list[bytes], blocks: torch.Tensor) -> None:
        with KVStoreClient(local_kvstore_address(NS)) as client:
            client.put_blocks(keys, blocks)
            client.put_tail("req-tail", blocks[0], num_tokens=3)

    def get(self, keys: list[bytes]) -> tuple[torch.Tensor, torch.Tensor, int]:
        with KVStoreClient(local_kvstore_address(NS)) as client:
            tail, num_tokens = client.take_tail("req-tail")
            return client.get_blocks(keys), tail, num_tokens


def test_one_pinned_actor_per_node_reachable_from_workers(ray_cluster):
    actors = start_kvstore_actors(KVStoreConfig(), POOL, LAYOUT, NS)
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert set(actors) == alive
    for node_id, actor in actors.items():
        assert ray.get(actor.node_id.remote()) == node_id
        assert ray.get_actor(KVSTORE_ACTOR_PREFIX + node_id, namespace=NS) is not None
    again = start_kvstore_actors(KVStoreConfig(), POOL, LAYOUT, NS)
    assert again.keys() == actors.keys()  # idempotent

    producer, consumer = FakeWorker.remote(), FakeWorker.remote()
    node_id, address, producer_pid = ray.get(producer.node_and_address.remote())
    assert address == ray.get(actors[node_id].address.remote())
    assert address.startswith("127.0.0.1:")
    consumer_pid = ray.get(consumer.node_and_address.remote())[2]
    assert producer_pid != consumer_pid != os.getpid()

    keys = block_keys(list(range(64)), 16, make_namespace("test-model"))
    blocks = torch.randn(4, 2, 16, 2, 8).to(torch.bfloat16)
    ray.get(producer.put.remote(keys, blocks))
    got, tail, num_tokens = ray.get(consumer.get.remote(keys))
    assert torch.equal(got.view(torch.int16), blocks.view(torch.int16))
    assert torch.equal(tail.view(torch.int16), blocks[0].view(torch.int16)) and num_tokens == 3
    stats = ray.get(actors[node_id].stats.remote())
    assert stats["num_blocks"] == 4 and stats["num_tails"] == 0

    for actor in actors.values():
        ray.get(actor.stop.remote())
        ray.kill(actor)


def test_local_address_without_actor_times_out(ray_cluster):
    with pytest.raises(KVStoreError, match="no KV store actor"):
        local_kvstore_address(namespace="pdcluster-test-empty", timeout_s=0.3)


def test_wildcard_bind_advertises_node_ip(ray_cluster):
    from kvstore.actor import KVStoreActor

    actor = KVStoreActor.remote(KVStoreConfig(host="0.0.0.0"), POOL, LAYOUT)
    try:
        host, _, port = ray.get(actor.address.remote()).rpartition(":")
        assert host == ray.util.get_node_ip_address() and int(port) > 0
    finally:
        ray.get(actor.stop.remote())
        ray.kill(actor)
