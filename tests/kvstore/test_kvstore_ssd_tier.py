"""SSDTier (G3): round trip across slabs, async writes, LRU, corruption as a miss, threads, wipe.

Real files under tmp_path. Corruption tests find a block in its slab by searching for its key
and payload bytes, so they depend only on the slab file names, not on the slot layout.
"""

import hashlib
import os
import random
import threading
from pathlib import Path

import pytest

from pdcluster.kvstore.ssd_tier import SSDTier

BLOCK = 4096


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


def payload(i: int, n: int = BLOCK) -> bytes:
    return random.Random(i).randbytes(n)


@pytest.fixture
def make_tier(tmp_path):
    tiers = []

    def make(capacity_blocks=64, block_nbytes=BLOCK, **kw):
        kw.setdefault("slab_blocks", 8)
        t = SSDTier(tmp_path / "ssd", capacity_blocks * block_nbytes, block_nbytes, **kw)
        tiers.append(t)
        return t

    yield make
    for t in tiers:
        t.close()


def slabs(tier: SSDTier) -> list[Path]:
    return sorted(tier.directory.glob("slab-*.bin"))


def locate(tier: SSDTier, needle: bytes) -> tuple[Path, int]:
    """(slab file, byte offset) of the unique occurrence of ``needle``."""
    for path in slabs(tier):
        data = path.read_bytes()
        at = data.find(needle)
        if at >= 0:
            assert data.find(needle, at + 1) < 0
            return path, at
    raise AssertionError("needle not in any slab")


def filled(make_tier, n=20, **kw) -> SSDTier:
    tier = make_tier(io_threads=1, **kw)
    for i in range(n):
        tier.put_async(key(i), payload(i))
    tier.flush()
    return tier


def assert_miss_counted(tier: SSDTier, i: int, corruptions: int) -> None:
    assert tier.get(key(i)) is None
    assert not tier.contains(key(i))
    assert tier.get(key(i)) is None  # dropped: the second get is a plain miss
    assert tier.stats()["corruptions"] == corruptions


def test_round_trip_across_slabs(make_tier):
    tier = make_tier(capacity_blocks=64, slab_blocks=8)
    futures = [tier.put_async(key(i), payload(i)) for i in range(50)]
    tier.flush()
    assert all(f.done() and f.result() is True for f in futures)
    assert len(slabs(tier)) == 7  # ceil(50 / 8)
    for i in range(50):
        assert tier.get(key(i)) == payload(i)
    s = tier.stats()
    assert (s["num_blocks"], s["writes"], s["reads"], s["corruptions"]) == (50, 50, 50, 0)
    assert s["bytes_used"] == 50 * BLOCK and s["capacity_bytes"] == 64 * BLOCK
    assert s["capacity_blocks"] == 64 and s["pending_writes"] == 0
    assert tier.get(key(999)) is None


def test_put_returns_before_write_and_flush_waits(make_tier):
    n, size = 64, 1 << 20
    tier = make_tier(capacity_blocks=n, block_nbytes=size, io_threads=1)
    data = [payload(i, size) for i in range(n)]
    futures = [tier.put_async(key(i), data[i]) for i in range(n)]
    assert not all(f.done() for f in futures)  # one writer, 64 MiB queued
    assert tier.stats()["pending_writes"] > 0
    assert tier.get(key(n - 1)) == data[n - 1]  # served while pending
    assert tier.contains(key(n - 1))
    tier.flush()
    assert all(f.done() and f.result() for f in futures)
    s = tier.stats()
    assert s["pending_writes"] == 0 and s["writes"] == n
    assert tier.get(key(0)) == data[0]


def test_lru_eviction_order_and_get_refreshes(make_tier):
    evicted = []
    tier = make_tier(capacity_blocks=3, on_evict=evicted.append)
    for i in range(3):
        tier.put_async(key(i), payload(i))
    tier.flush()
    assert tier.get(key(0)) == payload(0)  # LRU order now 1, 2, 0
    tier.put_async(key(3), payload(3))
    tier.put_async(key(4), payload(4))
    assert evicted == [key(1), key(2)]
    tier.flush()
    writes = tier.stats()["writes"]
    assert tier.put_async(key(0), payload(0)).result() is True  # duplicate: touch, no rewrite
    assert tier.keys() == [key(3), key(4), key(0)]
    tier.flush()
    assert tier.stats()["writes"] == writes
    tier.put_async(key(5), payload(5))
    tier.flush()
    assert evicted == [key(1), key(2), key(3)]
    assert tier.keys() == [key(4), key(0), key(5)]
    for i in (4, 0, 5):
        assert tier.get(key(i)) == payload(i)
    assert tier.get(key(1)) is None
    s = tier.stats()
    assert (s["num_blocks"], s["evictions"], s["corruptions"]) == (3, 3, 0)
    assert len(slabs(tier)) == 1  # evicted slots are reused: 3 slots, one slab


