import pytest

from kvstore.block_pool import BlockPool, NoFreeBlocksError


def test_allocate_free_and_exhaustion():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free_blocks == 1
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1  # a failed allocation takes nothing
    pool.free(a)
    assert pool.num_free_blocks == 4
    with pytest.raises(ValueError):
        pool.free([a[0]])  # double free


def test_blocks_are_freed_tail_first():
    pool = BlockPool(3)
    table = pool.allocate(3)
    pool.free(table)
    assert pool.allocate(3) == list(reversed(table))
