"""LRUBlockStore, the in-memory store the gRPC tests serve: LRU of keyed blocks, tails in the
same byte budget."""

import threading

import pytest

from pdcluster.kvstore.errors import BlockLayoutError, StoreCapacityError
from pdcluster.kvstore.layout import BlockLayout
from tests.kvstore.lru_block_store import LRUBlockStore

LAYOUT = BlockLayout("float32", (2, 4))  # 32 bytes per block


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def payload(i: int) -> bytes:
    return bytes([i % 256]) * LAYOUT.nbytes


def test_lru_eviction_at_capacity_touch_on_get():
    store = LRUBlockStore(capacity_bytes=3 * LAYOUT.nbytes, tail_ttl_s=10)
    for i in range(3):
        store.put(key(i), payload(i), LAYOUT)
    assert store.get(key(0)) == (payload(0), LAYOUT)  # touch 0: 1 is now LRU
    store.put(key(3), payload(3), LAYOUT)
    assert store.get(key(1)) is None
    assert all(store.contains(key(i)) for i in (0, 2, 3))
    stats = store.stats()
    assert stats["evictions"] == 1 and stats["num_blocks"] == 3
    assert stats["bytes_used"] == 3 * LAYOUT.nbytes


def test_put_of_present_key_keeps_and_touches():
    store = LRUBlockStore(capacity_bytes=2 * LAYOUT.nbytes, tail_ttl_s=10)
    store.put(key(0), payload(0), LAYOUT)
    store.put(key(1), payload(1), LAYOUT)
    store.put(key(0), payload(9), LAYOUT)  # touch, not replace
    store.put(key(2), payload(2), LAYOUT)
    assert store.get(key(0)) == (payload(0), LAYOUT)
    assert store.get(key(1)) is None


def test_block_larger_than_capacity_rejected():
    store = LRUBlockStore(capacity_bytes=LAYOUT.nbytes - 1, tail_ttl_s=10)
    with pytest.raises(StoreCapacityError):
        store.put(key(0), payload(0), LAYOUT)
    assert store.stats()["bytes_used"] == 0


def test_payload_layout_mismatch():
    store = LRUBlockStore(capacity_bytes=1 << 20, tail_ttl_s=10)
    with pytest.raises(BlockLayoutError):
        store.put(key(0), b"\0" * 3, LAYOUT)


def test_tails_count_against_capacity_but_are_never_evicted():
    store = LRUBlockStore(capacity_bytes=2 * LAYOUT.nbytes, tail_ttl_s=10)
    store.put(key(0), payload(0), LAYOUT)
    store.put_tail("t1", payload(1), LAYOUT, 1)
    store.put_tail("t2", payload(2), LAYOUT, 1)  # evicts keyed block 0
    assert store.get(key(0)) is None
    with pytest.raises(StoreCapacityError):
        store.put(key(1), payload(1), LAYOUT)
    assert store.take_tail("t1") is not None


def test_concurrent_puts_and_gets_keep_accounting():
    store = LRUBlockStore(capacity_bytes=50 * LAYOUT.nbytes, tail_ttl_s=10)

    def work(base: int):
        for i in range(base + 3, base + 203):
            store.put(key(i), payload(i), LAYOUT)
            store.get(key(i - 3))

    threads = [threading.Thread(target=work, args=(t * 1000,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = store.stats()
    assert stats["num_blocks"] == 50 and stats["bytes_used"] == 50 * LAYOUT.nbytes
    assert stats["evictions"] == 800 - 50
