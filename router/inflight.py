"""The gateway's bound on work in flight: a fair queue of sequences, and the drain on shutdown.

Every choice of every prompt is one sequence on a worker (its own request id there), so the gate
counts sequences. A request reserves all of its sequences when it arrives (`InflightGate.open`)
and each sequence then waits for a slot of its own (`GateTicket.acquire`). While `limit` slots
are taken, sequences wait in a queue; slots are handed out round-robin across requests, one
sequence per request per turn, so a request of many sequences cannot starve one of a few.
Requests of a lower `priority` value go first (vLLM's priority scheduling; under the default
policy every request has priority 0), round-robin among those of one priority; the reserve
below does not look at priorities. The last `reserve` free slots go only to a request's first
sequence: a request that arrives while large ones hold the gate starts as soon as one of those
slots is free, instead of after every sequence queued before it (sequences are never
preempted, so without a reserve a newcomer waits for whole running sequences to end).

A request is refused at once — 503 with Retry-After (OpenAI's status for an overloaded server)
— when its sequences do not fit in the queue (`limit + max_queued` in all), or once draining
has begun. Where queued requests of a higher priority value hold the room it lacks, they are
refused instead (reason "preempted"), the least urgent and then the newest first, as SGLang's
scheduler aborts queued requests for a more urgent one (`_abort_on_queued_limit`); only a
request none of whose sequences has started is refused so, so no client sees a reply cut.
Bounding the queue bounds memory; the workers' own queues (the prefill actor's Ray task
queue, the decode engine's waiting list) sit behind it.

    open(n) ──► ticket: n pending ──acquire──► granted (slot held) ──release──► slot free
                      │                 ▲                                         │
                      │                 └─── round-robin over tickets with waiters ┘
                      └──close──► pending sequences withdrawn, held slots returned
"""

from __future__ import annotations

import asyncio
from collections import deque


class Overloaded(Exception):
    """A request refused by the gate. reason: the `pdcluster_requests_rejected_total` label
    ("overloaded", "preempted" or "draining"); retry_after_s: the Retry-After the client gets,
    seconds."""

    def __init__(self, reason: str, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.reason, self.retry_after_s = reason, retry_after_s


class InflightGate:
    """At most `limit` sequences in flight, at most `max_queued` more waiting for a slot.

    Args:
        limit: slots (sequences running on the workers at once); None: unbounded (tests).
        max_queued: sequences that may wait for a slot; None: 4 × limit.
        reserve: free slots kept for requests that hold none yet; None: limit // 8.
        retry_after_s: the Retry-After of a refusal, seconds.

    Raises:
        ValueError: limit < 1, max_queued < 0, or reserve not below limit.

    Not thread-safe: used from the gateway's event loop only.
    """

    def __init__(self, limit: int | None, max_queued: int | None = None,
                 reserve: int | None = None, retry_after_s: float = 1.0) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"in-flight limit must be >= 1 (got {limit})")
        if max_queued is not None and max_queued < 0:
            raise ValueError(f"max_queued must be >= 0 (got {max_queued})")
        self.limit = limit
        self.max_queued = max_queued if max_queued is not None else 4 * (limit or 0)
        self.reserve = reserve if reserve is not None else (limit or 0) // 8
        if limit is not None and not 0 <= self.reserve < limit:
            raise ValueError(f"reserve must be in [0, {limit}) (got {self.reserve})")
        self.retry_after_s = retry_after_s
        self.inflight = 0
        self.queued = 0  # reserved by open tickets, not yet granted
        self.draining = False
        # tickets with waiters, in turn order, by priority
        self._rotations: dict[int, deque[GateTicket]] = {}
        # tickets no sequence of which has had a slot yet, in arrival order (the only ones a
        # more urgent request may push out)
        self._unstarted: dict[GateTicket, None] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    def open(self, num_sequences: int, priority: int = 0) -> "GateTicket":
        """Reserves room for a request of `num_sequences` sequences; each then takes its slot
        with `ticket.acquire()`, before those of requests with a higher `priority` value.
        Close the ticket when the request ends.

        Raises Overloaded when draining or when the sequences would overflow the queue even
        after refusing every unstarted request of a higher priority value.
        """
        if self.draining:
            raise Overloaded("draining", "the server is shutting down; retry on another "
                             "replica", self.retry_after_s)
        if self.limit is not None:
            excess = self.inflight + self.queued + num_sequences - self.limit - self.max_queued
            if excess > 0:
                self._make_room(excess, priority)
        self.queued += num_sequences
        self._idle.clear()
        ticket = GateTicket(self, num_sequences, priority)
        self._unstarted[ticket] = None
        return ticket

    def _make_room(self, excess: int, priority: int) -> None:
        """Refuses unstarted requests less urgent than `priority` until `excess` queued
        sequences are gone; raises Overloaded, refusing none, when they hold fewer."""
        victims, freed = [], 0
        for ticket in sorted(reversed(self._unstarted), key=lambda t: -t.priority):
            if freed >= excess or ticket.priority <= priority:
                break
            victims.append(ticket)
            freed += ticket.pending
        if freed < excess:
            raise Overloaded("overloaded", f"the server is at its limit of {self.limit} "
                             f"sequences in flight and {self.max_queued} queued; retry later",
                             self.retry_after_s)
        for ticket in victims:
            ticket._refuse(Overloaded("preempted", "the request was refused while queued: "
                                      "the queue is full and a request of higher priority "
                                      "came; retry later", self.retry_after_s))

    def start_draining(self) -> None:
        """From now on every request is refused (reason "draining"). Idempotent."""
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once nothing is in flight or queued, False if `timeout_s` passes first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def _eligible(self, ticket: "GateTicket") -> bool:
        if self.limit is None:
            return True
        free = self.limit - self.inflight
        return free > 0 and (ticket.held == 0 or free > self.reserve)

    def _grant(self, ticket: "GateTicket") -> None:
        self._unstarted.pop(ticket, None)
        ticket.held += 1
        ticket.pending -= 1
        self.inflight += 1
        self.queued -= 1

    def _dispatch(self) -> None:
        """Hands free slots to waiting sequences, one per ticket per turn, the lowest
        priority value first."""
        while any(self._turn(priority) for priority in sorted(self._rotations)):
            pass  # one slot granted: start again from the lowest priority value

    def _turn(self, priority: int) -> bool:
        """Grants one slot to the next eligible ticket of `priority` in turn; False when a
        full turn grants nothing."""
        rotation = self._rotations[priority]
        granted = False
        for _ in range(len(rotation)):
            ticket = rotation.popleft()
            granted = self._eligible(ticket) and ticket._wake_one()
            if ticket._waiters:
                rotation.append(ticket)
            if granted:
                break
        if not rotation:
            del self._rotations[priority]
        return granted

    def _enqueue(self, ticket: "GateTicket") -> None:
        rotation = self._rotations.setdefault(ticket.priority, deque())
        if ticket not in rotation:
            rotation.append(ticket)

    def _dequeue(self, ticket: "GateTicket") -> None:
        rotation = self._rotations.get(ticket.priority)
        if rotation is not None and ticket in rotation:
            rotation.remove(ticket)
            if not rotation:
                del self._rotations[ticket.priority]

    def _check_idle(self) -> None:
        if self.inflight <= 0 and self.queued <= 0:
            self.inflight = self.queued = 0
            self._idle.set()


