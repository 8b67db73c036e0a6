"""This gateway's output streams from the decode workers: one per decode instance, shared by
every request the gateway runs there.

A request registers its id, is submitted under its instance's stream id (DecodeWorker.submit),
and reads its TokenDelta items from its own queue; one pump task per instance reads the
instance's `outputs` stream (a list of deltas per engine step, decode_worker.outputs) and hands
each delta to the queue of its request. When that stream
fails (the worker's process died), every request registered on it gets the exception, and
the next request on the instance opens a new stream: Ray restarts a dead worker behind the
same handle.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from pdcluster.engine.protocol import TokenDelta
from pdcluster.router.registry import Instance

log = logging.getLogger(__name__)

#: What a request's queue holds: its deltas, or the exception that ended its instance's stream.
OutputItem = TokenDelta | BaseException


class _Subscription:
    """One decode instance's stream and the queues of the requests on it."""

    def __init__(self, instance: Instance, subscriber: str) -> None:
        self.worker_id, self.subscriber = instance.worker_id, subscriber
        self.queues: dict[str, asyncio.Queue[OutputItem]] = {}
        self.failure: BaseException | None = None
        stream = instance.handle.outputs.options(num_returns="streaming").remote(subscriber)
        self.task = asyncio.get_running_loop().create_task(self._pump(stream),
                                                           name=f"outputs-{instance.worker_id}")

    @property
    def live(self) -> bool:
        return (self.failure is None and not self.task.done()
                and self.task.get_loop() is asyncio.get_running_loop())

    async def _pump(self, stream) -> None:
        try:
            async for ref in stream:
                for delta in await ref:
                    queue = self.queues.get(delta.request_id)
                    if queue is not None:  # else the request stopped listening
                        queue.put_nowait(delta)
            raise ConnectionError("the decode worker closed its output stream")
        except Exception as exc:  # noqa: BLE001 — every waiting request gets it
            self.failure = exc
            log.warning("output stream of decode worker %s ended: %s (%d requests on it)",
                        self.worker_id, exc, len(self.queues))
            for queue in self.queues.values():
                queue.put_nowait(exc)


class DecodeOutputs:
    """The gateway's subscriptions to decode instances' outputs, keyed by worker id."""

    def __init__(self) -> None:
        self._prefix = f"gateway-{uuid.uuid4().hex[:12]}"
        self._num_opened = 0
        self._subscriptions: dict[str, _Subscription] = {}

    def register(self, instance: Instance, request_id: str
                 ) -> tuple[str, asyncio.Queue[OutputItem]]:
        """(subscriber id, queue): submit the request to the instance under that id (after
        this call), and read its deltas from the queue, on the event loop of this call.

        Every stream opened gets an id of its own: one that failed or belongs to a closed
        event loop may still be open at the worker, and must not take the new one's deltas.
        """
        subscription = self._subscriptions.get(instance.worker_id)
        if subscription is None or not subscription.live:
            self._num_opened += 1
            subscription = self._subscriptions[instance.worker_id] = _Subscription(
                instance, f"{self._prefix}-{self._num_opened}")
        queue: asyncio.Queue[OutputItem] = asyncio.Queue()
        subscription.queues[request_id] = queue
        return subscription.subscriber, queue

    def num_requests(self, worker_id: str) -> int:
        """Requests of this gateway streaming from that instance now (any thread)."""
        subscription = self._subscriptions.get(worker_id)
        return len(subscription.queues) if subscription is not None else 0

    def release(self, instance: Instance, request_id: str) -> None:
        """The request no longer reads its queue (finished, failed or abandoned)."""
        subscription = self._subscriptions.get(instance.worker_id)
        if subscription is not None:
            subscription.queues.pop(request_id, None)
