"""Prefix-hit replay of requests on a policy alone (no KV data): :class:`PolicyCache`."""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.eviction.base import EvictionPolicy, Key
from pdcluster.engine.core.kv_events import BlockRemoved, BlockStored, KVCacheEvent


class PolicyCache:
    """A fixed-capacity set of chained block keys, served request by request (no KV data).

    ``serve(keys)`` is one request whose block i has key ``keys[i]`` (naming blocks 0..i):

    1. hits = number of leading keys cached: a prefix hit; a cached key after the first miss
       is no hit (its KV is useless without the blocks before it);
    2. every cached key of the request is referenced (``on_hit``), in block order;
    3. every missing key is inserted (``on_insert``, parent = the key before it), in block
       order, each taking a victim while the cache is full; the request's own keys are
       referenced, so never victims;
    4. all its keys are released tail-first (``on_release``), as ``BlockPool.free`` does.

    So every block of a request ends up cached. With ``LRUPolicy`` the hits are exactly those
    of ``BlockPool`` driven by ``touch`` / ``allocate`` / ``cache_full_blocks`` / ``free``.
    Emits the pool's ``BlockStored`` / ``BlockRemoved`` events. A request longer than
    ``capacity`` raises ``ValueError``. ``chain_aware=False`` passes no parents (not leaf-first).
    """

    def __init__(self, capacity: int, policy: EvictionPolicy, chain_aware: bool = True) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.policy = policy
        self.chain_aware = chain_aware
        self.evictions = 0
        self._events: list[KVCacheEvent] = []

    def __len__(self) -> int:
        return len(self.policy)

    def __contains__(self, key: Key) -> bool:
        return key in self.policy

    def longest_prefix(self, keys: Sequence[Key]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.policy:
            n += 1
        return n

    def serve(self, keys: Sequence[Key]) -> int:
        """Replay one request (steps above); returns its number of prefix-hit blocks."""
        if len(keys) > self.capacity:
            raise ValueError(f"a request of {len(keys)} blocks exceeds capacity {self.capacity}")
        policy = self.policy
        hits = self.longest_prefix(keys)
        missing = []
        for i, key in enumerate(keys):
            if key in policy:
                policy.on_hit(key)
            else:
                missing.append(i)
        if missing:
            evicted = []
            for i in missing:
                if len(policy) >= self.capacity:
                    evicted.append(policy.victim())
                policy.on_insert(keys[i], keys[i - 1] if i and self.chain_aware else None)
            if evicted:
                self.evictions += len(evicted)
                self._events.append(BlockRemoved(tuple(evicted)))
            self._events.append(BlockStored(tuple(keys[i] for i in missing),
                                            keys[missing[0] - 1] if missing[0] else None))
        for key in reversed(keys):
            policy.on_release(key)
        return hits

    def take_events(self) -> list[KVCacheEvent]:
        """Cache events since the last call, oldest first (the types ``BlockPool`` emits)."""
        events, self._events = self._events, []
        return events
