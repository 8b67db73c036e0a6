"""A simulated decode instance: continuous batching with closed-form step times.

Every step emits one token per running sequence and takes T_step(b, C) with b sequences holding
C context tokens; C grows by b per step. Between membership changes b is fixed, so n steps from
a boundary with (b, C) take

    T(n) = n·(d + f·b) + e·(n·C + b·n(n−1)/2)            (CostModel: d, e, f)

and the simulator jumps from one membership change to the next instead of stepping: events are
joins and finishes only, two per request. A sequence joins at the first step boundary at or
after it arrives and finishes at the boundary of its last token. Admission (KV room, step time
within the TBT SLO) is the caller's; with `queue_when_full` a sequence that does not fit waits
(FIFO) and joins when finishes free room.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable

from pdcluster.router.cost_model import CostModel
from pdcluster.router.policies.base import DecodeLoad


@dataclass(slots=True)
class _Seq:
    request_id: str
    join_step: int
    join_ctx: int
    steps: int
    joined_at: float = 0.0


class DecodeInstance:
    """`on_finish(request_id, joined_at, finished_at)` is called at each finish."""

    def __init__(self, instance_id: str, cost: CostModel, capacity_tokens: int | None,
                 on_finish: Callable[[str, float, float], None]) -> None:
        self.instance_id = instance_id
        self.cost = cost
        self.capacity_tokens = capacity_tokens
        self.on_finish = on_finish
        self.t = 0.0  # time of the step boundary the state describes
        self.step = 0
        self.context_tokens = 0
        self._running: dict[str, _Seq] = {}
        self._finish_heap: list[tuple[int, str]] = []
        self._waiting: deque[_Seq] = deque()

    @property
    def batch_size(self) -> int:
        return len(self._running)

    def load(self) -> DecodeLoad:
        waiting = sum(s.join_ctx for s in self._waiting)
        return DecodeLoad(self.instance_id, len(self._running) + len(self._waiting),
                          self.context_tokens + waiting, self.capacity_tokens)

    def _span(self, n: int) -> float:
        b, c = len(self._running), self.cost
        return n * (c.step_base_s + c.step_per_sequence_s * b) + \
            c.step_per_context_token_s * (n * self.context_tokens + b * n * (n - 1) / 2)

    def _steps_to_reach(self, dt: float) -> int:
        """The fewest steps n >= 1 with T(n) >= dt."""
        b, c = len(self._running), self.cost
        quad = c.step_per_context_token_s * b / 2
        lin = c.step_base_s + c.step_per_sequence_s * b + \
            c.step_per_context_token_s * self.context_tokens - quad
        if quad > 0:
            n = math.ceil((-lin + math.sqrt(lin * lin + 4 * quad * dt)) / (2 * quad))
        else:
            n = math.ceil(dt / lin)
        n = max(1, n)
        while n > 1 and self._span(n - 1) >= dt:
            n -= 1
        while self._span(n) < dt:
            n += 1
        return n

    def _advance(self, n: int) -> None:
        self.t += self._span(n)
        self.context_tokens += len(self._running) * n
        self.step += n

    def advance_to(self, t: float) -> None:
        """Run to the first step boundary at or after `t`, delivering finishes on the way."""
        while self._running and self.t < t:
            n_finish = self._finish_heap[0][0] - self.step
            if self.t + self._span(n_finish) <= t:
                self._advance(n_finish)
                self._finish_due()
            else:
                self._advance(self._steps_to_reach(t - self.t))
        if not self._running and t != math.inf:
            self.t = max(self.t, t)

    def _finish_due(self) -> None:
        while self._finish_heap and self._finish_heap[0][0] <= self.step:
            _, rid = heapq.heappop(self._finish_heap)
            seq = self._running.pop(rid)
            self.context_tokens -= seq.join_ctx + (self.step - seq.join_step)
            self.on_finish(rid, seq.joined_at, self.t)
        while self._waiting and self.fits(self._waiting[0].join_ctx):
            self._start(self._waiting.popleft())

    def fits(self, tokens: int) -> bool:
        """Room for `tokens` more context (an empty instance takes any one sequence)."""
        return self.capacity_tokens is None or not self._running or \
            self.context_tokens + tokens <= self.capacity_tokens

    def join(self, request_id: str, context_tokens: int, steps: int, at: float,
             queue_when_full: bool = False) -> bool:
        """Add a sequence of `context_tokens` that will run `steps` steps. Returns False (and
        does nothing) when it does not fit and `queue_when_full` is off."""
        self.advance_to(at)
        seq = _Seq(request_id, 0, context_tokens, max(1, steps))
        if self._waiting or not self.fits(context_tokens):
            if not queue_when_full:
                return False
            self._waiting.append(seq)
            return True
        self._start(seq)
        return True

    def _start(self, seq: _Seq) -> None:
        seq.join_step, seq.joined_at = self.step, self.t
        self._running[seq.request_id] = seq
        self.context_tokens += seq.join_ctx
        heapq.heappush(self._finish_heap, (self.step + seq.steps, seq.request_id))

    def stall(self, at: float, seconds: float) -> float:
        """The instance computes something else (a prompt the PD decider kept here) for
        `seconds` from the first step boundary at or after `at`: every running sequence's
        next token waits that long. Returns when the stall ends."""
        self.advance_to(at)
        self.t = max(self.t, at) + seconds
        return self.t

    def drain(self) -> None:
        """Run every sequence to completion."""
        self.advance_to(math.inf)