def test_flipped_payload_byte_is_a_miss(make_tier):
    tier = filled(make_tier)
    path, at = locate(tier, payload(5))
    with open(path, "r+b") as f:
        f.seek(at + 1000)
        b = f.read(1)
        f.seek(at + 1000)
        f.write(bytes([b[0] ^ 0x01]))
    assert_miss_counted(tier, 5, corruptions=1)
    for i in (4, 6, 7):
        assert tier.get(key(i)) == payload(i)


def test_overwritten_header_key_is_a_miss(make_tier):
    tier = filled(make_tier)
    path, at = locate(tier, key(9))
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(key(10_000))
    assert_miss_counted(tier, 9, corruptions=1)
    assert tier.get(key(10)) == payload(10)


def test_truncated_slab_is_a_miss_for_the_cut_blocks(make_tier):
    tier = filled(make_tier, n=8, slab_blocks=8)
    path, at = locate(tier, payload(5))
    os.truncate(path, at + BLOCK // 2)
    assert_miss_counted(tier, 5, corruptions=1)
    assert_miss_counted(tier, 6, corruptions=2)
    for i in range(5):
        assert tier.get(key(i)) == payload(i)


def test_deleted_slab_is_a_miss_and_later_puts_work(make_tier):
    tier = filled(make_tier, n=16, slab_blocks=8)
    path, _ = locate(tier, payload(3))
    os.remove(path)
    assert_miss_counted(tier, 3, corruptions=1)
    lost = [i for i in range(16) if i != 3 and tier.get(key(i)) is None]
    assert tier.stats()["corruptions"] == 1 + len(lost) == 8  # the whole slab
    for i in set(range(16)) - set(lost) - {3}:
        assert tier.get(key(i)) == payload(i)
    assert tier.put_async(key(3), payload(3)).result() is True  # recreates the slab
    assert tier.get(key(3)) == payload(3)


def test_wrong_size_put_rejected_and_bad_args(make_tier, tmp_path):
    tier = make_tier()
    assert tier.put_async(key(1), b"x" * (BLOCK - 1)).result() is False
    assert tier.put_async(key(1), b"x" * (BLOCK + 1)).result() is False
    assert not tier.contains(key(1)) and tier.stats()["writes"] == 0
    with pytest.raises(ValueError):
        tier.put_async(b"short", payload(1))
    assert tier.put_async(key(2), bytearray(payload(2))).result() is True  # bytes-like is fine
    assert tier.get(key(2)) == payload(2)
    with pytest.raises(ValueError):
        SSDTier(tmp_path / "other", BLOCK - 1, BLOCK)
    with pytest.raises(ValueError):
        SSDTier(tmp_path / "other", BLOCK, 0)
    with pytest.raises(ValueError, match="in use"):
        SSDTier(tier.directory, BLOCK, BLOCK)


def test_concurrent_puts_and_gets_keep_invariants(make_tier):
    evicted = []
    tier = make_tier(capacity_blocks=40, io_threads=2, on_evict=evicted.append)
    errors = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(400):
                i = rng.randrange(100)
                if rng.random() < 0.5:
                    tier.put_async(key(i), payload(i))
                elif rng.random() < 0.9:
                    got = tier.get(key(i))
                    assert got is None or got == payload(i)
                else:
                    tier.remove(key(i))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tier.flush()
    assert errors == []
    s = tier.stats()
    keys = tier.keys()
    assert len(keys) == len(set(keys)) == s["num_blocks"] <= 40
    assert s["corruptions"] == 0 and s["write_errors"] == 0 and s["pending_writes"] == 0
    assert s["evictions"] == len(evicted) > 0
    by_key = {key(i): i for i in range(100)}
    for k in keys:
        assert tier.get(k) == payload(by_key[k])
    on_disk = sum(p.stat().st_size for p in slabs(tier))
    assert on_disk <= 40 * (BLOCK + 64)


def test_close_deletes_and_reopen_wipes(tmp_path):
    d = tmp_path / "ssd"
    tier = SSDTier(d, 16 * BLOCK, BLOCK, slab_blocks=4)
    for i in range(10):
        tier.put_async(key(i), payload(i))
    tier.close()  # without flush
    tier.close()  # idempotent
    assert not list(d.glob("slab-*.bin"))
    with pytest.raises(ValueError, match="closed"):
        tier.get(key(0))
    with pytest.raises(ValueError, match="closed"):
        tier.put_async(key(0), payload(0))

    (d / "slab-0.bin").write_bytes(b"left by a crash")
    (d / "keep.txt").write_text("not ours")
    tier = SSDTier(d, 16 * BLOCK, BLOCK, slab_blocks=4)
    try:
        assert not (d / "slab-0.bin").exists() and (d / "keep.txt").exists()
        assert tier.keys() == [] and tier.get(key(0)) is None
        assert tier.put_async(key(0), payload(0)).result() is True
        assert tier.get(key(0)) == payload(0)
    finally:
        tier.close()
