"""Where gateway replicas publish their routing decisions for the others to read.

A prefill worker's queue report (router.policies.live_loads) covers every gateway's requests,
but only as of the last poll: requests that arrive together at several gateways would all
be sent to the instance that looked idle. So each Conductor also publishes what it routed
(instance, predicted prefill seconds) as it routes, and reads the others' as they come: on
Redis when the index is there (a stream, read with XREAD BLOCK: pushed, not polled), else on
a detached Ray actor of the deployment's namespace (a call that returns as soon as there is
something new). In the simulator, replicas that see each other's decisions as they are made
route as one Conductor does (benchmarks/RESULTS.md, "Gateway replicas").
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

#: Decisions kept for readers that fall behind (a new reader starts at the end).
MAX_KEPT = 4096
#: The longest a read waits for something new, seconds.
READ_WAIT_S = 1.0
BOARD_ACTOR_NAME = "pdcluster-routing-decisions"


@dataclass(frozen=True)
class SharedDecision:
    """gateway: the publishing gateway's id; instance_id: the prefill instance it chose;
    exec_s: its predicted prefill seconds (the cost model's, before calibration)."""

    gateway: str
    instance_id: str
    exec_s: float


class _BoardActor:
    """The embedded board: the last MAX_KEPT decisions with their sequence numbers."""

    def __init__(self) -> None:
        self._items: deque[tuple[int, tuple]] = deque(maxlen=MAX_KEPT)
        self._seq = 0
        self._new = asyncio.Event()

    async def publish(self, item: tuple) -> None:
        self._seq += 1
        self._items.append((self._seq, item))
        self._new.set()
        self._new = asyncio.Event()

    async def since(self, seq: int, wait_s: float) -> tuple[int, list[tuple]]:
        """(latest seq, the items after `seq`), waiting up to `wait_s` for one; seq < 0: the
        latest seq and nothing."""
        if seq < 0:
            return self._seq, []
        if seq >= self._seq:
            try:
                await asyncio.wait_for(self._new.wait(), wait_s)
            except asyncio.TimeoutError:
                return self._seq, []
        return self._seq, [item for s, item in self._items if s > seq]


class DecisionBoard:
    """This gateway's end of the board: `publish` its decisions, and `on_peer` is called (on
    a reader thread) with every other gateway's. Use start() / stop()."""

    def __init__(self, on_peer: Callable[[SharedDecision], None]) -> None:
        self.gateway = uuid.uuid4().hex[:12]
        self.on_peer = on_peer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decision-board", daemon=True)

    def start(self) -> DecisionBoard:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=READ_WAIT_S + 5)

    def publish(self, instance_id: str, exec_s: float) -> None:
        try:
            self._put((self.gateway, instance_id, float(exec_s)))
        except Exception as exc:  # noqa: BLE001 — a lost publish costs the peers some accuracy
            log.debug("routing decision not published: %s", exc)

    def _deliver(self, items: list[tuple]) -> None:
        for gateway, instance_id, exec_s in items:
            if gateway != self.gateway:
                self.on_peer(SharedDecision(gateway, instance_id, exec_s))

    def _run(self) -> None:
        cursor = None
        while not self._stop.is_set():
            try:
                cursor = self._read(cursor)
            except Exception as exc:  # noqa: BLE001 — retried; peers' decisions are a hint
                log.debug("routing decisions not read: %s", exc)
                self._stop.wait(READ_WAIT_S)

    def _put(self, item: tuple) -> None:
        raise NotImplementedError

    def _read(self, cursor):
        """Deliver what came after `cursor` (None: start at the end); return the new one."""
        raise NotImplementedError


class ActorDecisionBoard(DecisionBoard):
    """On a detached named actor in this process's Ray namespace, on the head node."""

    def __init__(self, on_peer: Callable[[SharedDecision], None]) -> None:
        super().__init__(on_peer)
        import ray

        from pdcluster.kvstore.index.actor import HEAD_NODE_RESOURCE

        self._actor = ray.remote(num_cpus=0)(_BoardActor).options(
            name=BOARD_ACTOR_NAME, get_if_exists=True, lifetime="detached", max_restarts=-1,
            resources={HEAD_NODE_RESOURCE: 0.001}).remote()

    def _put(self, item: tuple) -> None:
        self._actor.publish.remote(item)  # not waited for

    def _read(self, cursor):
        import ray

        seq, items = ray.get(self._actor.since.remote(-1 if cursor is None else cursor,
                                                      READ_WAIT_S), timeout=READ_WAIT_S + 10)
        self._deliver([tuple(i) for i in items])
        return seq


class RedisDecisionBoard(DecisionBoard):
    """On a Redis stream beside the index (`url`: the index's redis:// URL)."""

    def __init__(self, on_peer: Callable[[SharedDecision], None], url: str,
                 namespace: str = "pdcluster") -> None:
        super().__init__(on_peer)
        import redis

        self._redis = redis.Redis.from_url(url, socket_timeout=READ_WAIT_S + 5)
        self._key = f"{namespace}:routing-decisions"

    def _put(self, item: tuple) -> None:
        gateway, instance_id, exec_s = item
        self._redis.xadd(self._key, {"g": gateway, "i": instance_id, "e": repr(exec_s)},
                         maxlen=MAX_KEPT, approximate=True)

    def _read(self, cursor):
        if cursor is None:  # start at the end: the last entry's id, or before the first
            last = self._redis.xrevrange(self._key, count=1)
            return last[0][0] if last else b"0-0"
        found = self._redis.xread({self._key: cursor}, block=int(READ_WAIT_S * 1000))
        for _, entries in found or ():
            for entry_id, fields in entries:
                cursor = entry_id
                self._deliver([(fields[b"g"].decode(), fields[b"i"].decode(),
                                float(fields[b"e"]))])
        return cursor


def open_board(index_url: str | None, on_peer: Callable[[SharedDecision], None]
               ) -> DecisionBoard:
    """Redis when the index is on Redis, else the embedded actor."""
    if index_url and urlsplit(index_url).scheme in ("redis", "rediss", "unix"):
        return RedisDecisionBoard(on_peer, index_url)
    return ActorDecisionBoard(on_peer)
