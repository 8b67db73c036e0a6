"""S3-FIFO (Yang et al., SOSP'23): small + main FIFO, ghost queue; O(1) amortized."""

from __future__ import annotations

from collections import OrderedDict

from benchmarks.eviction.base import EvictionPolicy, Key


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO (Yang et al., SOSP'23, Algorithm 1): small FIFO S, main FIFO M, ghost FIFO G.

    A new entry joins S (M if its key is in G); each reference adds 1 to a 2-bit frequency.
    Evicting from S (while S holds >= ``small_ratio`` x capacity, or M is empty): the head moves
    to M if referenced at least ``move_threshold`` times, else it is evicted into G. Evicting
    from M: the head goes back to the tail with frequency - 1 while its frequency is > 0, else
    it is evicted. Pinned entries leave their queue and rejoin it at the tail.
    """

    def __init__(self, capacity: int, small_ratio: float = 0.1, ghost_ratio: float = 0.9,
                 move_threshold: int = 1) -> None:
        super().__init__()
        self._queues = (OrderedDict(), OrderedDict())  # S, M: unpinned entries, head first
        self._ghost: OrderedDict[Key, None] = OrderedDict()
        self._freq: dict[Key, int] = {}
        self._queue_of: dict[Key, int] = {}  # 0 = S, 1 = M
        self._small_target = max(1, int(capacity * small_ratio))
        self._ghost_size = max(1, int(capacity * ghost_ratio))
        self._move_threshold = move_threshold

    def _insert(self, key: Key) -> None:
        self._freq[key] = 0
        self._queue_of[key] = 1 if self._ghost.pop(key, 0) is None else 0

    def _access(self, key: Key) -> None:
        self._freq[key] = min(3, self._freq[key] + 1)

    def _pin(self, key: Key) -> None:
        del self._queues[self._queue_of[key]][key]

    def _unpin(self, key: Key) -> None:
        self._queues[self._queue_of[key]][key] = None

    def _unhold(self, key: Key) -> None:
        queue = self._queues[self._queue_of[key]]
        queue[key] = None
        queue.move_to_end(key, last=False)

    def _remove(self, key: Key) -> None:
        del self._queues[self._queue_of.pop(key)][key]
        del self._freq[key]

    def _victim(self) -> Key:
        small, main = self._queues
        freq = self._freq
        while True:  # each pass moves S -> M or lowers a frequency: terminates
            if small and (len(small) >= self._small_target or not main):
                key, _ = small.popitem(last=False)
                if freq[key] >= self._move_threshold:
                    self._queue_of[key] = 1
                    main[key] = None
                    continue
                self._ghost[key] = None
                if len(self._ghost) > self._ghost_size:
                    self._ghost.popitem(last=False)
            else:
                key, _ = main.popitem(last=False)
                if freq[key] > 0:
                    freq[key] -= 1
                    main[key] = None
                    continue
            del freq[key]
            del self._queue_of[key]
            return key

    def _num_unpinned(self) -> int:
        return len(self._queues[0]) + len(self._queues[1])

    def _has_unpinned(self, key: Key) -> bool:
        return key in self._queues[0] or key in self._queues[1]
