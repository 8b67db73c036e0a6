"""Offline infinite-cache hit ratio on a hand-made workload with a hand-counted answer."""

import pytest

from pdcluster.engine.core.hashing import block_keys
from pdcluster.loadtest.prefix import offline_prefix_hits

B = 4
PROMPTS = [
    list(range(1, 11)),               # blocks [1-4][5-8] + tail 9,10: all new        hit 0
    [1, 2, 3, 4, 5, 6, 7, 8, 99],     # same two blocks, new tail                    hit 8
    [1, 2, 3, 4, 9, 9, 9, 9],         # first block cached, second differs           hit 4
    [5, 6, 7, 8],                     # [5-8] was cached only *after* [1-4]: chained hit 0
    [1, 2, 3, 4, 5, 6, 7, 8],         # fully cached, whole blocks: 8, or 4 if the last
                                      # token must be recomputed (vLLM)
    [9],                              # shorter than a block                          hit 0
]


def test_hand_counted_answer_vllm_definition():
    hits = offline_prefix_hits(PROMPTS, block_size=B)   # prompt tokens, cap last token
    assert hits.hit == [0, 8, 4, 0, 4, 0]
    assert hits.queried == [10, 9, 8, 4, 8, 1]
    assert hits.ratio == pytest.approx(16 / 40)


def test_uncapped_and_full_block_denominator():
    uncapped = offline_prefix_hits(PROMPTS, block_size=B, cap_last_token=False)
    assert uncapped.hit == [0, 8, 4, 0, 8, 0]
    assert uncapped.ratio == pytest.approx(20 / 40)
    full = offline_prefix_hits(PROMPTS, block_size=B, denominator="full_blocks")
    assert full.queried == [8, 8, 8, 4, 8, 0]
    assert full.ratio == pytest.approx(16 / 36)


def test_keys_are_chained():
    """The offline bound keys blocks as the workers do (engine.core.hashing)."""
    a = block_keys([1, 2, 3, 4, 5, 6, 7, 8], B, b"")
    b = block_keys([5, 6, 7, 8], B, b"")
    assert len(a) == 2 and a[1] != b[0]
    assert block_keys([1, 2, 3, 4, 5], B, b"") == a[:1]


def test_empty_and_invalid():
    assert offline_prefix_hits([], B).ratio is None
    with pytest.raises(ValueError):
        offline_prefix_hits(PROMPTS, block_size=0)
    with pytest.raises(ValueError):
        offline_prefix_hits(PROMPTS, denominator="blocks")
