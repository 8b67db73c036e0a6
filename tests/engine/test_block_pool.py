import hashlib
import random

import pytest

from pdcluster.engine.core.block_pool import BlockPool, NoFreeBlocksError
from pdcluster.engine.core.kv_events import AllCleared, BlockRemoved, BlockStored


def K(*parts) -> bytes:
    """A distinct 32-byte key per tuple of parts (stands in for a chained block key)."""
    return hashlib.sha256(repr(parts).encode()).digest()


def free_order(pool: BlockPool) -> list[int]:
    """The pool's free queue, head (next evicted) first."""
    return list(pool._free)


# ---------------------------------------------------------------- allocate / free


def test_allocate_free_and_exhaustion():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free_blocks == 1
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1  # a failed allocation takes nothing
    pool.free(a)
    assert pool.num_free_blocks == 4
    with pytest.raises(ValueError):
        pool.free([a[0]])  # double free
    assert pool.allocate(0) == []
    with pytest.raises(ValueError):
        pool.allocate(-1)
    with pytest.raises(ValueError):
        BlockPool(0)


def test_blocks_are_freed_tail_first():
    pool = BlockPool(3)
    table = pool.allocate(3)
    pool.free(table)
    assert pool.allocate(3) == list(reversed(table))


def test_run_window_takes_the_longest_runs_among_the_oldest_free_blocks():
    pool = BlockPool(16, run_window=2)
    assert pool.allocate(16) == list(range(16))  # the fresh queue is one run
    for table in ([7], [1, 2, 3], [12], [4, 5], [14, 15]):  # each freed tail-first
        pool.free(table)
    assert free_order(pool) == [7, 3, 2, 1, 12, 5, 4, 15, 14]
    # window 7, 3, 2, 1: the run 1-3 gives two; 4-5 is outside the window (LRU would give 7, 3)
    assert pool.allocate(2) == [1, 2]
    # window 7, 3, 12, 5, 4, 15: the run 3-5
    assert pool.allocate(3) == [3, 4, 5]
    assert pool.allocate(2) == [14, 15]  # window 7, 12, 15, 14
    assert pool.allocate(1) == [7]  # a single block comes from the head
    assert free_order(pool) == [12]
    with pytest.raises(ValueError, match="run_window"):
        BlockPool(4, run_window=-1)


def test_run_window_evicts_the_cached_blocks_it_takes():
    pool = BlockPool(8, run_window=2)
    blocks = pool.allocate(4)
    pool.cache_full_blocks(blocks, [K("r", i) for i in range(4)])
    pool.take_events()
    pool.free(blocks[:1])
    pool.free(blocks[2:])  # queue: 4..7 (never used), 0, then 3, 2 (tail-first)
    # window 4, 5, 6, 7, 0, 3: the run 3-7 gives its first three; 3 loses its key
    assert pool.allocate(3) == [3, 4, 5]
    assert pool.take_events() == [BlockRemoved((K("r", 3),))]
    assert pool.allocate(2) == [6, 7]  # window 6, 7, 0, 2: no eviction
    assert pool.take_events() == []
    assert pool.allocate(2) == [0, 2]  # two runs of one
    assert pool.take_events() == [BlockRemoved((K("r", 0), K("r", 2)))]
    assert pool.get_cached_block(K("r", 1)) == 1


def test_free_is_all_or_nothing():
    pool = BlockPool(4)
    a = pool.allocate(2)
    with pytest.raises(ValueError):
        pool.free([a[0], a[1], a[1]])  # a[1] has one reference, freed twice
    with pytest.raises(ValueError):
        pool.free([a[0], 99])
    assert pool.num_free_blocks == 2
    pool.touch([a[0]])
    pool.free([a[0], a[0], a[1]])  # two references on a[0]: fine
    assert pool.num_free_blocks == 4


def test_shared_block_is_free_only_after_last_reference():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.touch([b])
    pool.free([b])
    assert pool.num_free_blocks == 1 and pool.stats()["num_used_blocks"] == 1
    pool.free([b])
    assert pool.num_free_blocks == 2


# ---------------------------------------------------------------- prefix cache and LRU


