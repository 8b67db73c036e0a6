"""G1 block pool of one worker's paged KV cache: refcounts, LRU free queue, prefix cache, events.

One class owns the blocks, the free queue and the key -> block map, in the role
of vLLM v1's ``BlockPool`` (``vllm/v1/core/block_pool.py``). No torch and no scheduler imports.

Block states (``ref`` = reference count)::

    ref > 0                 in use by one or more sequences; never in the free queue
    ref == 0, no key        free, in the free queue
    ref == 0, key           free *and* cached: still in the free queue (evictable), and a prefix
                            hit can revive it (``touch`` takes it out of the queue in O(1))

NOTE invariants: a block is in the free queue iff its refcount is 0; ``key -> block`` and
``block -> key`` are inverse maps; a key is dropped only when its block is re-allocated
(LRU eviction, as in Mooncake FAST'25 and vLLM v1 prefix caching) or on ``reset_prefix_cache``.
Blocks released by a request stay cached until evicted, so a later request with the same
prefix reuses them.

Not thread-safe: the owning engine loop is its only user.
"""

from __future__ import annotations

from collections import Counter
from itertools import islice
from typing import Sequence

from pdcluster.engine.core.kv_events import AllCleared, BlockRemoved, BlockStored, KVCacheEvent
from pdcluster.engine.core.free_queue import FreeBlockQueue


class NoFreeBlocksError(RuntimeError):
    """An allocation asked for more blocks than are free; nothing was allocated."""


class _PrefixCache:
    """key <-> block maps of the blocks holding a full, keyed block; appends cache events."""

    def __init__(self, num_blocks: int, events: list[KVCacheEvent]) -> None:
        self._block_of: dict[bytes, int] = {}
        self._key_of: list[bytes | None] = [None] * num_blocks
        self._events = events
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._block_of)

    def get(self, key: bytes) -> int | None:
        return self._block_of.get(key)

    def key_of(self, block_id: int) -> bytes | None:
        return self._key_of[block_id]

    def keys(self) -> list[bytes]:
        return list(self._block_of)

    def longest_prefix(self, keys: Sequence[bytes]) -> list[int]:
        blocks = []
        for key in keys:
            b = self._block_of.get(key)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def store(self, block_ids: Sequence[int], keys: Sequence[bytes],
              parent_key: bytes | None) -> None:
        pending: dict[int, bytes] = {}
        for b, key in zip(block_ids, keys):
            held = pending.get(b, self._key_of[b])
            if held is not None and held != key:
                raise ValueError(f"block {b} already holds another key; cannot cache it again")
            pending[b] = key
        stored: list[bytes] = []
        first = -1
        for i, (b, key) in enumerate(zip(block_ids, keys)):
            if self._key_of[b] is not None or key in self._block_of:
                continue  # already cached here, or a duplicate: the existing mapping wins
            self._block_of[key] = b
            self._key_of[b] = key
            if first < 0:
                first = i
            stored.append(key)
        if stored:
            parent = keys[first - 1] if first > 0 else parent_key
            self._events.append(BlockStored(tuple(stored), parent))

    def evict(self, block_ids: Sequence[int]) -> None:
        removed = []
        for b in block_ids:
            key = self._key_of[b]
            if key is not None:
                self._key_of[b] = None
                del self._block_of[key]
                removed.append(key)
        if removed:
            self.evictions += len(removed)
            self._events.append(BlockRemoved(tuple(removed)))

    def clear(self) -> None:
        self._block_of.clear()
        self._key_of = [None] * len(self._key_of)
        self._events.append(AllCleared())


