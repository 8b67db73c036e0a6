"""G3 tier of the cluster KV pool: keyed KV blocks in fixed-size slots of slab files on SSD.

Tiers (Mooncake FAST'25 §3-4 pools the cluster's DRAM and SSD): blocks demote
G1 device → G2 host DRAM → G3 SSD (this class) → dropped, in LRU order, and are promoted back on a
hit. The caller moves blocks between tiers; this class only stores, finds and evicts them.

On-disk layout and checksum: ``kvstore.ssd.slab``.

Invariants:
    * The index (key → slot, LRU order, checksum) lives in memory only. A crash loses it, so SSD
      contents never survive a restart: ``__init__`` deletes every ``slab-*.bin`` left in the
      directory and ``close`` deletes its own. Hence no fsync: the OS flushes when it likes.
    * A read is served only if header magic, key, length and the checksum of the payload (both
      the header's and the one kept in memory) all match; anything else (flipped bits, a
      truncated or deleted slab, an IO error) counts a corruption, drops the entry and is a
      miss (``None``). A bad block never reaches the model.
    * At most ``capacity_blocks`` entries are indexed (pending writes included) and at most
      ``capacity_blocks`` slots exist on disk. A slot with IO in flight (its write, a read) is
      reused only after that IO ends, so a slot is never read or written by two generations.
    * Writes run on ``io_threads`` threads; the payload stays in memory until its write lands
      and a ``get`` meanwhile serves it from there. Pending payloads are not capped: a caller
      that outruns the disk should watch ``stats()["pending_writes"]``.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from pdcluster.engine.core.hashing import KEY_BYTES
from pdcluster.kvstore.ssd.slab import SlabFiles, checksum

_LOCK_NAME = ".ssd-tier.lock"


@dataclass(slots=True, eq=False)
class _Entry:
    key: bytes
    payload: bytes | None  # kept until the write lands; served to gets meanwhile
    future: Future | None = None
    checksum: int = 0
    slot: int = -1  # -1 until the writer assigns one
    io_refs: int = 0  # IO in flight on ``slot`` (the write, reads)
    attached: bool = True  # False once evicted, removed or dropped as corrupt


class SSDTier:
    """Thread-safe LRU store of fixed-size KV blocks in slab files, writes on a thread pool.

    Args:
        directory: slab directory (``--ssd-cache-dir``); created if missing, its ``slab-*.bin``
            files are deleted (see module docstring). One SSDTier per directory at a time.
        capacity_bytes: payload budget (``--ssd-cache-gb``); ``capacity_bytes // block_nbytes``
            slots. Slot headers add ``kvstore.ssd.slab.HEADER_NBYTES`` per slot on disk.
        block_nbytes: bytes of every block's payload.
        slab_blocks: slots per slab file.
        io_threads: writer threads.
        on_evict: called with each key evicted for capacity, in LRU order, on the thread that
            called ``put_async``, outside the lock. Not called by ``remove`` or corruption drops.

    Raises:
        ValueError: a size or count < 1, capacity below one block, or the directory is held by
            another open SSDTier. Every method but ``close``/``stats`` raises ValueError after
            ``close`` (as Python files do).
    """

    def __init__(self, directory: str | Path, capacity_bytes: int, block_nbytes: int, *,
                 slab_blocks: int = 256, io_threads: int = 2,
                 on_evict: Callable[[bytes], None] | None = None) -> None:
        if block_nbytes < 1 or slab_blocks < 1 or io_threads < 1:
            raise ValueError(f"block_nbytes, slab_blocks, io_threads must be >= 1, got "
                             f"{block_nbytes}, {slab_blocks}, {io_threads}")
        if capacity_bytes < block_nbytes:
            raise ValueError(f"capacity_bytes {capacity_bytes} holds no {block_nbytes}-byte block")
        self.directory = Path(directory)
        self.block_nbytes = block_nbytes
        self.slab_blocks = slab_blocks
        self.capacity_blocks = capacity_bytes // block_nbytes
        self._slabs = SlabFiles(self.directory, block_nbytes, slab_blocks)
        self._on_evict = on_evict
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.directory / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise ValueError(f"{self.directory} is in use by another SSDTier") from None
        self._slabs.delete_all()
        self._lock = threading.Lock()
        self._slot_freed = threading.Condition(self._lock)
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # LRU first
        self._free_slots: list[int] = []
        self._next_fresh_slot = 0
        self._inflight: set[Future] = set()
        self._closed = False
        self._counts = dict(evictions=0, corruptions=0, reads=0, writes=0, write_errors=0)
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="ssd-tier-io")

    # ---- public API ---------------------------------------------------------------------

    def put_async(self, key: bytes, payload: bytes) -> Future[bool]:
        """Queue ``payload`` under ``key`` and return at once; the write runs on the pool.

        A key already stored (or pending) is only touched: no rewrite, its write's future is
        returned. When full, least recently used blocks are evicted (``on_evict``) first.

        Returns:
            A future resolving to True once the block is on disk; False if the payload is not
            ``block_nbytes`` long (nothing stored), the block was evicted/removed before its
            write started, or the write failed (``stats()["write_errors"]``).
        Raises:
            ValueError: ``key`` is not 32 bytes, or the tier is closed.
        """
        _check_key(key)
        if not isinstance(payload, bytes):
            payload = bytes(payload)  # immutable while pending
        if len(payload) != self.block_nbytes:
            return _done(False)
        evicted: list[bytes] = []
        with self._lock:
            self._check_open()
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                return entry.future
            while len(self._entries) >= self.capacity_blocks:
                _, old = self._entries.popitem(last=False)
                self._detach(old)
                self._counts["evictions"] += 1
                evicted.append(old.key)
            entry = self._entries[key] = _Entry(key, payload)
            entry.future = future = self._pool.submit(self._write, entry)
            self._inflight.add(future)
        future.add_done_callback(self._write_done)
        if self._on_evict is not None:
            for old_key in evicted:
                self._on_evict(old_key)
        return future

    def get(self, key: bytes) -> bytes | None:
        """The block's payload (touching its recency), or None on a miss or a corrupt slot.

        Raises:
            ValueError: the tier is closed.
        """
        with self._lock:
            self._check_open()
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            if entry.payload is not None:  # write pending: serve from memory
                self._counts["reads"] += 1
                return entry.payload
            entry.io_refs += 1
            slot = entry.slot
        payload = None
        try:
            payload = self._slabs.read(slot, entry.key, entry.checksum)
        finally:
            with self._lock:
                entry.io_refs -= 1
                if payload is None:
                    self._counts["corruptions"] += 1
                    if self._entries.get(key) is entry:
                        del self._entries[key]
                        entry.attached = False
                else:
                    self._counts["reads"] += 1
                self._release_if_free(entry)
        return payload

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is indexed (pending writes included); does not touch recency."""
        with self._lock:
            self._check_open()
            return key in self._entries

    def remove(self, key: bytes) -> bool:
        """Drop ``key`` (e.g. after promoting it); False if it was not stored."""
        with self._lock:
            self._check_open()
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self._detach(entry)
            return True

    def keys(self) -> list[bytes]:
        """Stored keys, least recently used first."""
        with self._lock:
            self._check_open()
            return list(self._entries)

    def flush(self) -> None:
        """Wait for every write queued before this call."""
        with self._lock:
            self._check_open()
            pending = list(self._inflight)
        wait(pending)
        with self._lock:  # done callbacks may still be on their way
            self._inflight.difference_update(pending)

    def close(self) -> None:
        """Drop all blocks, wait for writes in progress, delete the slab files. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for entry in self._entries.values():
                self._detach(entry)  # queued writes then skip
            self._entries.clear()
        self._pool.shutdown(wait=True)
        self._slabs.delete_all()
        os.close(self._lock_fd)  # releases the flock

    def stats(self) -> dict[str, int]:
        """num_blocks, capacity_blocks, bytes_used / capacity_bytes (payload bytes),
        pending_writes, and counters evictions, corruptions, reads (hits served),
        writes (blocks landed), write_errors."""
        with self._lock:
            return {
                "num_blocks": len(self._entries),
                "capacity_blocks": self.capacity_blocks,
                "bytes_used": len(self._entries) * self.block_nbytes,
                "capacity_bytes": self.capacity_blocks * self.block_nbytes,
                "pending_writes": len(self._inflight),
                **self._counts,
            }

    # ---- pool side ----------------------------------------------------------------------

    def _write(self, entry: _Entry) -> bool:
        payload = entry.payload
        if payload is None:  # evicted or removed while queued
            return False
        entry.checksum = digest = checksum(payload)
        with self._lock:
            while entry.attached and not self._free_slots \
                    and self._next_fresh_slot >= self.capacity_blocks:
                self._slot_freed.wait()  # a detached slot with IO in flight frees soon
            if not entry.attached:
                return False
            if self._free_slots:
                entry.slot = self._free_slots.pop()
            else:
                entry.slot = self._next_fresh_slot
                self._next_fresh_slot += 1
            entry.io_refs += 1
        ok = self._slabs.write(entry.slot, entry.key, payload, digest)
        with self._lock:
            entry.io_refs -= 1
            entry.payload = None
            if ok:
                self._counts["writes"] += 1
            else:
                self._counts["write_errors"] += 1
                if self._entries.get(entry.key) is entry:
                    del self._entries[entry.key]
                entry.attached = False
            self._release_if_free(entry)
        return ok

    def _write_done(self, future: Future) -> None:
        with self._lock:
            self._inflight.discard(future)

    # ---- internals (caller holds self._lock) --------------------------------------------

    def _detach(self, entry: _Entry) -> None:
        entry.attached = False
        entry.payload = None
        self._release_if_free(entry)
        self._slot_freed.notify_all()  # a writer waiting for a slot for ``entry`` gives up

    def _release_if_free(self, entry: _Entry) -> None:
        if not entry.attached and entry.io_refs == 0 and entry.slot >= 0:
            self._free_slots.append(entry.slot)
            entry.slot = -1
            self._slot_freed.notify_all()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("SSDTier is closed")


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"key must be {KEY_BYTES} bytes, got {key!r:.80}")


def _done(result: bool) -> Future[bool]:
    future: Future[bool] = Future()
    future.set_result(result)
    return future
