"""ARC (Megiddo & Modha, FAST'03): adaptive recency/frequency split; O(1)."""

from __future__ import annotations

from collections import OrderedDict

from benchmarks.eviction.base import EvictionPolicy, Key


class ARCPolicy(EvictionPolicy):
    """ARC (Megiddo & Modha, FAST'03): T1 (seen once), T2 (seen again), ghosts B1 and B2.

    A ghost hit on insert moves the target size ``p`` of T1 (up for B1, down for B2) and the
    entry joins T2. The victim is T1's LRU entry while T1 (pinned entries included) exceeds
    ``p``, else T2's. Deviation: the owner asks ``victim()`` before ``on_insert``, so REPLACE's
    ``x in B2`` tie rule is not applied.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self._c = max(1, capacity)
        self._p = 0.0
        self._t = (OrderedDict(), OrderedDict())  # T1, T2: unpinned entries, LRU first
        self._b = (OrderedDict(), OrderedDict())  # B1, B2
        self._list: dict[Key, int] = {}  # entry -> 0 (T1) or 1 (T2)
        self._n1 = 0  # entries in T1, pinned included

    def _insert(self, key: Key) -> None:
        b1, b2 = self._b
        if key in b1:
            self._p = min(self._c, self._p + max(len(b2) / len(b1), 1.0))
            del b1[key]
            self._list[key] = 1
        elif key in b2:
            self._p = max(0.0, self._p - max(len(b1) / len(b2), 1.0))
            del b2[key]
            self._list[key] = 1
        else:
            self._list[key] = 0
            self._n1 += 1
        while b1 and len(b1) + self._n1 > self._c:
            b1.popitem(last=False)
        while b2 and len(b1) + len(b2) + len(self._list) > 2 * self._c:
            b2.popitem(last=False)

    def _access(self, key: Key) -> None:
        if self._list[key] == 0:
            self._list[key] = 1
            self._n1 -= 1

    def _pin(self, key: Key) -> None:
        del self._t[self._list[key]][key]

    def _unpin(self, key: Key) -> None:
        self._t[self._list[key]][key] = None

    def _remove(self, key: Key) -> None:
        which = self._list.pop(key)
        del self._t[which][key]
        self._n1 -= which == 0

    def _victim(self) -> Key:
        t1, t2 = self._t
        which = 0 if t1 and (self._n1 > self._p or not t2) else 1
        key, _ = self._t[which].popitem(last=False)
        self._b[which][key] = None
        self._n1 -= which == 0
        del self._list[key]
        return key

    def _num_unpinned(self) -> int:
        return len(self._t[0]) + len(self._t[1])

    def _has_unpinned(self, key: Key) -> bool:
        return key in self._t[0] or key in self._t[1]
