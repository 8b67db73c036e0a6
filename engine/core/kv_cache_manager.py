"""KV cache manager: the one place that turns a request's tokens into blocks of a worker's
paged cache (vLLM v1's `KVCacheManager`: `get_computed_blocks`, `allocate_slots`, `free`).

It sits over the block pool (engine.core.block_pool.BlockPool: refcounts, LRU free queue, prefix
cache) and owns nothing else; block tables are the callers' lists, grown and emptied in place.
Not thread-safe: the engine loop that owns the pool is its only user.

Sliding window (vLLM's SlidingWindowManager): when every layer of the model attends to the last
W positions only, a block wholly before the next query's window is needed by no later step.
`release_outside_window` gives such blocks back and leaves NULL_BLOCK at their place in the
table, so positions still index it; the released entries are always a prefix of the table. A
prefix hit then needs only the blocks a query at the hit's end sees: the hit is the longest
n blocks whose last ceil((W - 1) / B) are cached, the ones before it NULL_BLOCK, whatever
became of them (`get_computed_blocks`).
"""

from __future__ import annotations

from collections.abc import Sequence

from pdcluster.engine.core.block_pool import BlockPool
from pdcluster.engine.core.blocks import num_blocks_for, num_full_blocks

#: a block-table entry whose block was released (wholly outside the sliding window)
NULL_BLOCK = -1


def has_released(block_table: list[int]) -> bool:
    """Whether the table gave blocks back (they are a prefix of it, so the first tells)."""
    return bool(block_table) and block_table[0] == NULL_BLOCK


class KVCacheManager:
    """Allocates and frees one worker's cache blocks for requests.

    Args:
        pool: the worker's block pool.
        block_size: tokens per block.
        sliding_window: W when every layer attends to its last W positions only
            (ModelConfig.kv_window), else None: no block is released before its request ends.
    """

    def __init__(self, pool: BlockPool, block_size: int, sliding_window: int | None = None
                 ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.sliding_window = sliding_window

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return num_blocks_for(num_tokens, self.block_size)

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether a request of `num_tokens` tokens fits in the whole cache at all."""
        return self.blocks_for(num_tokens) <= self.pool.num_blocks

    def get_computed_blocks(self, keys: Sequence[bytes], num_tokens: int) -> list[int]:
        """The cached blocks (G1 prefix hits) of the leading `keys` of a `num_tokens`-token
        prompt, referenced (free them with the request's other blocks).

        Capped so at least one prompt token is computed: the first output token needs the last
        position's logits (vLLM does the same).
        """
        reusable = keys[:num_full_blocks(num_tokens - 1, self.block_size)]
        if self.sliding_window is None:
            hit = self.pool.longest_cached_prefix(reusable)
            self.pool.touch(hit)
            return hit
        return self._window_hit(reusable)

    def _window_hit(self, keys: Sequence[bytes]) -> list[int]:
        """The longest n blocks whose last `seen` (the blocks a query at n * B sees) are
        cached: NULL_BLOCK for the n - seen before them, then those, referenced."""
        seen = -(-(self.sliding_window - 1) // self.block_size)
        ids = [self.pool.get_cached_block(key) for key in keys]
        best, run = 0, 0
        for n, block in enumerate(ids, 1):
            run = run + 1 if block is not None else 0
            if run >= min(seen, n):
                best = n
        start = max(0, best - seen)
        held = ids[start:best]
        self.pool.touch(held)
        return [NULL_BLOCK] * start + held

    def allocate_slots(self, block_table: list[int], num_tokens: int) -> bool:
        """Grows `block_table` in place to hold `num_tokens` tokens.

        Returns False, taking nothing, when too few blocks are free.
        """
        missing = self.blocks_for(num_tokens) - len(block_table)
        if missing <= 0:
            return True
        if missing > self.pool.num_free_blocks:
            return False
        block_table += self.pool.allocate(missing)
        return True

    def release_outside_window(self, block_table: list[int], num_computed_tokens: int) -> int:
        """With a sliding window W: gives back the blocks of `block_table` that lie wholly
        before position num_computed_tokens - W + 1 (the first key the next query sees),
        leaving NULL_BLOCK in their place. Returns how many it released (0 without a window).
        """
        if self.sliding_window is None:
            return 0
        first_seen = max(0, num_computed_tokens - self.sliding_window + 1)
        end = min(first_seen // self.block_size, len(block_table))
        released = [i for i in range(end) if block_table[i] != NULL_BLOCK]
        if released:
            self.pool.free([block_table[i] for i in released])
            for i in released:
                block_table[i] = NULL_BLOCK
        return len(released)

    def free(self, block_table: list[int]) -> None:
        """Drops the request's reference on every block of `block_table` it still holds (tail
        first, so its tail is evicted before a shared head) and empties the list."""
        if block_table:
            self.pool.free([b for b in block_table if b != NULL_BLOCK])
            block_table.clear()
