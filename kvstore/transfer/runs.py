"""Grouping blocks into runs: one wire message (or one transfer) per run.

Two groupings, both pure functions (SGLang groups contiguous page runs the same way):

* :func:`budget_runs` splits ``n`` consecutive blocks into runs of at most a byte budget
  (the KV store server and client chunk their streams with it);
* :func:`coalesce_runs` groups a request's blocks whose *destination* block ids are
  consecutive, so each run lands with one copy (or one send/recv), then splits each group
  with :func:`budget_runs`.

::

    request block:   0  1  2  3  4  5
    dest block id:   7  8  9  3  4  12      ->  runs (src, dest, count):
                     └──────┘  └──┘  └┘         (0, 7, 3) (3, 3, 2) (5, 12, 1)

No torch, no gRPC here: the server imports this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class BlockRun(NamedTuple):
    """Request blocks ``[src, src + count)`` go to destination blocks ``[dest, dest + count)``."""

    src: int
    dest: int
    count: int


def budget_runs(block_nbytes: int, num_blocks: int, budget_bytes: int) -> list[range]:
    """Split ``num_blocks`` consecutive blocks into runs of at most ``budget_bytes`` payload.

    Every run holds at least one block (a single block larger than the budget is its own run).
    """
    per_run = max(1, budget_bytes // max(1, block_nbytes))
    return [range(i, min(i + per_run, num_blocks)) for i in range(0, num_blocks, per_run)]


def coalesce_runs(dest_block_ids: Sequence[int], block_nbytes: int,
                  max_run_bytes: int) -> list[BlockRun]:
    """Group request blocks into runs of consecutive destination ids, each <= ``max_run_bytes``.

    Args:
        dest_block_ids: destination block id of request block i, for every i (ids may repeat
            or go backwards; a run only continues while ids increase by exactly 1).
        block_nbytes: bytes of one block.
        max_run_bytes: payload budget of one run (a single larger block is its own run).

    Returns:
        Runs in request order, covering every request block exactly once.
    """
    runs: list[BlockRun] = []
    start = 0
    n = len(dest_block_ids)
    while start < n:
        end = start + 1
        while end < n and dest_block_ids[end] == dest_block_ids[end - 1] + 1:
            end += 1
        for r in budget_runs(block_nbytes, end - start, max_run_bytes):
            runs.append(BlockRun(start + r.start, dest_block_ids[start] + r.start, len(r)))
        start = end
    return runs