class GateTicket:
    """One request's sequences at the gate: `acquire` a slot per sequence before it starts,
    `release` it when the sequence ends, `close` when the request ends (idempotent)."""

    def __init__(self, gate: InflightGate, num_sequences: int, priority: int = 0) -> None:
        self._gate = gate
        self.priority = priority
        self.pending = num_sequences
        self.held = 0
        self._waiters: deque[asyncio.Future] = deque()
        self._closed = False
        self._refused: Overloaded | None = None

    async def acquire(self) -> None:
        """Waits for a slot for one sequence of this request (FIFO within the request).

        Raises Overloaded (reason "preempted") once the gate refused the queued request for a
        more urgent one; RuntimeError when all reserved sequences were already granted or the
        ticket is closed; asyncio.CancelledError leaves nothing taken.
        """
        gate = self._gate
        if self._refused is not None:
            raise self._refused
        if self._closed or self.pending <= 0:
            raise RuntimeError("no reserved sequence left on this gate ticket")
        # every ticket that waits is ineligible (_dispatch ran), so a slot free now is one of
        # the reserve: a first sequence takes it whatever the priority of those waiting
        if not self._waiters and gate._eligible(self):
            gate._grant(self)
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        gate._enqueue(self)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # granted as we were cancelled
                self.release()
            else:
                self._forget(waiter)
            raise

    def release(self) -> None:
        """Returns one held slot and hands it on."""
        if self.held <= 0:
            return
        self.held -= 1
        self._gate.inflight -= 1
        self._gate._dispatch()
        self._gate._check_idle()

    def close(self) -> None:
        """Withdraws every sequence not yet granted and returns every held slot."""
        if self._closed:
            return
        self._closed = True
        gate = self._gate
        for waiter in self._waiters:
            waiter.cancel()
        self._waiters.clear()
        gate._unstarted.pop(self, None)
        gate._dequeue(self)
        gate.queued -= self.pending
        self.pending = 0
        gate.inflight -= self.held
        self.held = 0
        gate._dispatch()
        gate._check_idle()

    def _refuse(self, error: Overloaded) -> None:
        """Withdraws this unstarted request: its waiters, and every later `acquire`, raise
        `error`; `close` is still due."""
        self._refused = error
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(error)
        self._waiters.clear()
        gate = self._gate
        gate._unstarted.pop(self, None)
        gate._dequeue(self)
        gate.queued -= self.pending
        self.pending = 0
        gate._check_idle()

    def _wake_one(self) -> bool:
        """Grants the oldest live waiter a slot; False when none is left."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._gate._grant(self)
                waiter.set_result(None)
                return True
        return False

    def _forget(self, waiter: asyncio.Future) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass
        if not self._waiters:
            self._gate._dequeue(self)
