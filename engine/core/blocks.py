"""Block arithmetic: how many `block_size`-token blocks hold a number of tokens.

The one formula every layer uses (the engine's KV cache manager, the model runner's block
tables, per-layer sends, the Conductor's prefix matching), so tokens and blocks never disagree.
"""

from __future__ import annotations


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size); 0 for 0.

    Raises ValueError for a negative token count or a block size below 1.
    """
    if num_tokens < 0 or block_size < 1:
        raise ValueError(f"num_blocks_for({num_tokens}, {block_size})")
    return -(-num_tokens // block_size)


def num_full_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks that `num_tokens` tokens fill completely (those that can be keyed and shared)."""
    if num_tokens < 0 or block_size < 1:
        raise ValueError(f"num_full_blocks({num_tokens}, {block_size})")
    return num_tokens // block_size