class BlockPool:
    """Hands out block ids ``0..num_blocks-1`` of one worker's paged KV cache.

    Args:
        num_blocks: number of blocks (>= 1).
        enable_caching: keep a prefix cache (key -> block) and emit cache events. When ``False``
            lookups always miss, ``cache_full_blocks`` stores nothing and no events are emitted.
        run_window: 0 takes every allocation from the LRU head, block by block (vLLM v1's
            order). ``w >= 1``: an allocation of ``n >= 2`` blocks takes the longest runs of
            consecutive ids among the ``w * n`` least recently freed blocks, so that a
            request's blocks form a few runs rather than being scattered over the cache: a KV
            connector moves a run in one read, and attention reads it in one sweep. The
            price is LRU order within that window: a cached block up to ``w * n`` places from
            the head may be evicted before the head (benchmarks/RESULTS.md has both sides).

    The owner must drain ``take_events()`` regularly (once per engine step); events accumulate
    until taken. Not thread-safe: the owning engine loop is its only user.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, run_window: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if run_window < 0:
            raise ValueError(f"run_window must be >= 0, got {run_window}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.run_window = run_window
        self._ref_count = [0] * num_blocks
        self._free = FreeBlockQueue(num_blocks)
        self._events: list[KVCacheEvent] = []
        # With caching off the cache is never stored into, so every lookup misses.
        self._cache = _PrefixCache(num_blocks, self._events)

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: refcount 0, whether or not they hold a (evictable) key."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with refcount > 0."""
        return self.num_blocks - len(self._free)

    def cached_keys(self) -> list[bytes]:
        """Keys of every cached block, in use or free (no order), e.g. to announce them again
        to an index that lost them."""
        return self._cache.keys()

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently holding a key (in use or free-but-evictable)."""
        return len(self._cache)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the LRU head of the free queue, each with refcount 1: in LRU
        order, or with ``run_window`` as runs from near the head, in ascending id order.

        A taken block that held a key loses it (eviction; one ``BlockRemoved`` per call that
        evicted anything). Raises ``NoFreeBlocksError`` if fewer than ``n`` blocks are free, and
        ``ValueError`` if ``n < 0``; in both cases nothing is taken.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        if n > 1 and self.run_window:
            blocks = self._take_runs(n)
        else:
            blocks = [self._free.popleft() for _ in range(n)]
        if self.enable_caching:
            self._cache.evict(blocks)
        for b in blocks:
            self._ref_count[b] = 1
        return blocks

    def _take_runs(self, n: int) -> list[int]:
        """Unlink ``n`` free blocks: the longest runs of consecutive ids among the
        ``run_window * n`` least recently freed (of equal runs, the lower ids first; a longer
        run than needed gives its first blocks), in ascending order."""
        window = sorted(islice(self._free, self.run_window * n))
        runs: list[tuple[int, int]] = []  # [start, end) of consecutive ids
        start = window[0]
        for prev, b in zip(window, window[1:]):
            if b != prev + 1:
                runs.append((start, prev + 1))
                start = b
        runs.append((start, window[-1] + 1))
        runs.sort(key=lambda run: run[0] - run[1])  # longest first; stable, so by id within
        blocks: list[int] = []
        for start, end in runs:
            blocks.extend(range(start, min(end, start + n - len(blocks))))
            if len(blocks) == n:
                break
        blocks.sort()
        for b in blocks:
            self._free.remove(b)
        return blocks

    def get_cached_block(self, key: bytes) -> int | None:
        """The block holding ``key``, or ``None``. Does not take a reference (see ``touch``)."""
        return self._cache.get(key)

    def longest_cached_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """Blocks of the leading ``keys`` that are cached, stopping at the first miss.

        Does not take references: ``touch`` the result before the next ``allocate``, which may
        evict them.
        """
        return self._cache.longest_prefix(keys)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each block (a prefix hit, or sharing a block between sequences).

        A refcount-0 cached block leaves the free queue (O(1)) and can no longer be evicted.
        Raises ``ValueError`` (nothing touched) for an id out of range or a block that is
        neither in use nor cached (its contents are garbage).
        """
        for b in block_ids:
            self._check_id(b)
            if self._ref_count[b] == 0 and self._cache.key_of(b) is None:
                raise ValueError(f"block {b} is free and not cached; allocate it instead")
        for b in block_ids:
            if self._ref_count[b] == 0:
                self._free.remove(b)
            self._ref_count[b] += 1

    def cache_full_blocks(self, block_ids: Sequence[int], keys: Sequence[bytes],
                          parent_key: bytes | None = None) -> None:
        """Register ``keys[i] -> block_ids[i]`` for full blocks of one sequence, in prefix order.

        ``parent_key`` is the key of the block before ``block_ids[0]`` (``None`` at a sequence's
        start); it only goes into the event. A block already holding the same key is skipped. If
        a key is already cached under another block the existing mapping is kept and this block
        stays uncached. Emits one ``BlockStored`` with the newly stored keys (none if nothing new).
        No-op when caching is disabled (arguments are still checked).

        Raises ``ValueError`` (nothing stored) if the lengths differ, an id is out of range, a
        block is not in use, or a block already holds a different key.
        """
        if len(block_ids) != len(keys):
            raise ValueError(f"{len(block_ids)} blocks but {len(keys)} keys")
        for b in block_ids:
            self._check_id(b)
            if self._ref_count[b] == 0:
                raise ValueError(f"block {b} is not in use; only allocated blocks can be cached")
        if self.enable_caching:
            self._cache.store(block_ids, keys, parent_key)

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block, tail-first (reverse of block-table order).

        A block reaching refcount 0 goes to the free queue's tail, still cached if it held a key,
        so a sequence's tail is evicted before its shared head (vLLM v1 ``free_blocks``).
        Raises ``ValueError`` (nothing freed) on an id out of range or a block freed more times
        than it is referenced (a double free is a bug).
        """
        block_ids = list(block_ids)
        for b, times in Counter(block_ids).items():
            self._check_id(b)
            if self._ref_count[b] < times:
                raise ValueError(f"block {b} freed but not allocated")
        for b in reversed(block_ids):
            self._ref_count[b] -= 1
            if self._ref_count[b] == 0:
                self._free.append(b)

    def reset_prefix_cache(self) -> bool:
        """Drop every key, only if no block is in use (vLLM semantics).

        Returns ``False`` and changes nothing while any block has a reference; otherwise clears
        the cache, emits ``AllCleared`` (when caching is enabled) and returns ``True``.
        """
        if self.num_used_blocks:
            return False
        if self.enable_caching:
            self._cache.clear()
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """Return and forget the events emitted since the last call, oldest first."""
        events = self._events[:]
        self._events.clear()
        return events

    def stats(self) -> dict[str, int]:
        """Gauges and the eviction counter, for load reports and metrics."""
        return {
            "num_blocks": self.num_blocks,
            "num_free_blocks": self.num_free_blocks,
            "num_used_blocks": self.num_used_blocks,
            "num_cached_blocks": self.num_cached_blocks,
            "evictions": self._cache.evictions,
        }

    def _check_id(self, b: int) -> None:
        if not 0 <= b < self.num_blocks:
            raise ValueError(f"block id {b} out of range 0..{self.num_blocks - 1}")
