"""Grouping blocks into runs: one wire message (or one transfer) per run.

:func:`budget_runs` splits ``n`` consecutive blocks into runs of at most a byte budget (the KV
store server and client chunk their streams with it, the torch backend its sends and
receives). No torch, no gRPC here: the server imports this module.
"""

from __future__ import annotations


def budget_runs(block_nbytes: int, num_blocks: int, budget_bytes: int) -> list[range]:
    """Split ``num_blocks`` consecutive blocks into runs of at most ``budget_bytes`` payload.

    Every run holds at least one block (a single block larger than the budget is its own run).
    """
    per_run = max(1, budget_bytes // max(1, block_nbytes))
    return [range(i, min(i + per_run, num_blocks)) for i in range(0, num_blocks, per_run)]
