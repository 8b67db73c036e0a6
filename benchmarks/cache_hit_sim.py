"""Replay machinery of ``benchmarks/cache_hit.py``: trace keys, caches, routers, one replay.

A request's hash ids become chained 32-byte keys (``trace_requests``); each instance's cache is
the real ``BlockPool`` (LRU) or a ``PolicyCache``; local requests are routed round-robin or
cache-aware (Mooncake's TTFT rule over the global index). See ``benchmarks/cache_hit.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from benchmarks.eviction import PolicyCache, make_policy
from pdcluster.engine.core.block_pool import BlockPool
from pdcluster.engine.core.hashing import block_keys, make_namespace
from pdcluster.engine.core.kv_events import KVCacheEvent
from pdcluster.kvstore.index import Location, MemoryIndex
from pdcluster.loadtest.trace import TraceRecord

_NAMESPACE = make_namespace("mooncake-conversation-trace")

Keys = Sequence[bytes]


@dataclass(frozen=True, slots=True)
class Request:
    arrival_s: float
    keys: tuple[bytes, ...]


def trace_requests(records: Sequence[TraceRecord]) -> list[Request]:
    """Chained block keys of each record (equal keys are one object, for fast lookups)."""
    interned: dict[bytes, bytes] = {}
    return [Request(r.timestamp_ms / 1000.0,
                    tuple(interned.setdefault(k, k) for k in block_keys(r.hash_ids, 1, _NAMESPACE)))
            for r in records]


def infinite_cache_hits(hash_id_lists: Sequence[Sequence[int]]) -> int:
    """Blocks whose hash id was seen before: the prefix-hit count of an unbounded cache."""
    seen: set[int] = set()
    hits = 0
    for ids in hash_id_lists:
        hits += sum(1 for h in ids if h in seen)
        seen.update(ids)
    return hits


class PrefixCache(Protocol):
    def serve(self, keys: Keys) -> int: ...
    def take_events(self) -> list[KVCacheEvent]: ...


class BlockPoolCache:
    """``PolicyCache.serve`` semantics on the real ``BlockPool`` (LRU free queue; with
    ``run_window``, runs of blocks taken from near its head)."""

    def __init__(self, capacity: int, run_window: int = 0) -> None:
        self.pool = BlockPool(capacity, run_window=run_window)

    def serve(self, keys: Keys) -> int:
        pool = self.pool
        if len(keys) > pool.num_blocks:
            raise ValueError(f"a request of {len(keys)} blocks exceeds {pool.num_blocks}")
        hits = len(pool.longest_cached_prefix(keys))
        table: list[int | None] = [pool.get_cached_block(k) for k in keys]
        pool.touch([b for b in table if b is not None])
        missing = [i for i, b in enumerate(table) if b is None]
        for i, b in zip(missing, pool.allocate(len(missing))):
            table[i] = b
        for i in missing:  # one call per block: a cached block may sit between missing ones
            pool.cache_full_blocks([table[i]], [keys[i]], keys[i - 1] if i else None)
        pool.free(table)
        return hits

    def take_events(self) -> list[KVCacheEvent]:
        return self.pool.take_events()


def run_window_of(policy: str) -> int | None:
    """W of a policy named ``lru+runsW`` (the real ``BlockPool`` with that ``run_window``),
    else None."""
    prefix = "lru+runs"
    if policy.startswith(prefix) and policy[len(prefix):].isdigit():
        return int(policy[len(prefix):])
    return None


def make_cache(policy: str, capacity: int, chain_aware: bool = True) -> PrefixCache:
    """LRU on the real ``BlockPool`` (``lru``, or ``lru+runsW`` with its run window W); any
    other policy on ``PolicyCache``."""
    if policy == "lru" or run_window_of(policy) is not None:
        return BlockPoolCache(capacity, run_window_of(policy) or 0)
    return PolicyCache(capacity, make_policy(policy, capacity), chain_aware)


class ClusterIndex:
    """Per-instance cached prefixes from the real global index (``kvstore.index.MemoryIndex``),
    fed with the pools' cache events: one device ``Location`` per instance on one node."""

    _NODE = "sim-node"

    def __init__(self, instances: int) -> None:
        self._index = MemoryIndex(clock=lambda: 0.0)  # frozen clock: the node never expires
        self._index.heartbeat(self._NODE, lease_s=1.0)
        self._locations = [Location(self._NODE, "device", str(n)) for n in range(instances)]

    def apply(self, instance: int, events: Sequence[KVCacheEvent]) -> None:
        self._index.apply_events(self._locations[instance], events)

    def prefix_lengths(self, keys: Keys) -> dict[int, int]:
        """Instance -> number of leading ``keys`` it holds (instances holding none are absent)."""
        prefix = self._index.longest_prefix(keys)
        lengths: dict[int, int] = {}
        holding: set[int] | None = None
        for j, holders in enumerate(prefix):
            here = {int(loc.instance_id) for loc in holders}
            if holding is not None:
                for n in holding - here:
                    lengths[n] = j
                here &= holding
            holding = here
            if not holding:
                break
        for n in holding or ():
            lengths[n] = len(prefix)
        return lengths


