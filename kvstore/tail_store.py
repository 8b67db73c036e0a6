"""Tail blocks of one node's KV store: a request's partial last block, under a handle.

Tails (the partial last block of a prompt) are never keyed or indexed: prefill leaves one under a
per-request handle and the decode worker takes it. A tail not taken within ``tail_ttl_s`` is
dropped, so a decode that never comes leaks nothing. Keyed full blocks live in the node's
arena and SSD tier (kvstore.node_store), never here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from pdcluster.kvstore.errors import StoreCapacityError
from pdcluster.kvstore.layout import BlockLayout, check_payload



def check_tail(handle: str, payload: bytes, layout: BlockLayout, num_tokens: int) -> None:
    """Raises ValueError (empty handle, ``num_tokens`` < 0) or BlockLayoutError
    (``len(payload) != layout.nbytes``) for a tail no store should keep."""
    if not handle:
        raise ValueError("tail handle must be non-empty")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    check_payload(payload, layout)


class StoredTail(NamedTuple):
    """A taken tail block: raw little-endian ``payload``, its ``layout``, valid ``num_tokens``."""

    payload: bytes
    layout: BlockLayout
    num_tokens: int


@dataclass
class _TailEntry:
    tail: StoredTail
    expires_at: float


class TailStore:
    """Thread-safe store of tail blocks under handles, each dropped after ``tail_ttl_s``.

    Args:
        capacity_bytes: payload budget in bytes of the tails held at once.
        tail_ttl_s: seconds a tail may wait before it is dropped.
        clock: monotonic clock in seconds (injectable for tests).
    """

    def __init__(self, capacity_bytes: int, tail_ttl_s: float,
                 clock: Callable[[], float] = time.monotonic):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        if tail_ttl_s <= 0:
            raise ValueError(f"tail_ttl_s must be > 0, got {tail_ttl_s}")
        self.capacity_bytes = capacity_bytes
        self.tail_ttl_s = tail_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._tails: dict[str, _TailEntry] = {}
        self._bytes_used = 0
        self._expired_tails = 0

    def put_tail(self, handle: str, payload: bytes, layout: BlockLayout, num_tokens: int) -> None:
        """Store a tail block under ``handle`` (replacing a previous one); expires after TTL.

        Raises:
            ValueError: empty handle or ``num_tokens`` < 0.
            BlockLayoutError: ``len(payload) != layout.nbytes``.
            StoreCapacityError: the tails held would exceed ``capacity_bytes``.
        """
        check_tail(handle, payload, layout, num_tokens)
        with self._lock:
            now = self._clock()
            self._expire_tails_locked(now)
            old = self._tails.pop(handle, None)
            if old is not None:
                self._bytes_used -= len(old.tail.payload)
            if self._bytes_used + len(payload) > self.capacity_bytes:
                raise StoreCapacityError(
                    f"tail {handle!r} of {len(payload)} bytes does not fit: {self._bytes_used} "
                    f"of {self.capacity_bytes} bytes are held by {len(self._tails)} tail(s)")
            self._tails[handle] = _TailEntry(StoredTail(payload, layout, num_tokens),
                                             now + self.tail_ttl_s)
            self._bytes_used += len(payload)

    def take_tail(self, handle: str) -> StoredTail | None:
        """Return and remove the tail under ``handle``; ``None`` if absent or expired."""
        with self._lock:
            self._expire_tails_locked(self._clock())
            entry = self._tails.pop(handle, None)
            if entry is None:
                return None
            self._bytes_used -= len(entry.tail.payload)
            return entry.tail

    def release_tail(self, handle: str) -> bool:
        """Drop the tail under ``handle``. Idempotent: ``False`` if it was not there."""
        return self.take_tail(handle) is not None

    def expire_tails(self) -> int:
        """Drop every tail past its TTL; returns how many were dropped (the periodic sweep)."""
        with self._lock:
            return self._expire_tails_locked(self._clock())

    def stats(self) -> dict[str, int]:
        """Counters: num_tails, bytes_used, capacity_bytes, expired_tails."""
        with self._lock:
            self._expire_tails_locked(self._clock())
            return {"num_tails": len(self._tails), "bytes_used": self._bytes_used,
                    "capacity_bytes": self.capacity_bytes,
                    "expired_tails": self._expired_tails}

    def _expire_tails_locked(self, now: float) -> int:
        # NOTE: the TTL is constant and put_tail re-inserts, so dict order is expiry order:
        # stop at the first live tail.
        dropped = 0
        while self._tails:
            handle, entry = next(iter(self._tails.items()))
            if entry.expires_at > now:
                break
            del self._tails[handle]
            self._bytes_used -= len(entry.tail.payload)
            dropped += 1
        self._expired_tails += dropped
        return dropped
