"""The gateway's bound on work in flight, and its drain on shutdown (issue 9 "Overload").

Every choice of every request is one sequence on a worker (its own request id there), so the
gate counts sequences: a request of P prompts with n choices each takes P × n slots, capped at
the limit (so one large request can still run alone). Past the limit, or once draining has
begun, a request is refused at once — 503 with Retry-After (OpenAI's status for an overloaded
server) — instead of queueing without bound in the workers (the prefill actor's Ray task queue
and the decode engine's waiting list grow with whatever is sent to them).
"""

from __future__ import annotations

import asyncio


class Overloaded(Exception):
    """A request refused by the gate. reason: the `pdcluster_requests_rejected_total` label
    ("overloaded" or "draining"); retry_after_s: the Retry-After the client gets, seconds."""

    def __init__(self, reason: str, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.reason, self.retry_after_s = reason, retry_after_s


class InflightGate:
    """Admits sequences while fewer than `limit` are in flight and draining has not begun.

    Not thread-safe: used from the gateway's event loop only. limit None: unbounded (tests).
    """

    def __init__(self, limit: int | None, retry_after_s: float = 1.0) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"in-flight limit must be >= 1 (got {limit})")
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.inflight = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    def acquire(self, n: int) -> int:
        """Takes slots for a request of `n` sequences; returns how many (release that many).

        Raises Overloaded when draining or when they would exceed the limit.
        """
        if self.draining:
            raise Overloaded("draining", "the server is shutting down; retry on another "
                             "replica", self.retry_after_s)
        need = n if self.limit is None else min(n, self.limit)
        if self.limit is not None and self.inflight + need > self.limit:
            raise Overloaded("overloaded", f"the server is at its limit of {self.limit} "
                             "sequences in flight; retry later", self.retry_after_s)
        self.inflight += need
        self._idle.clear()
        return need

    def release(self, taken: int) -> None:
        self.inflight -= taken
        if self.inflight <= 0:
            self.inflight = 0
            self._idle.set()

    def start_draining(self) -> None:
        """From now on every request is refused (reason "draining"). Idempotent."""
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once nothing is in flight, False if `timeout_s` passes first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