class RoundRobinRouter:
    def __init__(self, instances: int, prefill_blocks_per_s: float) -> None:
        self._instances = instances
        self._next = 0

    def route(self, request: Request) -> int:
        n = self._next
        self._next = (n + 1) % self._instances
        return n

    def observe(self, instance: int, request: Request, events: list[KVCacheEvent]) -> None:
        pass


class CacheAwareRouter:
    """Mooncake FAST'25 Alg. 1 without transfers: the instance with the least estimated TTFT.

    TTFT(n) = queue(n) + (blocks of the request not in n's cache) / rate, where queue(n) is the
    prefill work n still has at the request's arrival (each instance a FIFO server prefilling
    ``prefill_blocks_per_s``). Ties go round-robin. With equal queues this is "the longest cached
    prefix"; the queue term keeps one instance from taking every request that shares block 0.
    """

    def __init__(self, instances: int, prefill_blocks_per_s: float) -> None:
        self._instances = instances
        self._rate = prefill_blocks_per_s
        self._busy_until = [0.0] * instances
        self._index = ClusterIndex(instances)
        self._next = 0

    def route(self, request: Request) -> int:
        cached = self._index.prefix_lengths(request.keys)
        now, n_keys, rate = request.arrival_s, len(request.keys), self._rate
        start = self._next

        def ttft(n: int) -> tuple[float, int]:
            queue = max(0.0, self._busy_until[n] - now)
            return queue + (n_keys - cached.get(n, 0)) / rate, (n - start) % self._instances

        best = min(range(self._instances), key=ttft)
        self._busy_until[best] = (max(self._busy_until[best], now)
                                  + (n_keys - cached.get(best, 0)) / rate)
        self._next = (best + 1) % self._instances
        return best

    def observe(self, instance: int, request: Request, events: list[KVCacheEvent]) -> None:
        self._index.apply(instance, events)


ROUTERS = {"round_robin": RoundRobinRouter, "cache_aware": CacheAwareRouter}


@dataclass(frozen=True)
class Replay:
    """Outcome of one replay: total hits, and per instance its hits and request indices."""

    hits: int
    blocks: int
    instance_hits: tuple[int, ...]
    routes: tuple[tuple[int, ...], ...]

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.blocks if self.blocks else 0.0


def replay(requests: Sequence[Request], policy: str, capacity: int, instances: int = 1,
           routing: str = "round_robin", prefill_blocks_per_s: float = 10.0,
           chain_aware: bool = True) -> Replay:
    """Serve ``requests`` in order on ``instances`` pools of ``capacity`` blocks each."""
    if routing not in ROUTERS:
        raise ValueError(f"unknown routing {routing!r}; known: {', '.join(ROUTERS)}")
    caches = [make_cache(policy, capacity, chain_aware) for _ in range(instances)]
    router = ROUTERS[routing](instances, prefill_blocks_per_s)
    hits = [0] * instances
    routes: list[list[int]] = [[] for _ in range(instances)]
    for i, request in enumerate(requests):
        n = router.route(request)
        hits[n] += caches[n].serve(request.keys)
        routes[n].append(i)
        router.observe(n, request, caches[n].take_events())
    return Replay(sum(hits), sum(len(r.keys) for r in requests), tuple(hits),
                  tuple(tuple(r) for r in routes))

