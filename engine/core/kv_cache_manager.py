"""KV cache manager: the one place that turns a request's tokens into blocks of a worker's
paged cache (vLLM v1's `KVCacheManager`: `get_computed_blocks`, `allocate_slots`, `free`).

It sits over the block pool (engine.core.block_pool.BlockPool: refcounts, LRU free queue, prefix
cache) and owns nothing else; block tables are the callers' lists, grown and emptied in place.
Not thread-safe: the engine loop that owns the pool is its only user.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.core.block_pool import BlockPool
from engine.core.blocks import num_blocks_for, num_full_blocks


class KVCacheManager:
    """Allocates and frees one worker's cache blocks for requests.

    Args:
        pool: the worker's block pool.
        block_size: tokens per block.
    """

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size

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
        hit = self.pool.longest_cached_prefix(reusable)
        self.pool.touch(hit)
        return hit

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

    def free(self, block_table: list[int]) -> None:
        """Drops the request's reference on every block of `block_table` (tail first, so its
        tail is evicted before a shared head) and empties the list."""
        if block_table:
            self.pool.free(block_table)
            block_table.clear()
