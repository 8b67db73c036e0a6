"""How a prefill worker and its decode peer reach each other for layer streaming (control
plane only: announces and cancels over Ray, never KV bytes).

Workers are found by worker id: each prefill and decode actor registers a small named entry
actor (``pdcluster-peer:<worker id>``, owned by the worker, so it dies with it) that holds the
worker's own handle; the other side looks it up once and caches the handle (a restarted actor
keeps its handle).
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from typing import Any

import ray

from pdcluster.engine import ray_calls

log = logging.getLogger(__name__)

ENTRY_PREFIX = "pdcluster-peer:"


class StreamPeers(abc.ABC):
    """The calls one worker makes on its peers; all fire-and-forget, none raises."""

    @abc.abstractmethod
    def announce(self, decode_id: str, announce: Any) -> bool:
        """Tell decode ``decode_id`` a layer stream is coming. False: peer unknown (the
        prefill then streams nothing; the decode fetches the request's KV whole)."""

    @abc.abstractmethod
    def cancel_at_decode(self, decode_id: str, request_id: str) -> None:
        """The prefill gave the request up: the decode drops its reservation."""

    @abc.abstractmethod
    def cancel_at_prefill(self, prefill_id: str, request_id: str) -> None:
        """The decode gave the request up: the prefill stops computing and streaming it."""


@ray.remote(num_cpus=0)
class _PeerEntry:
    def __init__(self, handle) -> None:
        self._handle = handle

    def handle(self):
        return self._handle


def register_self(worker_id: str, namespace: str | None, timeout_s: float = 60.0):
    """From inside a worker actor: make it findable by ``worker_id`` (replacing an entry a
    previous actor of that id left behind). Returns the entry's handle: keep it, Ray reclaims
    a non-detached actor, named or not, once no handle to it is left.

    The entry is a new actor, so a new worker process: ``timeout_s`` (seconds) allows for a
    node busy starting its other workers. Raises GetTimeoutError past it."""
    name = ENTRY_PREFIX + worker_id
    me = ray.get_runtime_context().current_actor
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        except ValueError:
            pass  # none
        try:
            entry = _PeerEntry.options(name=name, namespace=namespace).remote(me)
            ray_calls.result(entry.handle.remote(), timeout_s)
            return entry
        except ValueError:  # the old entry's name is not free yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class RayStreamPeers(StreamPeers):
    """Peers found through their entry actors; handles cached (thread-safe)."""

    def __init__(self, namespace: str | None, timeout_s: float = 10.0) -> None:
        self.namespace, self.timeout_s = namespace, timeout_s
        self._handles: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _handle(self, worker_id: str):
        with self._lock:
            handle = self._handles.get(worker_id)
        if handle is None:
            try:
                entry = ray.get_actor(ENTRY_PREFIX + worker_id, namespace=self.namespace)
                handle = ray_calls.result(entry.handle.remote(), self.timeout_s)
            except Exception as exc:  # noqa: BLE001 — unknown, dead or slow: no streaming
                log.warning("layer-stream peer %s not found: %s", worker_id, exc)
                return None
            with self._lock:
                self._handles[worker_id] = handle
        return handle

    def _call(self, worker_id: str, method: str, *args) -> bool:
        handle = self._handle(worker_id)
        if handle is None:
            return False
        try:
            getattr(handle, method).remote(*args)
            return True
        except Exception as exc:  # noqa: BLE001 — a dead peer: forget it, the call is moot
            log.warning("%s on peer %s failed: %s", method, worker_id, exc)
            with self._lock:
                self._handles.pop(worker_id, None)
            return False

    def announce(self, decode_id: str, announce: Any) -> bool:
        return self._call(decode_id, "expect_layer_stream", announce)

    def cancel_at_decode(self, decode_id: str, request_id: str) -> None:
        self._call(decode_id, "cancel_layer_stream", request_id)

    def cancel_at_prefill(self, prefill_id: str, request_id: str) -> None:
        self._call(prefill_id, "cancel_layer_stream", request_id)