def test_cache_lookup_and_longest_prefix():
    pool = BlockPool(8)
    blocks = pool.allocate(3)
    keys = [K("doc", i) for i in range(3)]
    pool.cache_full_blocks(blocks, keys)
    assert pool.num_cached_blocks == 3
    assert pool.get_cached_block(keys[1]) == blocks[1]
    assert pool.get_cached_block(K("other")) is None
    assert pool.longest_cached_prefix(keys + [K("doc", 3)]) == blocks
    assert pool.longest_cached_prefix([keys[0], K("miss"), keys[2]]) == [blocks[0]]
    assert pool.longest_cached_prefix([]) == []
    pool.free(blocks)
    # Released blocks stay cached and are free at the same time.
    assert pool.num_free_blocks == 8 and pool.num_cached_blocks == 3
    assert pool.longest_cached_prefix(keys) == blocks


def test_lru_eviction_order_tail_first_and_older_first():
    pool = BlockPool(6)
    first = pool.allocate(3)
    pool.cache_full_blocks(first, [K("a", i) for i in range(3)])
    second = pool.allocate(3)
    pool.cache_full_blocks(second, [K("b", i) for i in range(3)])
    pool.free(first)   # freed earlier -> evicted earlier; tail first within a sequence
    pool.free(second)
    assert free_order(pool) == list(reversed(first)) + list(reversed(second))
    pool.take_events()
    assert pool.allocate(2) == [first[2], first[1]]
    assert pool.take_events() == [BlockRemoved((K("a", 2), K("a", 1)))]
    # The shared head of "a" survives its tail.
    assert pool.longest_cached_prefix([K("a", i) for i in range(3)]) == [first[0]]
    assert pool.num_cached_blocks == 4 and pool.stats()["evictions"] == 2


def test_touched_blocks_are_protected_and_leave_the_middle_of_the_queue():
    pool = BlockPool(5)
    blocks = pool.allocate(5)
    pool.cache_full_blocks(blocks, [K("s", i) for i in range(5)])
    pool.free(blocks)
    assert free_order(pool) == blocks[::-1]
    hit = pool.longest_cached_prefix([K("s", 0), K("s", 1)])
    assert hit == blocks[:2]
    pool.touch(hit)  # both sit in the middle/tail of the free queue
    assert pool.num_free_blocks == 3
    assert free_order(pool) == [blocks[4], blocks[3], blocks[2]]
    pool.take_events()
    assert pool.allocate(3) == [blocks[4], blocks[3], blocks[2]]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)  # touched blocks cannot be evicted
    assert pool.get_cached_block(K("s", 0)) == blocks[0]
    # Released again, the re-touched blocks go to the tail (most recently used).
    pool.free(hit)
    assert free_order(pool) == [blocks[1], blocks[0]]


def test_touch_rejects_free_uncached_blocks_and_bad_ids():
    pool = BlockPool(3)
    with pytest.raises(ValueError):
        pool.touch([0])
    (b,) = pool.allocate(1)
    with pytest.raises(ValueError):
        pool.touch([b, 7])
    assert pool.num_free_blocks == 2  # nothing touched
    pool.touch([b])
    pool.free([b, b])
    assert pool.num_free_blocks == 3


def test_duplicate_key_keeps_the_existing_mapping():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.cache_full_blocks(a, [K(0), K(1)])
    b = pool.allocate(2)  # the same prefix computed again elsewhere
    pool.cache_full_blocks(b, [K(0), K(1)])
    assert pool.get_cached_block(K(0)) == a[0] and pool.get_cached_block(K(1)) == a[1]
    assert pool.num_cached_blocks == 2
    assert pool.take_events() == [BlockStored((K(0), K(1)), None)]
    pool.free(b)  # duplicates are plain free blocks: reused without a BlockRemoved
    pool.free(a)
    pool.allocate(2)
    assert pool.take_events() == []
    assert pool.num_cached_blocks == 2


