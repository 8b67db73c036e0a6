"""TailStore: TTL'd tail blocks under handles, their capacity; BlockLayout validation."""

import pytest

from pdcluster.kvstore.errors import BlockLayoutError, StoreCapacityError
from pdcluster.kvstore.layout import BlockLayout
from pdcluster.kvstore.tail_store import TailStore

LAYOUT = BlockLayout("float32", (2, 4))  # 32 bytes per block


def payload(i: int) -> bytes:
    return bytes([i % 256]) * LAYOUT.nbytes


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_take_tail_removes_and_release_is_idempotent():
    store = TailStore(capacity_bytes=1 << 20, tail_ttl_s=10)
    store.put_tail("req-1", payload(7), LAYOUT, num_tokens=3)
    assert store.stats()["num_tails"] == 1
    tail = store.take_tail("req-1")
    assert tail == (payload(7), LAYOUT, 3)
    assert store.take_tail("req-1") is None
    assert store.stats()["bytes_used"] == 0
    store.put_tail("req-2", payload(1), LAYOUT, num_tokens=1)
    assert store.release_tail("req-2") is True
    assert store.release_tail("req-2") is False
    assert store.release_tail("never") is False


def test_tail_ttl_expiry_lazy_and_sweep():
    clock = FakeClock()
    store = TailStore(capacity_bytes=1 << 20, tail_ttl_s=5.0, clock=clock)
    store.put_tail("a", payload(1), LAYOUT, 2)
    clock.now = 3.0
    store.put_tail("b", payload(2), LAYOUT, 2)
    clock.now = 5.0  # a expires now, b at 8
    assert store.take_tail("a") is None  # lazy on access
    clock.now = 8.5
    assert store.expire_tails() == 1  # sweep drops b
    stats = store.stats()
    assert stats["num_tails"] == 0 and stats["bytes_used"] == 0 and stats["expired_tails"] == 2


def test_tails_past_capacity_are_refused_and_a_replaced_tail_frees_its_bytes():
    store = TailStore(capacity_bytes=2 * LAYOUT.nbytes, tail_ttl_s=10)
    store.put_tail("t1", payload(1), LAYOUT, 1)
    store.put_tail("t2", payload(2), LAYOUT, 1)
    with pytest.raises(StoreCapacityError):
        store.put_tail("t3", payload(3), LAYOUT, 1)
    store.put_tail("t2", payload(4), LAYOUT, 2)  # replaces t2 in place
    assert store.take_tail("t2") == (payload(4), LAYOUT, 2)
    assert store.stats()["bytes_used"] == LAYOUT.nbytes


def test_bad_tails_and_layouts_are_rejected():
    store = TailStore(capacity_bytes=1 << 20, tail_ttl_s=10)
    with pytest.raises(BlockLayoutError):
        store.put_tail("t", b"\0" * 3, LAYOUT, 1)
    with pytest.raises(ValueError):
        store.put_tail("", payload(1), LAYOUT, 1)
    with pytest.raises(ValueError):
        store.put_tail("t", payload(1), LAYOUT, -1)
    with pytest.raises(BlockLayoutError):
        BlockLayout("int64", (2,))
    with pytest.raises(BlockLayoutError):
        BlockLayout("float32", (2, -1))
    assert store.stats()["num_tails"] == 0
