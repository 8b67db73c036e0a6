"""A worker's device cache (G1) in the global KV index: its block pool's cache events, sent off
the engine loop, and a periodic check that the index still lists them.

The engine loop calls `send()` after each step that may have stored or evicted blocks; the
events go to the index on the executor the caller gives (prefill: the one that also delivers
results, so a request's events reach the index before its caller gets the result). Every
`check_s`, the same call also checks one cached key: when the index lost the worker's entries
(Redis restarted empty, or events failed to reach it), every cached key is announced again.
An index outage costs prefix hits, never requests: failures are logged, not raised.

With `min_interval_s` the events of several steps go out together, at most one batch per
interval: a decode worker, whose allocations evict cached blocks at nearly every step, would
otherwise send the index a batch per step. The prefill keeps 0, as its results wait for their
events.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Executor

from pdcluster.engine.core.block_pool import BlockPool
from pdcluster.engine.core.kv_events import BlockStored
from pdcluster.kvstore.index.base import KVIndex, Location

log = logging.getLogger(__name__)

INDEX_CHECK_S = 2.0


class DeviceCacheFeed:
    """Feeds `pool`'s events to `index` under `location` (node, "device", worker id).

    Attributes:
        reannouncements_total: times the index had lost this worker's entries and every cached
            key was announced again.
    """

    def __init__(self, pool: BlockPool, index: KVIndex | None, location: Location,
                 executor: Executor, check_s: float | None = None,
                 min_interval_s: float = 0.0) -> None:
        self.pool, self.index, self.location = pool, index, location
        self._executor = executor
        self._check_s = INDEX_CHECK_S if check_s is None else check_s
        self._min_interval_s = min_interval_s
        self._checked_at = self._sent_at = 0.0
        self._pending: list = []
        self.reannouncements_total = 0

    def send(self) -> None:
        """On the engine loop: take the pool's events and hand them to the executor (dropped
        without an index, so they never pile up)."""
        events = self.pool.take_events()
        if self.index is None:
            return
        self._pending += events
        now = time.monotonic()
        if self._pending and now - self._sent_at < self._min_interval_s:
            return  # they go with a later step's
        check = now - self._checked_at >= self._check_s
        if check:
            self._checked_at = now
        if self._pending or check:
            self._sent_at = now
            events, self._pending = self._pending, []
            self._executor.submit(self._apply, events,
                                  self.pool.cached_keys() if check else None)

    def _apply(self, events: list, cached_keys: list[bytes] | None) -> None:
        try:
            if events:
                self.index.apply_events(self.location, events)
            if cached_keys and self.location not in self.index.lookup(cached_keys[:1])[0]:
                self.index.apply_events(self.location, [BlockStored(tuple(cached_keys))])
                self.reannouncements_total += 1
        except Exception as exc:  # noqa: BLE001 — an index outage costs hits, not requests
            log.warning("G1 events of %s not indexed: %s", self.location.instance_id, exc)


def device_feed(index: KVIndex | None, location: Location, min_interval_s: float = 0.0):
    """An engine's kv_events (engine.core.engine_core.KVEventFeedFactory): a DeviceCacheFeed
    of its block pool to ``index`` under ``location``."""
    return lambda pool, executor: DeviceCacheFeed(pool, index, location, executor,
                                                  min_interval_s=min_interval_s)
