"""LFU with dynamic aging (Arlitt et al., 2000): priority L + references ** exponent; O(log n)."""

from __future__ import annotations

import heapq
import itertools

from benchmarks.eviction.base import EvictionPolicy, Key


class LFUDAPolicy(EvictionPolicy):
    """LFU with dynamic aging (GreedyDual with unit cost and size).

    On release an entry's priority becomes ``L + references ** exponent``, where ``L`` is the
    priority of the last victim; the lowest priority goes first, the least recently released
    among equals. A parent keeps the priority of its own last release while it waits for its
    children. A lazy min-heap: O(log n).
    """

    def __init__(self, capacity: int = 0, exponent: float = 1.0) -> None:
        super().__init__()
        self._exponent = exponent
        self._heap: list[tuple[float, int, Key]] = []
        self._queued: dict[Key, int] = {}  # unpinned entry -> sequence number of its heap item
        self._count: dict[Key, int] = {}
        self._last: dict[Key, tuple[float, int]] = {}  # priority, sequence of the last release
        self._seq = itertools.count()
        self._age = 0.0

    def _insert(self, key: Key) -> None:
        self._count[key] = 1

    def _access(self, key: Key) -> None:
        self._count[key] += 1

    def _pin(self, key: Key) -> None:
        del self._queued[key]

    def _release_held(self, key: Key) -> None:
        self._last[key] = (self._age + self._count[key] ** self._exponent, next(self._seq))

    def _unpin(self, key: Key) -> None:
        self._release_held(key)
        self._unhold(key)

    def _unhold(self, key: Key) -> None:
        priority, seq = self._last[key]
        self._queued[key] = seq
        heapq.heappush(self._heap, (priority, seq, key))
        if len(self._heap) > 2 * len(self._queued) + 64:  # drop stale items
            self._heap = [item for item in self._heap if self._queued.get(item[2]) == item[1]]
            heapq.heapify(self._heap)

    def _remove(self, key: Key) -> None:
        del self._queued[key], self._count[key], self._last[key]

    def _victim(self) -> Key:
        while True:
            priority, seq, key = heapq.heappop(self._heap)
            if self._queued.get(key) == seq:
                break
        del self._queued[key], self._count[key], self._last[key]
        self._age = priority
        return key

    def _num_unpinned(self) -> int:
        return len(self._queued)

    def _has_unpinned(self, key: Key) -> bool:
        return key in self._queued
