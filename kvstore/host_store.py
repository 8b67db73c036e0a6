"""Host-DRAM block store of one node: keyed full blocks in an LRU, tails under handles.

Keyed blocks are content-addressed by their chained sha256 key (kvstore.hashing), so a second
put of a key keeps the stored copy and only refreshes its recency. Tail blocks (a request's
partial last block, DESIGN.md "Blocks and keys") are never keyed: they wait under a
per-request handle until the decode worker takes them, and are dropped after ``tail_ttl_s``
so a decode that never comes leaks nothing.

Capacity: keyed blocks and tails both count against ``capacity_bytes``; only keyed blocks are
evicted (least recently put or got first; Mooncake FAST'25 §4 uses LRU for the DRAM pool).

NOTE: this is the walking-skeleton store (payloads are Python ``bytes``). The shared-memory
arena of DESIGN.md "Tiers" replaces the storage, not this interface.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvstore.errors import BlockLayoutError, StoreCapacityError

#: dtype name -> bytes per element. bfloat16 travels as its int16 bit pattern.
DTYPE_ITEMSIZE: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class BlockLayout:
    """Layout of one block: ``dtype`` name (a key of DTYPE_ITEMSIZE) and block ``shape``."""

    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_ITEMSIZE:
            raise BlockLayoutError(
                f"unsupported dtype {self.dtype!r}; expected one of {sorted(DTYPE_ITEMSIZE)}"
            )
        if any(d < 0 for d in self.shape):
            raise BlockLayoutError(f"negative dimension in block shape {self.shape}")

    @property
    def nbytes(self) -> int:
        """Bytes of one block's payload."""
        n = DTYPE_ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n


class StoredTail(NamedTuple):
    """A taken tail block: raw little-endian ``payload``, its ``layout``, valid ``num_tokens``."""

    payload: bytes
    layout: BlockLayout
    num_tokens: int


@dataclass
class _TailEntry:
    tail: StoredTail
    expires_at: float


class HostBlockStore:
    """Thread-safe LRU store of keyed KV blocks plus TTL'd tail blocks.

    Args:
        capacity_bytes: payload budget in bytes (keyed blocks + tails).
        tail_ttl_s: seconds a tail may wait before it is dropped.
        clock: monotonic clock in seconds (injectable for tests).
    """

    def __init__(
        self,
        capacity_bytes: int,
        tail_ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        if tail_ttl_s <= 0:
            raise ValueError(f"tail_ttl_s must be > 0, got {tail_ttl_s}")
        self.capacity_bytes = capacity_bytes
        self.tail_ttl_s = tail_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._blocks: OrderedDict[bytes, tuple[bytes, BlockLayout]] = OrderedDict()
        self._tails: dict[str, _TailEntry] = {}
        self._bytes_used = 0
        self._evictions = 0
        self._expired_tails = 0

    # ---- keyed blocks -------------------------------------------------------------------

    def put(self, key: bytes, payload: bytes, layout: BlockLayout) -> None:
        """Store one keyed block; a key already present is kept and touched (not replaced).

        Raises:
            BlockLayoutError: ``len(payload) != layout.nbytes``.
            StoreCapacityError: the block cannot fit even after evicting every keyed block
                (larger than capacity, or the rest is held by tails).
        """
        _check_payload(payload, layout)
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return
            self._make_room(len(payload), what=f"block {key.hex()}")
            self._blocks[key] = (payload, layout)
            self._bytes_used += len(payload)

    def get(self, key: bytes) -> tuple[bytes, BlockLayout] | None:
        """The block's ``(payload, layout)`` (touching it), or ``None`` if absent."""
        with self._lock:
            entry = self._blocks.get(key)
            if entry is not None:
                self._blocks.move_to_end(key)
            return entry

    def get_many(self, keys: Sequence[bytes]) -> list[tuple[bytes, BlockLayout] | None]:
        """:meth:`get` for each key under one lock acquisition (a consistent snapshot)."""
        with self._lock:
            out: list[tuple[bytes, BlockLayout] | None] = []
            for key in keys:
                entry = self._blocks.get(key)
                if entry is not None:
                    self._blocks.move_to_end(key)
                out.append(entry)
            return out

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is stored (does not touch it)."""
        with self._lock:
            return key in self._blocks

    # ---- tails --------------------------------------------------------------------------

    def put_tail(self, handle: str, payload: bytes, layout: BlockLayout, num_tokens: int) -> None:
        """Store a tail block under ``handle`` (replacing a previous one); expires after TTL.

        Raises:
            ValueError: empty handle or ``num_tokens`` < 0.
            BlockLayoutError: ``len(payload) != layout.nbytes``.
            StoreCapacityError: it cannot fit even after evicting every keyed block.
        """
        if not handle:
            raise ValueError("tail handle must be non-empty")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        _check_payload(payload, layout)
        with self._lock:
            self._expire_tails_locked(self._clock())
            old = self._tails.pop(handle, None)
            if old is not None:
                self._bytes_used -= len(old.tail.payload)
            self._make_room(len(payload), what=f"tail {handle!r}")
            expires_at = self._clock() + self.tail_ttl_s
            self._tails[handle] = _TailEntry(StoredTail(payload, layout, num_tokens), expires_at)
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

    # ---- stats --------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Counters: num_blocks, bytes_used, capacity_bytes, num_tails, evictions, expired_tails."""
        with self._lock:
            self._expire_tails_locked(self._clock())
            return {
                "num_blocks": len(self._blocks),
                "bytes_used": self._bytes_used,
                "capacity_bytes": self.capacity_bytes,
                "num_tails": len(self._tails),
                "evictions": self._evictions,
                "expired_tails": self._expired_tails,
            }

    # ---- internals (caller holds self._lock) --------------------------------------------

    def _make_room(self, nbytes: int, what: str) -> None:
        if nbytes > self.capacity_bytes:
            raise StoreCapacityError(
                f"{what} of {nbytes} bytes exceeds store capacity {self.capacity_bytes} bytes"
            )
        while self._bytes_used + nbytes > self.capacity_bytes and self._blocks:
            _, (payload, _) = self._blocks.popitem(last=False)
            self._bytes_used -= len(payload)
            self._evictions += 1
        if self._bytes_used + nbytes > self.capacity_bytes:
            raise StoreCapacityError(
                f"{what} of {nbytes} bytes does not fit: {self._bytes_used} of "
                f"{self.capacity_bytes} bytes are held by {len(self._tails)} tail(s)"
            )

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


def _check_payload(payload: bytes, layout: BlockLayout) -> None:
    if len(payload) != layout.nbytes:
        raise BlockLayoutError(
            f"payload of {len(payload)} bytes does not match layout {layout} "
            f"({layout.nbytes} bytes)"
        )