def test_cache_full_blocks_idempotent_incremental_and_checked():
    pool = BlockPool(6)
    blocks = pool.allocate(4)
    keys = [K("c", i) for i in range(4)]
    pool.cache_full_blocks(blocks[:2], keys[:2])
    pool.cache_full_blocks(blocks[:2], keys[:2])  # already cached: no event
    pool.cache_full_blocks(blocks[2:], keys[2:], parent_key=keys[1])
    assert pool.take_events() == [BlockStored((keys[0], keys[1]), None),
                                  BlockStored((keys[2], keys[3]), keys[1])]
    with pytest.raises(ValueError):
        pool.cache_full_blocks(blocks[:1], [K("other")])  # block holds another key
    with pytest.raises(ValueError):
        pool.cache_full_blocks(blocks[:2], keys[:1])  # length mismatch
    (spare,) = pool.allocate(1)
    free_block = next(b for b in range(6) if b not in blocks + [spare])
    with pytest.raises(ValueError):
        pool.cache_full_blocks([spare, free_block], [K("x"), K("y")])  # not in use
    with pytest.raises(ValueError):
        pool.cache_full_blocks([spare, spare], [K("x"), K("y")])  # two keys for one block
    assert pool.get_cached_block(K("x")) is None and pool.take_events() == []


def test_stored_event_parent_skips_leading_duplicates():
    pool = BlockPool(6)
    a = pool.allocate(1)
    pool.cache_full_blocks(a, [K(0)])
    b = pool.allocate(3)
    pool.cache_full_blocks(b, [K(0), K(1), K(2)])
    assert pool.take_events() == [BlockStored((K(0),), None), BlockStored((K(1), K(2)), K(0))]


# ---------------------------------------------------------------- events and reset


def test_events_stored_removed_cleared_exactly():
    pool = BlockPool(2)
    blocks = pool.allocate(2)
    pool.cache_full_blocks(blocks, [K(0), K(1)], parent_key=K("p"))
    pool.free(blocks)
    assert pool.allocate(1) == [blocks[1]]
    assert pool.take_events() == [BlockStored((K(0), K(1)), K("p")), BlockRemoved((K(1),))]
    assert pool.take_events() == []  # drained
    assert pool.reset_prefix_cache() is False  # a block is in use
    assert pool.take_events() == [] and pool.num_cached_blocks == 1
    pool.free([blocks[1]])
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == [AllCleared()]
    assert pool.num_cached_blocks == 0 and pool.get_cached_block(K(0)) is None
    assert pool.num_free_blocks == 2
    pool.allocate(2)
    assert pool.take_events() == []  # nothing left to evict


def test_caching_disabled_is_a_plain_allocator():
    pool = BlockPool(3, enable_caching=False)
    assert pool.enable_caching is False
    blocks = pool.allocate(2)
    pool.cache_full_blocks(blocks, [K(0), K(1)])
    assert pool.get_cached_block(K(0)) is None
    assert pool.longest_cached_prefix([K(0)]) == []
    assert pool.num_cached_blocks == 0
    pool.free(blocks)
    with pytest.raises(ValueError):
        pool.touch([blocks[0]])  # free and (necessarily) uncached
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == []
    assert pool.stats() == {"num_blocks": 3, "num_free_blocks": 3, "num_used_blocks": 0,
                            "num_cached_blocks": 0, "evictions": 0}


# ---------------------------------------------------------------- randomized model check


class Model:
    """Independent reference: a plain LRU list, refcounts and key dicts, O(n) everywhere."""

    def __init__(self, n, caching, run_window=0):
        self.n, self.caching, self.run_window = n, caching, run_window
        self.free = list(range(n))
        self.ref = [0] * n
        self.block_of, self.key_of = {}, {}
        self.events = []

    def allocate(self, k):
        if k > 1 and self.run_window:
            taken = self.runs_near_head(k)
            self.free = [b for b in self.free if b not in taken]
        else:
            taken, self.free = self.free[:k], self.free[k:]
        removed = [self.key_of.pop(b) for b in taken if b in self.key_of]
        for key in removed:
            del self.block_of[key]
        if removed:
            self.events.append(BlockRemoved(tuple(removed)))
        for b in taken:
            self.ref[b] = 1
        return taken

    def runs_near_head(self, k):
        """The run window's rule, by brute force: every maximal run of consecutive ids among
        the run_window * k oldest free blocks, longest first, then by first id."""
        window = set(self.free[:self.run_window * k])
        runs = []
        for b in window:
            if b - 1 not in window:
                end = b
                while end + 1 in window:
                    end += 1
                runs.append(list(range(b, end + 1)))
        runs.sort(key=lambda run: (-len(run), run[0]))
        taken = []
        for run in runs:
            taken += run[:k - len(taken)]
        return sorted(taken)

    def free_blocks(self, blocks):
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free.append(b)

    def longest(self, keys):
        out = []
        for key in keys:
            if key not in self.block_of:
                break
            out.append(self.block_of[key])
        return out

    def touch(self, blocks):
        for b in blocks:
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1

    def cache_would_fail(self, blocks, keys):
        return any(self.key_of.get(b, key) != key for b, key in zip(blocks, keys))

    def cache(self, blocks, keys, parent):
        if not self.caching:
            return
        stored = []
        for i, (b, key) in enumerate(zip(blocks, keys)):
            if b in self.key_of or key in self.block_of:
                continue
            if not stored:
                first_parent = keys[i - 1] if i else parent
            self.key_of[b], self.block_of[key] = key, b
            stored.append(key)
        if stored:
            self.events.append(BlockStored(tuple(stored), first_parent))

    def reset(self):
        if any(self.ref):
            return False
        self.block_of.clear()
        self.key_of.clear()
        if self.caching:
            self.events.append(AllCleared())
        return True


