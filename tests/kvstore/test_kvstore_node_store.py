"""A node's tiered store: G2 arena over G3 SSD, placements published to the index (in-memory,
and a real redis-server)."""

from __future__ import annotations

import uuid

import pytest

from pdcluster.kvstore.arena import ArenaFullError
from pdcluster.kvstore.index import Location, MemoryIndex, RedisIndex
from pdcluster.kvstore.layout import BlockLayout
from pdcluster.kvstore.node_store import TieredNodeStore

LAYOUT = BlockLayout("float32", (2, 2, 4, 2, 8))  # 1 KiB blocks
NODE = "node-a"


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def payload(i: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(LAYOUT.nbytes))


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.server)])
def store(request, tmp_path):
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        index = RedisIndex(server.url, namespace=f"ns{uuid.uuid4().hex[:8]}")
    else:
        index = MemoryIndex()
    index.heartbeat(NODE, 30)
    s = TieredNodeStore(NODE, LAYOUT, dram_bytes=2 * LAYOUT.nbytes, ssd_dir=str(tmp_path / "ssd"),
                        ssd_bytes=4 * LAYOUT.nbytes, index=index,
                        tail_capacity_bytes=1 << 20, tail_ttl_s=60)
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


def test_remove_drops_both_tiers_and_sends_the_index_its_removes(store):
    s, index = store
    for i in range(4):  # the 2-slot G2 keeps 2 and 3; 0 and 1 are demoted to G3
        s.put(key(i), payload(i), LAYOUT)
    s.ssd.flush()
    [(slot, _)] = s.acquire([key(1)])  # promoted: now in G2 and still in G3
    s.release([slot])
    assert tiers_of(index, key(1)) == {"host", "ssd"}
    assert s.exists([key(i) for i in range(5)]) == [True] * 4 + [False]
    assert s.remove([key(0), key(1), key(9), key(1)]) == 2  # a repeated key counts once
    assert index.lookup([key(0), key(1)]) == [[], []]
    assert s.exists([key(0), key(1)]) == [False, False]
    assert s.get_many([key(0), key(1)]) == [None, None]
    assert tiers_of(index, key(3)) == {"host"}  # the rest untouched


def test_pinned_block_is_never_evicted_nor_demoted_until_unpinned(store):
    s, index = store
    s.put(key(0), payload(0), LAYOUT)
    assert s.pin([key(0), key(9)]) == [True, False]
    for i in range(1, 6):  # far past the 2-slot G2: only the unpinned slot churns
        s.put(key(i), payload(i), LAYOUT)
    s.ssd.flush()
    assert s.arena.stats().evictions == 4
    assert tiers_of(index, key(0)) == {"host"} and s.arena.contains(key(0))
    assert s.remove([key(0)]) == 0 and s.exists([key(0)]) == [True]  # remove skips it
    assert s.get_many([key(0)])[0][0] == payload(0)
    assert s.pin([key(0)], pinned=False) == [True]
    for i in (6, 7):  # unpinned, 0 is in the LRU again (behind 5): demoted by the second
        s.put(key(i), payload(i), LAYOUT)
    s.ssd.flush()
    assert tiers_of(index, key(0)) == {"ssd"}


def test_pinning_an_ssd_block_promotes_it_and_g2_pinned_full_refuses_more(store):
    s, index = store
    for i in range(4):  # G2: 2, 3; G3: 0, 1
        s.put(key(i), payload(i), LAYOUT)
    assert s.pin([key(0), key(1)]) == [True, True]  # promoted into G2, evicting 2 and 3
    assert s.arena.is_pinned(key(0)) and s.arena.is_pinned(key(1))
    assert "host" in tiers_of(index, key(0))
    assert s.pin([key(2)]) == [False]  # on SSD, but G2 holds no slot it may take
    assert s.pin([key(2)], pinned=False) == [True]  # present, and not pinned
    with pytest.raises(ArenaFullError):
        s.put(key(4), payload(4), LAYOUT)
    assert s.get_many([key(2)])[0][0] == payload(2)  # served from SSD, not promoted
    assert s.pin([key(0), key(1)], pinned=False) == [True, True]
    s.put(key(4), payload(4), LAYOUT)
