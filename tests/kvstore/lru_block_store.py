"""LRUBlockStore: an in-memory BlockStore (kvstore.server) for tests that need a KV store
gRPC server without the node's shared-memory arena, SSD tier or index.

Keyed blocks are Python ``bytes`` in an LRU (a second put of a key keeps the stored copy and
only touches it); tails are the product's TailStore. Both count against one
``capacity_bytes``; only keyed blocks are evicted, least recently put or got first, and never
a pinned one (pins follow kvstore.node_store_api: remove skips them).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from pdcluster.kvstore.config import KVStoreConfig
from pdcluster.kvstore.errors import StoreCapacityError
from pdcluster.kvstore.layout import BlockLayout, check_payload
from pdcluster.kvstore.server import KVStoreServer
from pdcluster.kvstore.tail_store import StoredTail, TailStore, check_tail


class LRUBlockStore:
    """Thread-safe LRU of keyed blocks plus TTL'd tails, in one byte budget.

    Args:
        capacity_bytes: payload budget in bytes (keyed blocks + tails).
        tail_ttl_s: seconds a tail may wait before it is dropped.
        clock: monotonic clock in seconds.
    """

    def __init__(self, capacity_bytes: int, tail_ttl_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.tails = TailStore(capacity_bytes, tail_ttl_s, clock)
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._blocks: OrderedDict[bytes, tuple[bytes, BlockLayout]] = OrderedDict()
        self._block_bytes = 0
        self._evictions = 0
        self._pinned: set[bytes] = set()

    @classmethod
    def for_config(cls, config: KVStoreConfig) -> LRUBlockStore:
        """A store of ``config.tail_capacity_bytes`` with ``config.tail_ttl_s``."""
        return cls(config.tail_capacity_bytes, config.tail_ttl_s)

    def put(self, key: bytes, payload: bytes, layout: BlockLayout) -> None:
        """Store one keyed block; a key already present is kept and touched (not replaced).

        Raises BlockLayoutError (payload/layout mismatch) and StoreCapacityError (it cannot
        fit even after evicting every keyed block).
        """
        check_payload(payload, layout)
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return
            self._make_room(len(payload), f"block {key.hex()}")
            self._blocks[key] = (payload, layout)
            self._block_bytes += len(payload)

    def get(self, key: bytes) -> tuple[bytes, BlockLayout] | None:
        """The block's ``(payload, layout)`` (touching it), or ``None`` if absent."""
        return self.get_many([key])[0]

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

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [k in self._blocks for k in keys]

    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop unpinned keys; returns how many were dropped."""
        with self._lock:
            removed = 0
            for key in keys:
                if key in self._blocks and key not in self._pinned:
                    payload, _ = self._blocks.pop(key)
                    self._block_bytes -= len(payload)
                    removed += 1
            return removed

    def pin(self, keys: Sequence[bytes], pinned: bool = True) -> list[bool]:
        with self._lock:
            for key in keys:
                if key in self._blocks:
                    (self._pinned.add if pinned else self._pinned.discard)(key)
            return [k in self._blocks for k in keys]

    def put_tail(self, handle: str, payload: bytes, layout: BlockLayout, num_tokens: int) -> None:
        """TailStore.put_tail, evicting keyed blocks to make room."""
        check_tail(handle, payload, layout, num_tokens)
        with self._lock:
            self.tails.release_tail(handle)  # a replaced tail's bytes make room for the new one
            self._make_room(len(payload), f"tail {handle!r}")
            self.tails.put_tail(handle, payload, layout, num_tokens)

    def take_tail(self, handle: str) -> StoredTail | None:
        return self.tails.take_tail(handle)

    def release_tail(self, handle: str) -> bool:
        return self.tails.release_tail(handle)

    def expire_tails(self) -> int:
        return self.tails.expire_tails()

    def stats(self) -> dict[str, int]:
        """Counters: num_blocks, bytes_used, capacity_bytes, num_tails, evictions, expired_tails."""
        with self._lock:
            tails = self.tails.stats()
            return {"num_blocks": len(self._blocks),
                    "bytes_used": self._block_bytes + tails["bytes_used"],
                    "capacity_bytes": self.capacity_bytes, "num_tails": tails["num_tails"],
                    "evictions": self._evictions, "expired_tails": tails["expired_tails"]}

    def _make_room(self, nbytes: int, what: str) -> None:
        """Evict keyed blocks until ``nbytes`` more fit; the caller holds ``self._lock``."""
        if nbytes > self.capacity_bytes:
            raise StoreCapacityError(
                f"{what} of {nbytes} bytes exceeds store capacity {self.capacity_bytes} bytes")
        tail_bytes = self.tails.stats()["bytes_used"]
        while self._block_bytes + tail_bytes + nbytes > self.capacity_bytes:
            victim = next((k for k in self._blocks if k not in self._pinned), None)  # LRU first
            if victim is None:
                raise StoreCapacityError(
                    f"{what} of {nbytes} bytes does not fit: of {self.capacity_bytes} bytes, "
                    f"{tail_bytes} are held by tails and the rest by pinned blocks")
            payload, _ = self._blocks.pop(victim)
            self._block_bytes -= len(payload)
            self._evictions += 1


def lru_server(config: KVStoreConfig | None = None, **kwargs) -> KVStoreServer:
    """A KVStoreServer (not started) over a new LRUBlockStore sized by ``config``."""
    config = config or KVStoreConfig()
    return KVStoreServer(config, LRUBlockStore.for_config(config), **kwargs)
