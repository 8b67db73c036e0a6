"""A decode worker's token deltas, batched per step for each subscriber (a gateway process).

One Ray streaming item per request per token cost more CPU than the step itself at high
concurrency: each item is a task return the actor's core worker ships and the gateway's
receives, on the same cores as the forward pass. vLLM's engine core sends one message of
outputs per step for the same reason. Here each gateway opens one stream per decode worker
(DecodeWorker.outputs) and submits requests with its subscriber id; the engine loop's deltas
are collected under a lock and handed to the actor's event loop once per burst, so a step
that emits tokens for 32 requests makes one item, not 32.

    engine loop thread ── emit(delta) ──▶ pending[subscriber]  (first one of a burst schedules
                                                                 one flush on the event loop)
    event loop ── flush ──▶ queue[subscriber] ──▶ outputs(subscriber) yields list[TokenDelta]

A subscriber's stream ending (its gateway gone or closed) aborts the requests it still has
here, so their blocks go back at once.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable

from pdcluster.engine.protocol import TokenDelta


class SubscriberOutputs:
    """Per-subscriber batches of TokenDelta; see the module docstring.

    Args:
        loop: the actor's event loop, where batches are queued and streamed.
        abort: ends a request in the engine (idempotent); called for the requests a closed
            subscriber stream leaves behind.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, abort: Callable[[str], None]) -> None:
        self._loop, self._abort = loop, abort
        self._lock = threading.Lock()
        self._pending: dict[str, list[TokenDelta]] = {}
        self._flush_scheduled = False
        self._queues: dict[str, asyncio.Queue[list[TokenDelta]]] = {}
        self._requests: dict[str, set[str]] = {}  # subscriber -> its unfinished request ids

    def add(self, subscriber: str, request_id: str) -> Callable[[TokenDelta], None]:
        """Registers a request of `subscriber` (event loop); returns the request's emit
        callback for the engine (any thread)."""
        self._queue(subscriber)
        self._requests.setdefault(subscriber, set()).add(request_id)
        return lambda delta: self._emit(subscriber, delta)

    async def stream(self, subscriber: str) -> AsyncIterator[list[TokenDelta]]:
        """The subscriber's deltas, in emission order, a batch per item: every delta queued
        since the last item. Closing it aborts the subscriber's unfinished requests."""
        queue = self._queue(subscriber)
        try:
            while True:
                batch = await queue.get()
                while not queue.empty():  # the consumer fell behind: one item for all
                    batch.extend(queue.get_nowait())
                yield batch
        finally:
            if self._queues.get(subscriber) is queue:
                del self._queues[subscriber]
            for request_id in self._requests.pop(subscriber, ()):
                self._abort(request_id)

    def _queue(self, subscriber: str) -> asyncio.Queue[list[TokenDelta]]:
        queue = self._queues.get(subscriber)
        if queue is None:
            queue = self._queues[subscriber] = asyncio.Queue()
        return queue

    def _emit(self, subscriber: str, delta: TokenDelta) -> None:
        with self._lock:
            self._pending.setdefault(subscriber, []).append(delta)
            schedule, self._flush_scheduled = not self._flush_scheduled, True
        if schedule:
            self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
            self._flush_scheduled = False
        for subscriber, batch in pending.items():
            requests = self._requests.get(subscriber)
            if requests is not None:
                requests.difference_update(d.request_id for d in batch
                                           if d.finish_reason is not None)
            queue = self._queues.get(subscriber)
            if queue is not None:  # else its stream closed: nobody reads these
                queue.put_nowait(batch)
