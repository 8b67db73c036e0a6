"""G2 host arena (kvstore/arena): leases, LRU eviction with demotion, and real shared memory
read and written by other processes."""

import hashlib
import json
import os
import random
import secrets
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from pdcluster.kvstore.arena import (ArenaAllocationError, ArenaAttachError, ArenaClosedError,
                                     ArenaFullError, HostArena)
from pdcluster.kvstore.arena.view import ArenaView, slot_runs
from pdcluster.kvstore.errors import StoreCapacityError

ROOT = Path(__file__).resolve().parents[2]
NODE = "t" + secrets.token_hex(4)[:7]  # segments of this module are named pdc-{NODE}-*
PREFIX = f"pdc-{NODE}-"
SHM_DIR = Path("/dev/shm")
B = 4096  # block_nbytes of most tests


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


def block(seed: int, nbytes: int = B) -> bytes:
    return random.Random(seed).randbytes(nbytes)


def our_segments() -> set[str]:
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(PREFIX)}


@pytest.fixture(scope="module", autouse=True)
def no_leaked_segments():
    if not SHM_DIR.is_dir():
        yield
        return
    assert our_segments() == set()
    yield
    assert our_segments() == set(), "a test leaked a /dev/shm segment"


@pytest.fixture
def arena():
    a = HostArena(4 * B, B, node_id=NODE)
    yield a
    a.close()


@pytest.fixture
def view(arena):
    with ArenaView(arena.shm_name, arena.num_slots, arena.block_nbytes) as v:
        yield v


def store(arena: HostArena, view: ArenaView, ids: list[int]) -> list[int]:
    keys = [key(i) for i in ids]
    slots = arena.reserve(keys)
    for slot, i in zip(slots, ids):
        view.write(slot, block(i))
    arena.commit(keys, slots)
    return slots


# Worker processes (tests/kvstore/arena_workers/): each attaches after reading one JSON job from
# stdin, so their interpreter and torch start-up overlaps the test's own work.
WORKERS = Path(__file__).resolve().parent / "arena_workers"


