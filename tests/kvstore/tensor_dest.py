"""Test and benchmark helpers for transfers: a destination over a plain tensor, and a
synchronous wait (the product only ever polls, into a CallbackDest over its paged cache)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

import torch

from pdcluster.kvstore.errors import BlockLayoutError
from pdcluster.kvstore.transport.base import TransferState
from pdcluster.kvstore.transport.dest import CallbackDest
from pdcluster.kvstore.transport.runs import budget_runs


class BlockRun(NamedTuple):
    """Request blocks ``[src, src + count)`` go to destination blocks ``[dest, dest + count)``."""

    src: int
    dest: int
    count: int


def coalesce_runs(dest_block_ids: Sequence[int], block_nbytes: int,
                  max_run_bytes: int) -> list[BlockRun]:
    """Group request blocks into runs of consecutive destination ids, each <= ``max_run_bytes``
    (SGLang groups contiguous page runs the same way)::

        request block:   0  1  2  3  4  5
        dest block id:   7  8  9  3  4  12      ->  runs (src, dest, count):
                         └──────┘  └──┘  └┘         (0, 7, 3) (3, 3, 2) (5, 12, 1)

    Ids may repeat or go backwards; a run only continues while ids increase by exactly 1, and
    a single block larger than ``max_run_bytes`` is its own run. Returns the runs in request
    order, covering every request block exactly once.
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


class TensorDest(CallbackDest):
    """Blocks in a block-major tensor ``pool`` [P, *block_shape] (contiguous, any device).

    Request block i lands in ``pool[block_ids[i]]``; ``block_ids`` defaults to ``0..P-1``.
    Writes are coalesced: one copy per run of consecutive ids (:func:`coalesce_runs`).
    """

    def __init__(self, pool: torch.Tensor, block_ids: Sequence[int] | None = None):
        if pool.dim() < 2 or not pool.is_contiguous():
            raise BlockLayoutError(f"destination pool must be a contiguous [P, *block_shape] "
                                   f"tensor, got shape {tuple(pool.shape)}")
        ids = list(range(pool.shape[0])) if block_ids is None else [int(b) for b in block_ids]
        bad = [b for b in ids if not 0 <= b < pool.shape[0]]
        if bad:
            raise BlockLayoutError(f"block ids {bad[:5]} out of range [0, {pool.shape[0]})")
        super().__init__(self._copy, len(ids), pool.shape[1:], pool.dtype)
        self.pool, self.block_ids = pool, ids

    def _copy(self, start: int, blocks: torch.Tensor) -> None:
        ids = self.block_ids[start:start + blocks.shape[0]]
        for run in coalesce_runs(ids, self.block_nbytes, 1 << 62):
            self.pool[run.dest:run.dest + run.count].copy_(blocks[run.src:run.src + run.count])


def wait(transfer, timeout_s: float | None = None, interval_s: float = 0.05) -> TransferState:
    """Poll ``transfer`` (a receiver or sender) every ``interval_s`` until it is done or
    ``timeout_s`` passes; returns its state."""
    end = None if timeout_s is None else time.monotonic() + timeout_s
    while not (state := transfer.poll()).done:
        now = time.monotonic()
        if end is not None and now >= end:
            break
        time.sleep(interval_s if end is None else min(interval_s, end - now))
    return state
