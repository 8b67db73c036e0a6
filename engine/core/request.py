"""What the scheduler needs of a request, and the states it moves a request through.

    WAITING ──admit──▶ WAITING_FOR_KV ──KV landed──▶ RUNNING ──stop / length / abort──▶ FINISHED
       ▲  (blocks for the prompt           (a request that computes its own prompt
       │   and the first fed token)          skips WAITING_FOR_KV)
       └──── PREEMPTED ◀──no free block for a running request (the newest one goes)
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class SchedulableRequest(Protocol):
    """A worker's request as the scheduler sees it.

    num_tokens: prompt plus output tokens so far; num_prompt_tokens: the prompt's length;
    block_table: the cache blocks it holds, in position order (grown and emptied in place);
    arrival: set by the scheduler, increasing in arrival order;
    block_keys: prefix-cache keys of the prompt's full blocks (empty: nothing to look up);
    num_computed_tokens: tokens whose KV is in its blocks (set on admission from the prefix
    hits, counted up by the engine as chunks and decode steps run or KV lands; back to what the
    blocks still hold after a preemption by recompute or a failed load, from where the
    scheduler catches it up in chunks again);
    runs_alone: its forwards must not share a step with another request's.
    """

    request_id: str
    status: RequestStatus
    block_table: list[int]
    arrival: int
    block_keys: Sequence[bytes]
    num_computed_tokens: int
    runs_alone: bool

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...