def start_python(script: str) -> subprocess.Popen:
    """A separate Python process running arena_workers/``script``, its stdin/stdout/stderr
    piped (text)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, str(WORKERS / script)], cwd=ROOT, env=env, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )


# -- leases --------------------------------------------------------------------------------


def test_reserve_commit_acquire_release(arena, view):
    keys = [key(0), key(1), key(2)]
    slots = arena.reserve(keys)
    assert sorted(slots) == [0, 1, 2]
    assert arena.acquire(keys[:1]) == [None]  # written but not committed: a miss
    assert arena.reserve(keys[:1]) == [None]  # being written under another lease
    assert arena.stats().num_pinned == 3
    for slot, i in zip(slots, range(3)):
        view.write(slot, block(i))
    arena.commit(keys, slots)
    assert arena.stats().num_pinned == 0 and all(arena.contains(k) for k in keys)
    assert sorted(arena.keys()) == sorted(keys)

    got = arena.acquire([keys[1], key(9), keys[1]])
    assert got == [slots[1], None, slots[1]]
    assert bytes(view.read(got[0]).numpy()) == block(1)
    stats = arena.stats()
    assert (stats.num_pinned, stats.hits, stats.misses) == (1, 2, 2)
    arena.release(got)
    stats = arena.stats()
    assert (stats.num_used, stats.num_pinned, stats.bytes_used) == (3, 0, 3 * B)
    assert (stats.num_slots, stats.capacity_bytes, stats.evictions) == (4, 4 * B, 0)


def test_reserve_returns_none_for_present_and_repeated_keys(arena, view):
    store(arena, view, [0])
    assert arena.reserve([key(0), key(1), key(1)]) == [None, 1, None]


def test_abort_frees_reserved_slots(arena):
    slots = arena.reserve([key(i) for i in range(4)])
    arena.abort(slots[:2] + [None])
    assert arena.stats().num_used == 2
    assert not arena.contains(key(0))
    assert arena.reserve([key(0), key(1)]) == [slots[1], slots[0]]  # freed slots come back


def test_misuse_raises_value_error_and_changes_nothing(arena, view):
    [s0] = store(arena, view, [0])
    [w] = arena.reserve([key(1)])
    with pytest.raises(ValueError):
        arena.commit([key(1), key(2)], [w])  # lengths differ
    with pytest.raises(ValueError):
        arena.commit([key(1), key(2)], [w, s0])  # s0 is not reserved for key(2)
    assert not arena.contains(key(1))  # the valid pair was not committed either
    with pytest.raises(ValueError):
        arena.release([s0])  # never acquired
    with pytest.raises(ValueError):
        arena.release([w])  # a write lease
    with pytest.raises(ValueError):
        arena.abort([s0])  # stored, not reserved
    arena.commit([key(1)], [w])
    assert arena.stats().num_pinned == 0


def test_remove_pinned_key_frees_slot_at_last_release(arena, view):
    [s0, s1] = store(arena, view, [0, 1])
    assert arena.remove(key(1)) and not arena.remove(key(1))
    assert arena.stats().num_used == 1
    [r] = arena.acquire([key(0)])
    assert arena.remove(key(0))
    assert arena.acquire([key(0)]) == [None]
    assert arena.stats().num_used == 1  # still pinned by the reader
    arena.release([r])
    assert arena.stats().num_used == 0


# -- eviction ------------------------------------------------------------------------------


def test_lru_eviction_order_and_on_evict_gets_bytes_intact():
    demoted: list[tuple[bytes, bytes]] = []

    def demote(k: bytes, v: memoryview) -> None:
        demoted.append((k, bytes(v)))

    with HostArena(3 * B, B, node_id=NODE, on_evict=demote) as a:
        with ArenaView(a.shm_name, a.num_slots, B) as v:
            store(a, v, [0, 1, 2])
            a.release(a.acquire([key(0)]))  # touch 0: LRU order is now 1, 2, 0
            slots = a.reserve([key(3), key(4)])
            assert demoted == [(key(1), block(1)), (key(2), block(2))]
            assert a.stats().evictions == 2
            assert not a.contains(key(1)) and a.contains(key(0))
            for slot, i in zip(slots, (3, 4)):
                v.write(slot, block(i))
            a.commit([key(3), key(4)], slots)
            a.reserve([key(5)])
            assert demoted[-1] == (key(0), block(0))


def test_pinned_slots_are_never_evicted(arena, view):
    store(arena, view, [0, 1, 2, 3])
    readers = arena.acquire([key(0), key(2)])
    writes = arena.reserve([key(4), key(5)])  # evicts 1 and 3, the only unpinned ones
    assert arena.contains(key(0)) and arena.contains(key(2))
    assert not arena.contains(key(1)) and not arena.contains(key(3))
    with pytest.raises(ArenaFullError) as err:
        arena.reserve([key(6)])
    assert (err.value.needed, err.value.available) == (1, 0)
    for slot, i in zip(readers, (0, 2)):
        assert bytes(view.read(slot).numpy()) == block(i)  # pinned bytes untouched

    arena.commit([key(4), key(5)], writes)  # 4 and 5 become evictable: 2 available
    before = arena.stats().evictions
    with pytest.raises(ArenaFullError):
        arena.reserve([key(6), key(7), key(8)])
    assert arena.stats().evictions == before  # all-or-nothing: nothing evicted
    arena.release(readers)  # released blocks join the LRU tail, after 4 and 5
    assert arena.reserve([key(6)]) == [writes[0]]


def test_a_pinned_block_is_never_evicted_nor_removed_until_unpinned(arena, view):
    store(arena, view, [0, 1, 2, 3])
    assert arena.pin([key(0), key(9)]) == [True, False]
    assert arena.pin([key(0)]) == [True]  # a flag, not a count: one unpin undoes both
    assert arena.is_pinned(key(0)) and not arena.is_pinned(key(1))
    assert arena.stats().num_pinned == 1
    store(arena, view, [4, 5, 6])  # fills past capacity: evicts 1, 2, 3, never 0
    assert [arena.contains(key(i)) for i in range(4)] == [True, False, False, False]
    with pytest.raises(ArenaFullError) as err:
        arena.reserve([key(i) for i in range(7, 11)])
    assert err.value.available == 3  # 4, 5, 6; the pinned slot is not evictable
    assert not arena.remove(key(0)) and arena.contains(key(0))
    [r] = arena.acquire([key(0)])  # a read lease on a pinned block...
    arena.release([r])  # ...ends without putting it in the LRU
    assert arena.stats().num_pinned == 1
    assert arena.pin([key(0)], pinned=False) == [True]
    assert arena.stats().num_pinned == 0
    store(arena, view, [7, 8, 9])  # unpinned 0 joined the LRU tail: 4, 5, 6 go first
    assert arena.contains(key(0))
    arena.reserve([key(10)])
    assert not arena.contains(key(0))


def test_pin_and_unpin_under_a_read_lease(arena, view):
    [s0, s1] = store(arena, view, [0, 1])
    [r] = arena.acquire([key(0)])
    assert arena.pin([key(0)]) == [True]
    assert arena.pin([key(0)], pinned=False) == [True]
    assert arena.stats().num_pinned == 1  # still leased: not yet evictable
    arena.reserve([key(2), key(3)])  # the two free slots
    with pytest.raises(ArenaFullError):
        arena.reserve([key(4), key(5)])  # only 1 is evictable
    arena.release([r])
    assert arena.stats().num_pinned == 2  # the write leases of 2 and 3
    assert arena.reserve([key(4), key(5)]) == [s1, s0]  # LRU order: 1, then 0 (released last)


def test_on_evict_error_propagates_and_frees_this_calls_reservations():
    def fail(k: bytes, v: memoryview) -> None:
        raise OSError("G3 write failed")

    with HostArena(2 * B, B, node_id=NODE, on_evict=fail) as a:
        [s0] = a.reserve([key(0)])
        a.commit([key(0)], [s0])
        with pytest.raises(OSError):
            a.reserve([key(1), key(2)])  # key(1) takes the free slot, key(2) must evict 0
        assert a.stats().num_used == 0 and a.stats().num_pinned == 0
        assert sorted(a.reserve([key(1), key(2)])) == [0, 1]


# -- data plane ----------------------------------------------------------------------------


def test_slot_runs_coalesce_consecutive_slots():
    assert slot_runs([]) == []
    assert slot_runs([4, 5, 6, 2, 3, 9]) == [(4, 0, 3), (2, 3, 2), (9, 5, 1)]
    assert slot_runs([1, 1]) == [(1, 0, 1), (1, 1, 1)]


def test_random_tensors_round_trip_byte_exact(arena, view):
    g = torch.Generator().manual_seed(0)
    blocks = torch.randn(4, B // 4, generator=g)  # float32, one block per row
    keys = [key(i) for i in range(4)]
    slots = arena.reserve(keys)
    view.write(slots[0], blocks[0].to(torch.bfloat16).view(torch.int16).repeat(2))
    view.write_from(slots[1:], blocks[1:])
    arena.commit(keys, slots)

    got = arena.acquire(keys[::-1])  # reversed: runs of descending slots
    out = torch.empty(4, B // 4)
    view.read_into(got, out)
    assert torch.equal(out[:3], blocks[1:].flip(0))
    head = out[3].view(torch.int16)[: B // 4].view(torch.bfloat16)
    assert torch.equal(head, blocks[0].to(torch.bfloat16))
    arena.release(got)

    with pytest.raises(ValueError):
        view.read_into(got, torch.empty(3, B // 4))  # wrong size
    with pytest.raises(ValueError):
        view.write(0, b"short")
    with pytest.raises(ValueError):
        view.read(arena.num_slots)


def test_many_scattered_slots_round_trip_byte_exact():
    """Enough runs for the CPU gather/scatter path, and few enough for the per-run one."""
    n, nbytes = 64, 256
    with HostArena(n * nbytes, nbytes, node_id=NODE) as a:
        with ArenaView(a.shm_name, n, nbytes) as v:
            data = torch.randn(n, nbytes // 2, generator=torch.Generator().manual_seed(1))
            data = data.to(torch.float16)
            order = random.Random(2).sample(range(n), n)
            v.write_from(order, data)  # 64 runs
            for slots in (random.Random(3).sample(range(n), n), list(range(8, 40))):
                out = torch.empty(len(slots), nbytes // 2, dtype=torch.float16)
                v.read_into(slots, out)
                want = torch.stack([data[order.index(s)] for s in slots])
                assert torch.equal(out.view(torch.int16), want.view(torch.int16))


def test_other_processes_write_and_read_the_same_bytes(arena):
    writer, reader = start_python("writer.py"), start_python("reader.py")
    keys = [key(i) for i in range(3)]
    slots = arena.reserve(keys)
    spec = {"name": arena.shm_name, "num_slots": arena.num_slots, "block_nbytes": B}
    job = json.dumps({**spec, "slots": slots, "seeds": [0, 1, 2]})
    out, err = writer.communicate(job, timeout=60)
    assert writer.returncode == 0, err
    assert err == ""  # no resource_tracker "leaked shared_memory" warning
    assert (SHM_DIR / arena.shm_name).exists()  # the worker's exit did not unlink it
    arena.commit(keys, slots)

    got = arena.acquire(keys)
    out, err = reader.communicate(json.dumps({**spec, "slots": got}), timeout=60)
    assert reader.returncode == 0, err
    assert err == ""
    assert json.loads(out) == [hashlib.sha256(block(i)).hexdigest() for i in range(3)]
    arena.release(got)
    assert (SHM_DIR / arena.shm_name).exists()


def test_spawn_child_sharing_the_owners_resource_tracker_stays_quiet():
    """A multiprocessing spawn child shares its parent's resource tracker: attaching must
    neither unlink the owner's segment nor upset the tracker (which writes to stderr)."""
    proc = start_python("spawn_owner.py")
    out, err = proc.communicate(NODE + "\n", timeout=60)
    assert proc.returncode == 0, err
    assert (out, err) == ("ok\n", "")


