"""In-process index backend: plain dicts under one lock; the embedded default runs it inside a
named Ray actor (``kvstore.index.actor``). Semantics: ``kvstore.index.base``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from pdcluster.kvstore.index.base import (DEFAULT_NODE_LEASE_S, KVIndex, Location, check_keys,
                                          check_lease, sorted_locations)


class MemoryIndex(KVIndex):
    """Dict-backed ``KVIndex``; liveness leases are deadlines on ``clock``.

    Args:
        clock: monotonic seconds (injectable for tests); default ``time.monotonic``.

    Invariant: ``key in self._by_location[loc]`` iff ``loc in self._blocks[key]``; neither
    holds empty sets.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._blocks: dict[bytes, set[Location]] = {}
        self._by_location: dict[Location, set[bytes]] = {}
        self._node_deadline: dict[str, float] = {}

    def add(self, keys: Sequence[bytes], location: Location) -> None:
        check_keys(keys)
        with self._lock:
            held = self._by_location.setdefault(location, set())
            for key in keys:
                self._blocks.setdefault(key, set()).add(location)
                held.add(key)
            if not held:
                del self._by_location[location]

    def remove(self, keys: Sequence[bytes], location: Location) -> None:
        with self._lock:
            held = self._by_location.get(location)
            if held is None:
                return
            for key in keys:
                if key in held:
                    held.discard(key)
                    self._discard_block(key, location)
            if not held:
                del self._by_location[location]

    def remove_location(self, location: Location) -> None:
        with self._lock:
            for key in self._by_location.pop(location, ()):
                self._discard_block(key, location)

    def _discard_block(self, key: bytes, location: Location) -> None:
        holders = self._blocks[key]
        holders.discard(location)
        if not holders:
            del self._blocks[key]

    def lookup(self, keys: Sequence[bytes]) -> list[list[Location]]:
        with self._lock:
            alive = self._alive_locked()
            return [self._alive_holders(key, alive) for key in keys]

    def longest_prefix(self, keys: Sequence[bytes]) -> list[list[Location]]:
        result: list[list[Location]] = []
        with self._lock:
            alive = self._alive_locked()
            for key in keys:
                holders = self._alive_holders(key, alive)
                if not holders:
                    break
                result.append(holders)
        return result

    def _alive_holders(self, key: bytes, alive: set[str]) -> list[Location]:
        return sorted_locations(loc for loc in self._blocks.get(key, ()) if loc.node_id in alive)

    def heartbeat(self, node_id: str, lease_s: float = DEFAULT_NODE_LEASE_S) -> bool:
        check_lease(lease_s)
        with self._lock:
            now = self._clock()
            renewed = self._node_deadline.get(node_id, now) > now
            self._node_deadline[node_id] = now + lease_s
        return renewed

    def _alive_locked(self) -> set[str]:
        now = self._clock()
        expired = [node for node, deadline in self._node_deadline.items() if deadline <= now]
        for node in expired:  # as Redis expires the key; entries on the node stay stored
            del self._node_deadline[node]
        return set(self._node_deadline)

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._by_location.clear()
            self._node_deadline.clear()
