"""G1 block pool: which of a worker's paged-cache blocks are free.

Walking-skeleton version: a free list with per-block reference counts. The prefix cache
(key -> block), the O(1) LRU free queue of cached blocks and cache events arrive with the
tiered KV pool (STYLE.md item 2). No torch and no scheduler imports here.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable


class NoFreeBlocksError(RuntimeError):
    """An allocation asked for more blocks than are free; nothing was allocated."""


class BlockPool:
    """Hands out block ids 0..num_blocks-1 of one worker's paged KV cache.

    Not thread-safe: the owning engine loop is its only user.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_count = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take n free blocks (refcount 1 each). Raises NoFreeBlocksError if fewer are free."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._ref_count[b] = 1
        return blocks

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; a block whose count reaches 0 becomes free.

        Blocks are given in block-table order and freed tail-first, so that when the prefix
        cache arrives the tail of a sequence is evicted before its shared head.
        Raises ValueError on a block that is not allocated (a double free is a bug).
        """
        for b in reversed(list(block_ids)):
            if self._ref_count[b] <= 0:
                raise ValueError(f"block {b} freed but not allocated")
            self._ref_count[b] -= 1
            if self._ref_count[b] == 0:
                self._free.append(b)
