"""Index loss: a heartbeat tells whether the index still knew the node's lease, and a
node's KV store re-announces its blocks when it did not (a Redis restarted empty)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

from pdcluster.engine.core.hashing import block_keys, make_namespace
from pdcluster.kvstore.index import KVIndex, Location, MemoryIndex, open_index
from tests.engine_loops import started, stop
from tests.handoffs import handoff


def make_keys(num_blocks: int) -> list[bytes]:
    return block_keys(list(range(16 * num_blocks)), 16, make_namespace("reannounce-test"))


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_memory_heartbeat_reports_whether_the_lease_was_running():
    clock = Clock()
    index = MemoryIndex(clock=clock)
    assert index.heartbeat("n", 5.0) is False  # never seen
    clock.t += 4.9
    assert index.heartbeat("n", 5.0) is True
    clock.t += 5.1
    assert index.heartbeat("n", 5.0) is False  # lease ran out
    index.clear()
    assert index.heartbeat("n", 5.0) is False  # index lost its contents


def test_redis_heartbeat_reports_whether_the_lease_was_running(fresh_redis_server):
    with open_index(fresh_redis_server.url, namespace=f"t-{uuid.uuid4().hex[:8]}") as index:
        assert index.heartbeat("n", 0.3) is False
        assert index.heartbeat("n", 0.3) is True
        time.sleep(0.4)
        assert index.heartbeat("n", 30.0) is False  # expired
        assert index.heartbeat("n", 30.0) is True
        fresh_redis_server.restart(kill=True)  # back on the same port, empty
        assert index.heartbeat("n", 30.0) is False


@pytest.mark.slow
@pytest.mark.ray
def test_kv_store_reannounces_its_blocks_after_redis_restarts_empty(fresh_redis_server):
    from tests.real_parts import import_real_part

    ray = import_real_part("ray", "Ray")
    from pdcluster.kvstore.actor import start_kvstore_actors
    from pdcluster.kvstore.client import KVStoreClient
    from pdcluster.kvstore.config import KVStoreConfig
    from pdcluster.kvstore.layout import BlockLayout
    from pdcluster.kvstore.pool_config import KVPoolConfig

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    ns = f"reannounce-{uuid.uuid4().hex[:8]}"
    layout = BlockLayout("float32", (2, 2, 16, 2, 4))
    pool = KVPoolConfig(dram_cache_bytes=1 << 20, index_url=fresh_redis_server.url,
                        node_lease_s=1.5)
    actors = start_kvstore_actors(KVStoreConfig(), pool, layout, ns)
    try:
        [(node_id, actor)] = list(actors.items())[:1]
        keys = make_keys(4)
        with KVStoreClient(ray.get(actor.address.remote())) as client:
            client.put_blocks(keys, torch.randn(4, *layout.shape))
        index: KVIndex = open_index(fresh_redis_server.url)
        host = Location(node_id, "host")
        assert index.longest_prefix(keys) == [[host]] * 4

        fresh_redis_server.restart(kill=True)  # empty: no persistence
        assert index.longest_prefix(keys) == []  # a miss (recompute), not an error
        deadline = time.monotonic() + 10
        while index.longest_prefix(keys) != [[host]] * 4:  # the heartbeat loop's doing
            assert time.monotonic() < deadline, "blocks were not re-announced"
            time.sleep(0.1)
        stats = ray.get(actor.stats.remote())
        assert stats["index_reannouncements"] >= 2 and stats["index_reannounced_blocks"] >= 4
        index.close()
    finally:
        for handle in actors.values():
            ray.get(handle.stop.remote())
            ray.kill(handle)
        if started:
            ray.shutdown()


def test_prefill_worker_reannounces_its_g1_blocks_after_redis_restarts_empty(
        fresh_redis_server, monkeypatch):
    """A prefill worker's G1 (device) entries come back too: the engine's next check after the
    loss (a step, busy or idle) finds one cached key missing from the index and announces all
    of them again, once."""
    from pdcluster.prefill_worker.instance import prefill as run_prefill, prefill_core
    from pdcluster.kvstore.index import device_feed
    from pdcluster.engine.config import BUNDLED_MODEL, EngineConfig
    from pdcluster.engine.protocol import PrefillRequest, SamplingParams
    from pdcluster.engine.runner import ModelRunner
    from pdcluster.kvstore.client import KVStoreClient
    from pdcluster.kvstore.config import KVStoreConfig
    from pdcluster.kvstore.transport.pool.connector import PoolConnector
    from tests.kvstore.lru_block_store import lru_server

    monkeypatch.setattr(device_feed, "INDEX_CHECK_S", 0.0)
    server = lru_server(KVStoreConfig())
    server.start()
    client = KVStoreClient(server.address)
    index = open_index(fresh_redis_server.url, namespace=f"t-{uuid.uuid4().hex[:8]}")
    pool = PoolConnector("node-x", client, server.address, client)
    engine = started(lambda: prefill_core(
        ModelRunner(EngineConfig(model=str(BUNDLED_MODEL), num_kv_blocks=64)), pool, "p-0", 0,
        index, "node-x"))
    mine = Location("node-x", "device", "p-0")
    params = SamplingParams(max_tokens=1, temperature=0)
    try:
        index.heartbeat("node-x", 30.0)
        first = run_prefill(engine, PrefillRequest("r1", tuple(range(5, 45)), params))
        assert all(mine in locs for locs in index.lookup(list(handoff(first).block_keys)))
        # the engine loop held while Redis restarts: an idle loop checks the index too
        held, release = threading.Event(), threading.Event()
        engine.call_soon(lambda: (held.set(), release.wait(60)))
        assert held.wait(30)
        fresh_redis_server.restart(kill=True)  # back on the same port, empty
        index.heartbeat("node-x", 30.0)
        assert index.lookup(list(handoff(first).block_keys)) == [[], []]
        release.set()
        run_prefill(engine, PrefillRequest("r2", tuple(range(100, 120)), params))
        assert all(mine in locs for locs in index.lookup(list(handoff(first).block_keys)))
        assert engine.stats().g1_reannouncements_total == 1
        run_prefill(engine, PrefillRequest("r3", tuple(range(200, 220)), params))
        assert engine.stats().g1_reannouncements_total == 1  # nothing lost since
    finally:
        stop(engine)
        for r in ("r1", "r2", "r3"):
            client.release_tail(f"tail:{r}")
        index.close()
        client.close()
        server.stop()
