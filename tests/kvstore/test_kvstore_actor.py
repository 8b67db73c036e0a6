"""One KV store actor per Ray node; workers reach their own node's store over gRPC."""

import os
import signal
import sys
import time

import pytest

from tests.real_parts import import_real_part

ray = import_real_part("ray", "Ray")
import torch  # noqa: E402

from pdcluster.kvstore.actor import (KVSTORE_ACTOR_PREFIX, kvstore_actor,  # noqa: E402
                           start_kvstore_actors)
from pdcluster.kvstore.client import KVStoreClient  # noqa: E402
from pdcluster.kvstore.config import KVStoreConfig  # noqa: E402
from pdcluster.kvstore.errors import KVStoreError, KVTransferError  # noqa: E402
from pdcluster.engine.core.hashing import block_keys, make_namespace  # noqa: E402
from pdcluster.kvstore.index import Location, open_index  # noqa: E402
from pdcluster.kvstore.layout import BlockLayout  # noqa: E402
from pdcluster.kvstore.node_store import HOST  # noqa: E402
from pdcluster.kvstore.pool_config import KVPoolConfig  # noqa: E402
from tests.faults import FaultyKVStoreActor  # noqa: E402

pytestmark = pytest.mark.slow

# Own Ray namespace: these actors must not collide with a session cluster's KV stores.
NS = "pdcluster-kvstore-test"
LAYOUT = BlockLayout("bfloat16", (2, 16, 2, 8))
POOL = KVPoolConfig(dram_cache_bytes=1 << 20, index_url=f"ray://{NS}-index")


def local_kvstore_address(namespace: str | None = None, timeout_s: float = 30.0) -> str:
    """Address of the KV store actor on the caller's own Ray node. Raises KVStoreError."""
    return ray.get(kvstore_actor(None, namespace, timeout_s).address.remote(), timeout=timeout_s)


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
        assert ray.get(actor.stats.remote())["node_id"] == node_id
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
    # the store moves bytes only: its process never loads torch (a server starts sooner)
    assert ray.get(actors[node_id].__ray_call__.remote(
        lambda self: sorted({"torch", "numpy"} & sys.modules.keys()))) == []

    for actor in actors.values():
        ray.get(actor.stop.remote())
        ray.kill(actor)


def test_local_address_without_actor_times_out(ray_cluster):
    with pytest.raises(KVStoreError, match="no KV store actor"):
        local_kvstore_address(namespace="pdcluster-test-empty", timeout_s=0.3)


def test_wildcard_bind_advertises_node_ip(ray_cluster):
    from pdcluster.kvstore.actor import kvstore_actor_class

    actor = kvstore_actor_class().remote(KVStoreConfig(host="0.0.0.0"), POOL, LAYOUT)
    try:
        host, _, port = ray.get(actor.address.remote()).rpartition(":")
        assert host == ray.util.get_node_ip_address() and int(port) > 0
    finally:
        ray.get(actor.stop.remote())
        ray.kill(actor)


def test_faults_are_injected_only_into_the_test_subclass(ray_cluster):
    """The serving store has no inject_fault; tests/faults.py's subclass stops serving on
    demand, and refuses a fault it does not know."""
    from pdcluster.kvstore.actor import kvstore_actor_class
    from tests.faults import FaultyKVStoreActor

    serving = kvstore_actor_class().remote(KVStoreConfig(), POOL, LAYOUT)
    faulty = kvstore_actor_class(FaultyKVStoreActor).remote(KVStoreConfig(), POOL, LAYOUT)
    try:
        with pytest.raises(AttributeError):
            serving.inject_fault
        with KVStoreClient(ray.get(serving.address.remote()), timeout_s=5) as client:
            assert client.stats()["num_blocks"] == 0  # serving
        with pytest.raises(ValueError, match="unknown fault"):
            ray.get(faulty.inject_fault.remote("reboot"))
        address = ray.get(faulty.address.remote())
        ray.get(faulty.inject_fault.remote("stop_serving"))
        with KVStoreClient(address, timeout_s=2) as client:
            with pytest.raises(KVTransferError):
                client.stats()
    finally:
        for actor in (serving, faulty):
            ray.get(actor.stop.remote())
            ray.kill(actor)


@ray.remote(num_cpus=0)
class ArenaWorker:
    """A same-node worker moving blocks through its node's arena (kvstore.node_client)."""

    def __init__(self):
        from pdcluster.kvstore.actor import kvstore_actor
        from pdcluster.kvstore.node_client import NodeStoreClient

        self.client = NodeStoreClient(kvstore_actor(None, NS), timeout_s=60.0)

    def put(self, keys: list[bytes], blocks: torch.Tensor) -> list[bool]:
        self.client.put(keys, blocks)
        return self.client.exists(keys)

    def get(self, keys: list[bytes]) -> tuple[torch.Tensor, list, int]:
        out = torch.zeros((len(keys), *LAYOUT.shape), dtype=torch.bfloat16)
        tiers = self.client.get(keys, out)
        return out, tiers, self.client.reattachments


def test_killed_store_restarts_empty_at_its_address_and_workers_reattach(ray_cluster):
    """kill -9 a node's KV store: Ray restarts it empty on the same port, its G2 locations
    leave the index, a worker's next read re-attaches to the new arena and misses (never the
    dead arena's bytes), and publishing and gRPC fetches work again."""
    node_id = ray.get_runtime_context().get_node_id()
    pool = POOL.model_copy(update={"index_url": f"ray://{NS}-restart-index"})
    index = open_index(pool.index_url)  # created by the driver, as the launcher does: an
    # index actor lives as long as the process that created it
    actor = start_kvstore_actors(KVStoreConfig(), pool, LAYOUT, NS, node_ids=[node_id],
                                 actor_cls=FaultyKVStoreActor)[node_id]
    try:
        address, pid = ray.get(actor.address.remote()), ray.get(actor.pid.remote())
        worker = ArenaWorker.remote()
        keys = block_keys(list(range(64)), 16, make_namespace("restart-test"))
        blocks = torch.randn(4, *LAYOUT.shape).to(torch.bfloat16)
        assert ray.get(worker.put.remote(keys, blocks)) == [True] * 4
        assert all(Location(node_id, HOST) in locs for locs in index.lookup(keys))

        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            try:
                if ray.get(actor.pid.remote(), timeout=10) != pid:
                    break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
            assert time.monotonic() < deadline, "the KV store actor was not restarted"
            time.sleep(0.2)
        assert ray.get(actor.address.remote()) == address
        assert not any(Location(node_id, HOST) in locs for locs in index.lookup(keys))

        _, tiers, reattachments = ray.get(worker.get.remote(keys))
        assert tiers == [None] * 4 and reattachments == 1
        assert ray.get(worker.put.remote(keys, blocks)) == [True] * 4
        got, tiers, reattachments = ray.get(worker.get.remote(keys))
        assert tiers == [HOST] * 4 and reattachments == 1
        assert torch.equal(got.view(torch.int16), blocks.view(torch.int16))
        with KVStoreClient(address, timeout_s=10.0) as client:  # same address, new server
            assert torch.equal(client.get_blocks(keys).view(torch.int16),
                               blocks.view(torch.int16))
    finally:
        ray.get(actor.stop.remote())
        ray.kill(actor)
