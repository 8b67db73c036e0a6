"""O(1) LRU queue of free block ids: an intrusive doubly linked list over ids 0..n-1.

Same idea as vLLM v1's ``FreeKVCacheBlockQueue`` (``vllm/v1/core/kv_cache_utils.py``): a cached
block that gets a prefix-cache hit must leave the *middle* of the free list, which ``deque.remove``
does in O(n) (nano-vllm's trap). Here the links are two int lists indexed by block
id, so no Python object is allocated per operation.

Layout (``S`` = sentinel at index ``capacity``; the list is circular through it)::

    S <-> head (least recently freed) <-> ... <-> tail (most recently freed) <-> S
    _next[S] = head, _prev[S] = tail; an empty queue has _next[S] == _prev[S] == S.
    A block not in the queue has _next[b] == _prev[b] == _NOT_QUEUED.

Not thread-safe.
"""

from __future__ import annotations

from typing import Iterator

_NOT_QUEUED = -1


class FreeBlockQueue:
    """Free block ids in LRU order: ``popleft`` takes the least recently freed block.

    Args:
        capacity: block ids are ``0..capacity-1``.
        fill: start with every id queued in ascending order (``True``) or empty.

    Every operation is O(1) except iteration. ``append``/``remove`` raise ``ValueError`` for an id
    that is already queued / not queued, or out of range; ``popleft`` raises ``IndexError`` when
    empty.
    """

    def __init__(self, capacity: int, fill: bool = True) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        s = capacity
        self._next = [_NOT_QUEUED] * (capacity + 1)
        self._prev = [_NOT_QUEUED] * (capacity + 1)
        self._next[s] = self._prev[s] = s
        self._len = 0
        if fill and capacity:
            self._next[s] = 0
            self._prev[s] = capacity - 1
            self._next[:capacity] = range(1, capacity + 1)  # last one points at S
            self._prev[1:capacity] = range(0, capacity - 1)
            self._prev[0] = s
            self._len = capacity

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block_id: int) -> bool:
        return 0 <= block_id < self.capacity and self._next[block_id] != _NOT_QUEUED

    def __iter__(self) -> Iterator[int]:
        """Queued ids from head (next to be taken) to tail."""
        s = self.capacity
        b = self._next[s]
        while b != s:
            yield b
            b = self._next[b]

    def popleft(self) -> int:
        """Remove and return the head (least recently freed) id."""
        s = self.capacity
        b = self._next[s]
        if b == s:
            raise IndexError("popleft from an empty FreeBlockQueue")
        self._unlink(b)
        return b

    def append(self, block_id: int) -> None:
        """Queue ``block_id`` at the tail (most recently freed)."""
        self._check_range(block_id)
        if self._next[block_id] != _NOT_QUEUED:
            raise ValueError(f"block {block_id} is already in the free queue")
        s = self.capacity
        tail = self._prev[s]
        self._next[tail] = block_id
        self._prev[block_id] = tail
        self._next[block_id] = s
        self._prev[s] = block_id
        self._len += 1

    def remove(self, block_id: int) -> None:
        """Take ``block_id`` out of the queue wherever it is (head, middle or tail)."""
        self._check_range(block_id)
        if self._next[block_id] == _NOT_QUEUED:
            raise ValueError(f"block {block_id} is not in the free queue")
        self._unlink(block_id)

    def _unlink(self, b: int) -> None:
        prev, nxt = self._prev[b], self._next[b]
        self._next[prev] = nxt
        self._prev[nxt] = prev
        self._next[b] = self._prev[b] = _NOT_QUEUED
        self._len -= 1

    def _check_range(self, block_id: int) -> None:
        if not 0 <= block_id < self.capacity:
            raise ValueError(f"block id {block_id} out of range 0..{self.capacity - 1}")
