"""The node store facade (kvstore.node_store_api): one put/get/exists/remove/pin script, run
against a node's store reached both ways, gets the same answers: the same-node client (a real
KVStoreActor on Ray, bytes through its shared-memory arena) and the gRPC client (a real
KVStoreServer over a TieredNodeStore)."""

from __future__ import annotations

import pytest
import torch

from pdcluster.kvstore.client import KVStoreClient
from pdcluster.kvstore.config import KVStoreConfig
from pdcluster.kvstore.errors import BlockLayoutError, StoreCapacityError
from pdcluster.engine.core.hashing import block_keys, make_namespace
from pdcluster.kvstore.index import Location, MemoryIndex, open_index
from pdcluster.kvstore.layout import BlockLayout
from pdcluster.kvstore.node_store import TieredNodeStore
from pdcluster.kvstore.index.base import HOST
from pdcluster.kvstore.node_store_api import REMOTE, NodeStore

LAYOUT = BlockLayout("bfloat16", (2, 16, 2, 8))  # 1 KiB blocks
SLOTS = 8  # G2 holds 8 blocks; no G3, so an evicted block is dropped
NS = "pdcluster-facade-test"  # own Ray namespace: no collision with other tests' stores


def keys_for(n: int, seed: int) -> list[bytes]:
    return block_keys([seed * 100003 + i for i in range(n * 16)], 16, make_namespace("facade"))


def random_blocks(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *LAYOUT.shape), generator=g).to(torch.bfloat16)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.fixture(params=[pytest.param("same-node", marks=[pytest.mark.slow, pytest.mark.ray]),
                        pytest.param("grpc", marks=pytest.mark.server)])
def facade(request):
    """(store as a NodeStore, the index it publishes to, the tier its hits report, node id)."""
    if request.param == "grpc":
        index = MemoryIndex()
        index.heartbeat("node-a", 30)
        store = TieredNodeStore("node-a", LAYOUT, SLOTS * LAYOUT.nbytes, None, 1, index,
                                tail_capacity_bytes=1 << 20, tail_ttl_s=60)
        server = request.getfixturevalue("make_server")(KVStoreConfig(), store)
        with KVStoreClient(server.address, timeout_s=10.0) as client:
            yield client, index, REMOTE, "node-a"
        server.stop(grace=0)
        store.close()
        return
    request.getfixturevalue("ray_cluster")
    import ray

    from pdcluster.kvstore.actor import start_kvstore_actors
    from pdcluster.kvstore.node_client import NodeStoreClient
    from pdcluster.kvstore.pool_config import KVPoolConfig

    node_id = ray.get_runtime_context().get_node_id()
    pool = KVPoolConfig(dram_cache_bytes=SLOTS * LAYOUT.nbytes, index_url=f"ray://{NS}-index")
    index = open_index(pool.index_url)  # the driver owns the index actor, as the launcher does
    actor = start_kvstore_actors(KVStoreConfig(), pool, LAYOUT, NS, node_ids=[node_id])[node_id]
    client = NodeStoreClient(actor, timeout_s=60.0)
    try:
        yield client, index, HOST, node_id
    finally:
        client.close()
        ray.get(actor.stop.remote())
        ray.kill(actor)


def test_one_script_same_answers_both_ways(facade):
    store, index, tier, node = facade
    assert isinstance(store, NodeStore)
    keys, blocks = keys_for(6, seed=1), random_blocks(6, seed=1)
    store.put(keys[:4], blocks[:4])
    assert store.exists(keys) == [True] * 4 + [False] * 2

    out = torch.zeros_like(blocks)
    assert store.get(keys, out) == [tier] * 4 + [None] * 2
    assert torch.equal(bits(out[:4]), bits(blocks[:4])) and not out[4:].any()
    out.zero_()  # the leading run only: nothing after the first miss, though keys[1] is there
    assert store.get([keys[0], keys[5], keys[1]], out[:3]) == [tier, None, None]
    assert torch.equal(bits(out[0]), bits(blocks[0])) and not out[1:3].any()

    store.put(keys[:1], blocks[5:6])  # a present key is kept as it is
    assert store.get(keys[:1], out[:1]) == [tier]
    assert torch.equal(bits(out[0]), bits(blocks[0]))

    assert store.pin([keys[0], keys[5]]) == [True, False]
    assert store.remove([keys[0], keys[1], keys[1], keys[5]]) == 1  # pinned 0 skipped
    assert store.exists(keys[:2]) == [True, False]
    assert index.lookup([keys[1]]) == [[]]  # the remove reached the global index
    assert Location(node, HOST) in index.lookup([keys[0]])[0]

    filler = keys_for(2 * SLOTS, seed=2)
    store.put(filler, random_blocks(2 * SLOTS, seed=2))  # twice G2
    assert store.exists(keys[:4]) == [True, False, False, False]  # all but the pinned left
    assert index.lookup(keys[2:4]) == [[], []]
    assert store.get(keys[:1], out[:1]) == [tier]
    assert torch.equal(bits(out[0]), bits(blocks[0]))
    assert store.pin([keys[0]], pinned=False) == [True]
    assert store.remove([keys[0]]) == 1 and store.exists([keys[0]]) == [False]

    held = store.pin(filler)
    assert held == [False] * (SLOTS + 1) + [True] * (SLOTS - 1)  # keys[0] had the 8th slot
    store.put(keys[4:5], blocks[4:5])  # into the slot keys[0] left free
    assert store.pin(keys[4:5]) == [True]  # now G2 is pinned full
    with pytest.raises(StoreCapacityError):
        store.put(keys[5:], blocks[5:])
    assert store.pin([*filler, keys[4]], pinned=False) == [*held, True]
    store.put(keys[5:], blocks[5:])
    assert store.exists(keys[4:]) == [True, True]

    assert store.get([], out[:0]) == [] and store.exists([]) == []
    assert store.remove([]) == 0 and store.pin([]) == []
    store.put([], blocks[:0])


def test_errors_are_the_same_both_ways(facade):
    store, _, _, _ = facade
    keys, blocks = keys_for(2, seed=3), random_blocks(2, seed=3)
    store.put(keys, blocks)
    for call in (lambda: store.exists([b"short"]), lambda: store.remove([b"short"]),
                 lambda: store.pin([b"short"]), lambda: store.put([b"short"], blocks[:1])):
        with pytest.raises(ValueError):
            call()
    with pytest.raises(BlockLayoutError):
        store.put(keys_for(1, seed=4), blocks[:1].float())  # another dtype than the store's
    with pytest.raises(BlockLayoutError):
        store.put(keys, blocks[:1])  # one block for two keys
    with pytest.raises(BlockLayoutError):
        store.get(keys, torch.zeros((2, 4), dtype=torch.bfloat16))  # another block shape
    assert store.exists(keys_for(1, seed=4)) == [False]