def check_invariants(pool, model):
    free = free_order(pool)
    assert free == model.free
    assert pool.num_free_blocks == len(free)
    assert pool.num_free_blocks + pool.stats()["num_used_blocks"] == pool.num_blocks
    assert pool._ref_count == model.ref
    assert all(pool._ref_count[b] == 0 for b in free)  # free-listed => unreferenced
    assert sum(1 for r in pool._ref_count if r == 0) == len(free)  # and conversely
    assert pool.num_cached_blocks == len(model.block_of)
    for key, b in model.block_of.items():
        assert pool.get_cached_block(key) == b
        assert pool._cache.key_of(b) == key  # reverse map agrees


@pytest.mark.parametrize("seed, caching, run_window", [
    (0, True, 0), (1, True, 0), (2, True, 0), (3, False, 0), (4, True, 2), (5, True, 1),
    (6, False, 3)])
def test_random_ops_match_model(seed, caching, run_window):
    rng = random.Random(seed)
    n = 16
    pool = BlockPool(n, enable_caching=caching, run_window=run_window)
    model = Model(n, caching, run_window)
    seqs: list[list[int]] = []  # each holds one reference per listed block

    def doc_keys(doc, length):
        return [K("doc", doc, i) for i in range(length)]

    for step in range(2000):
        op = rng.random()
        if op < 0.25:
            k = rng.randint(0, 6)
            if k > len(model.free):
                with pytest.raises(NoFreeBlocksError):
                    pool.allocate(k)
            else:
                got = pool.allocate(k)
                assert got == model.allocate(k)
                if got:
                    seqs.append(got)
        elif op < 0.45 and seqs:
            seq = seqs.pop(rng.randrange(len(seqs)))
            pool.free(seq)
            model.free_blocks(seq)
        elif op < 0.65:
            keys = doc_keys(rng.randrange(4), rng.randint(1, 6))
            hit = pool.longest_cached_prefix(keys)
            assert hit == model.longest(keys)
            if hit:
                pool.touch(hit)
                model.touch(hit)
                seqs.append(hit)
        elif op < 0.85 and seqs:
            seq = rng.choice(seqs)
            start = rng.randrange(len(seq))
            keys = doc_keys(rng.randrange(4), len(seq))
            parent = keys[start - 1] if start else None
            blocks, keys = seq[start:], keys[start:]
            if caching and model.cache_would_fail(blocks, keys):
                with pytest.raises(ValueError):
                    pool.cache_full_blocks(blocks, keys, parent)
            else:
                pool.cache_full_blocks(blocks, keys, parent)
                model.cache(blocks, keys, parent)
        elif op < 0.9:
            unref = [b for b in range(n) if model.ref[b] == 0]
            if unref:
                with pytest.raises(ValueError):
                    pool.free([rng.choice(unref)])
        elif op < 0.93:
            assert pool.reset_prefix_cache() == model.reset()
        if rng.random() < 0.3:
            assert pool.take_events() == model.events
            model.events = []
        check_invariants(pool, model)
    for seq in seqs:
        pool.free(seq)
    assert pool.num_free_blocks == n
    assert pool.take_events() == model.events