# -- lifetime ------------------------------------------------------------------------------


def test_owner_close_unlinks_and_later_attach_fails_cleanly():
    a = HostArena(2 * B, B, node_id=NODE)
    v = ArenaView(a.shm_name, a.num_slots, B)
    [s] = a.reserve([key(0)])
    v.write(s, block(0))
    a.close()
    a.close()  # idempotent
    assert not (SHM_DIR / a.shm_name).exists()
    with pytest.raises(ArenaAttachError, match="does not exist"):
        ArenaView(a.shm_name, a.num_slots, B)
    with pytest.raises(ArenaClosedError):
        a.acquire([key(0)])
    assert bytes(v.read(s).numpy()) == block(0)  # an attached worker keeps its mapping
    v.close()


def test_read_tensor_outlives_view_close(arena):
    v = ArenaView(arena.shm_name, arena.num_slots, B)
    v.write(1, block(5))
    t = v.read(1)
    v.close()
    v.close()
    with pytest.raises(ArenaClosedError):
        v.read(1)
    assert bytes(t.numpy()) == block(5)  # still mapped: no dangling pointer


def test_capacity_rounds_down_to_whole_slots_and_attach_checks_size():
    with HostArena(3 * B + B // 2, B, node_id=NODE) as a:
        assert (a.num_slots, a.capacity_bytes) == (3, 3 * B)
        assert a.shm_name.startswith(PREFIX)
        with pytest.raises(ArenaAttachError, match="expected"):
            ArenaView(a.shm_name, 4, B)
    with pytest.raises(StoreCapacityError):
        HostArena(B - 1, B, node_id=NODE)
    with pytest.raises(ValueError):
        HostArena(B, 0, node_id=NODE)


def test_concurrent_leases_keep_invariants():
    with HostArena(8 * B, B, node_id=NODE) as a:

        def worker(t: int) -> None:
            rng = random.Random(t)
            for _ in range(300):
                keys = [key(rng.randrange(32)) for _ in range(3)]
                try:
                    slots = a.reserve(keys)
                except ArenaFullError:
                    continue
                a.commit(keys, slots)
                a.release(a.acquire(keys))

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = a.stats()
        assert stats.num_pinned == 0
        assert stats.num_used == len(a.keys()) <= 8


@pytest.mark.skipif(not hasattr(os, "posix_fallocate"), reason="Linux preallocation")
def test_memory_is_preallocated_and_a_too_small_dev_shm_fails_at_creation():
    with HostArena(4 * B, B, node_id=NODE) as a:
        assert os.stat(SHM_DIR / a.shm_name).st_blocks * 512 >= 4 * B  # committed, not sparse
    fs = os.statvfs(SHM_DIR)
    if fs.f_blocks == 0:
        pytest.skip("/dev/shm has no size limit")
    # more than the whole tmpfs: the kernel refuses at once, without allocating first
    with pytest.raises(ArenaAllocationError, match="/dev/shm"):
        HostArena(2 * fs.f_blocks * fs.f_frsize, 1 << 20, node_id=NODE)
    assert our_segments() == set()


def test_the_owner_copies_bytes_of_leased_slots_only(arena, view):
    [w] = arena.reserve([key(1)])
    arena.write_slot(w, block(1))
    assert bytes(view.read(w).numpy()) == block(1)  # through a worker's own mapping
    with pytest.raises(ValueError, match="bytes"):
        arena.write_slot(w, block(1, B - 1))
    arena.commit([key(1)], [w])
    with pytest.raises(ValueError, match="not a leased slot"):  # stored, in the LRU
        arena.read_slot(w)
    [r] = arena.acquire([key(1)])
    view.write(r, block(2))  # a leased slot another process wrote
    assert arena.read_slot(r) == block(2)
    arena.release([r])
    for slot in (-1, arena.num_slots):
        with pytest.raises(ValueError, match="not a leased slot"):
            arena.write_slot(slot, block(3))
    arena.close()
    with pytest.raises(ArenaClosedError):
        arena.read_slot(r)
