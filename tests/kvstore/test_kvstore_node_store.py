"""A node's tiered store: G2 arena over G3 SSD, placements published to the index (in-memory,
and a real redis-server)."""

from __future__ import annotations

import uuid

import pytest

from kvstore.index import Location, MemoryIndex, RedisIndex
from kvstore.layout import BlockLayout
from kvstore.node_store import TieredNodeStore
from kvstore.tail_store import TailStore

LAYOUT = BlockLayout("float32", (2, 2, 4, 2, 8))  # 1 KiB blocks
NODE = "node-a"


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def payload(i: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(LAYOUT.nbytes))


@pytest.fixture(params=["memory", "redis"])
def store(request, tmp_path):
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        index = RedisIndex(server.url, namespace=f"ns{uuid.uuid4().hex[:8]}")
    else:
        index = MemoryIndex()
    index.heartbeat(NODE, 30)
    s = TieredNodeStore(NODE, LAYOUT, dram_bytes=2 * LAYOUT.nbytes, ssd_dir=str(tmp_path / "ssd"),
                        ssd_bytes=4 * LAYOUT.nbytes, index=index,
                        tails=TailStore(1 << 20, 60))
    yield s, index
    s.close()


def tiers_of(index, k: bytes) -> set[str]:
    return {loc.tier for loc in index.lookup([k])[0]}


def test_demote_to_ssd_and_promote_back_byte_exact(store):
    s, index = store
    for i in range(3):
        s.put(key(i), payload(i), LAYOUT)
    s.ssd.flush()
    assert tiers_of(index, key(0)) == {"ssd"}  # LRU victim of the 2-slot arena
    assert tiers_of(index, key(2)) == {"host"}
    [(slot, tier)] = s.acquire([key(0)])
    assert tier == "ssd" and slot is not None
    s.release([slot])
    assert "host" in tiers_of(index, key(0))
    got = s.get_many([key(0), key(1), key(2), key(9)])
    assert [g[0] if g else None for g in got] == [payload(0), payload(1), payload(2), None]
    assert s.promotions >= 1


def test_ssd_eviction_drops_from_index(store):
    s, index = store
    for i in range(7):  # 2 in G2 + 4 in G3: the oldest falls out
        s.put(key(i), payload(i), LAYOUT)
    s.ssd.flush()
    assert index.lookup([key(0)])[0] == []
    assert s.get_many([key(0)]) == [None]
    assert s.stats()["num_blocks"] == 6


def test_corrupt_ssd_block_is_a_miss(store):
    s, index = store
    for i in range(3):
        s.put(key(i), payload(i), LAYOUT)
    s.ssd.flush()
    [slab] = s.ssd.directory.glob("slab-*.bin")
    with open(slab, "r+b") as f:  # flip bytes all over the slab's payloads
        data = bytearray(f.read())
        for off in range(100, len(data), 97):
            data[off] ^= 0xFF
        f.seek(0)
        f.write(data)
    assert s.get_many([key(0)]) == [None]
    assert s.tier_stats()["ssd"]["corruptions"] == 1


def test_layout_is_checked_and_tails_are_separate(store):
    s, index = store
    with pytest.raises(Exception, match="layout"):
        s.put(key(1), b"x" * 16, BlockLayout("float32", (2,)))
    s.put_tail("t", payload(1), LAYOUT, 3)
    assert s.take_tail("t").num_tokens == 3 and s.take_tail("t") is None
    assert index.lookup([key(1)])[0] == []


def test_same_location_reported_for_node(store):
    s, index = store
    s.put(key(5), payload(5), LAYOUT)
    assert index.lookup([key(5)])[0] == [Location(NODE, "host")]
