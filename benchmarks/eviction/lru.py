"""LRU: least recently released first, BlockPool's free-queue order; O(1)."""

from __future__ import annotations

from collections import OrderedDict

from benchmarks.eviction.base import EvictionPolicy, Key


class LRUPolicy(EvictionPolicy):
    """Least recently *released* first: BlockPool's free-queue order, in an OrderedDict."""

    def __init__(self, capacity: int = 0) -> None:
        super().__init__()
        self._lru: OrderedDict[Key, None] = OrderedDict()  # unpinned, least recent first

    def _insert(self, key: Key) -> None:
        pass

    def _access(self, key: Key) -> None:
        pass

    def _pin(self, key: Key) -> None:
        del self._lru[key]

    def _unpin(self, key: Key) -> None:
        self._lru[key] = None

    def _unhold(self, key: Key) -> None:
        self._lru[key] = None
        self._lru.move_to_end(key, last=False)

    def _remove(self, key: Key) -> None:
        del self._lru[key]

    def _victim(self) -> Key:
        return self._lru.popitem(last=False)[0]

    def _num_unpinned(self) -> int:
        return len(self._lru)

    def _has_unpinned(self, key: Key) -> bool:
        return key in self._lru
