"""G2 (host DRAM) tier, owner side: one preallocated shared-memory arena per node.

The node's KV store actor owns a :class:`HostArena`: it creates the POSIX shared-memory segment
and keeps all metadata (key -> slot, LRU order, leases, pins). Workers on the node attach with
:class:`kvstore.arena.view.ArenaView` and move bytes themselves; only keys and slot numbers cross
RPC. The owner copies bytes itself only for what arrives or leaves over gRPC and for SSD
promotions (:meth:`HostArena.read_slot`, :meth:`HostArena.write_slot`), through its own mapping:
it needs no torch. Evicted blocks are handed to ``on_evict`` so the store can demote them to G3
(SSD) before the slot is reused.

Segment layout (``num_slots`` fixed-size slots, one KV block each, all layers, raw bytes)::

    offset 0        block_nbytes     2*block_nbytes          num_slots*block_nbytes
    | slot 0        | slot 1         | ...                   |

Slot lifecycle (lease semantics: a leased slot is never evicted or reused)::

    free --reserve--> writing --commit--> stored, in LRU <--release (last lease)--+
     ^  ^  (leased,      |                 |      |                                |
     |  |  invisible)    |                 |      +--acquire--> stored, leased ----+
     |  +-----abort------+                 |      |             (not in LRU)
     +------evict (LRU head) or remove-----+      +--pin------> stored, pinned --+
                                                  ^             (not in LRU)     |
                                                  +------------unpin-------------+

Leases are short (one read or write in flight, counted per slot); a pin is the store's
``pin``: it holds a stored block in the arena, never evicted (so never demoted), until unpinned.
A slot is in the LRU only while stored, unleased and unpinned. ``remove`` of a leased key
unindexes it at once, its slot becomes free at its last release; ``remove`` of a pinned key
does nothing (as Mooncake Store refuses to remove a leased object).
Eviction takes the least recently committed or released block first (Mooncake FAST'25 §4 uses
LRU for the DRAM pool); the LRU is ``engine.core.free_queue.FreeBlockQueue`` over slot numbers.

Thread-safe: one lock around every method. ``on_evict`` runs under that lock and must not call
back into the arena.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdcluster.engine.core.free_queue import FreeBlockQueue
from pdcluster.kvstore.arena.errors import ArenaClosedError, ArenaFullError
from pdcluster.kvstore.arena.segment import create_segment, reclaim_dead_segments, segment_name
from pdcluster.kvstore.errors import StoreCapacityError

#: ``on_evict(key, view)``: ``view`` is the evicted slot's bytes (``block_nbytes`` long), valid only
#: during the call (copy it to keep it); the slot is reused right after.
EvictCallback = Callable[[bytes, memoryview], None]


@dataclass(frozen=True)
class ArenaStats:
    """Counters of one arena. Slots are ``block_nbytes`` each; ``num_used`` counts writing,
    stored and removed-but-still-leased slots; ``num_pinned`` counts slots that are neither free
    nor evictable (leased or pinned); ``hits``/``misses`` count ``acquire`` keys."""

    num_slots: int
    num_used: int
    num_pinned: int
    bytes_used: int
    capacity_bytes: int
    evictions: int
    hits: int
    misses: int


class HostArena:
    """Owner of a node's shared-memory arena and of its metadata.

    Args:
        capacity_bytes: arena size; rounded down to whole slots.
        block_nbytes: bytes of one slot (one KV block, all layers).
        on_evict: called with each evicted ``(key, view)`` before its slot is reused (demotion).
        node_id: first 8 characters go into the segment name (for humans reading ``/dev/shm``).

    Raises:
        ValueError: ``block_nbytes`` <= 0.
        StoreCapacityError: ``capacity_bytes`` holds no whole slot.
        ArenaAllocationError: the segment could not be created or its memory preallocated.

    The segment's memory is committed at construction (``posix_fallocate`` on Linux), so a too
    small ``/dev/shm`` fails here instead of a worker dying of SIGBUS on first write. The arena
    holds an ``flock`` on its segment until :meth:`close`, the mark of a live owner
    (kvstore/arena/segment.py). Before creating its own, it unlinks the segments of owners that
    died without closing theirs (a SIGKILLed KV store, a crashed node's previous run): neither
    a restarted KV store nor the next start may leave them filling ``/dev/shm``. The segment is
    also registered with this process's ``multiprocessing`` resource tracker, which unlinks it
    if the owner dies without :meth:`close` and the tracker outlives it.
    """

    def __init__(
        self,
        capacity_bytes: int,
        block_nbytes: int,
        *,
        on_evict: EvictCallback | None = None,
        node_id: str | None = None,
    ) -> None:
        if block_nbytes <= 0:
            raise ValueError(f"block_nbytes must be > 0, got {block_nbytes}")
        num_slots = capacity_bytes // block_nbytes
        if num_slots <= 0:
            raise StoreCapacityError(
                f"host arena of {capacity_bytes} bytes holds no {block_nbytes}-byte block"
            )
        self._block_nbytes = block_nbytes
        self._num_slots = num_slots
        reclaim_dead_segments()
        self._segment = create_segment(segment_name(node_id), num_slots * block_nbytes)
        self._shm = self._segment.shm
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._closed = False
        self._stored: dict[bytes, int] = {}  # visible keys
        self._writing: dict[bytes, int] = {}  # reserved, not yet committed
        self._slot_key: list[bytes | None] = [None] * num_slots  # None = free
        self._leases = [0] * num_slots
        self._pinned = [False] * num_slots  # only stored slots are pinned
        self._free = list(range(num_slots - 1, -1, -1))  # stack: slot 0 is taken first
        self._lru = FreeBlockQueue(num_slots, fill=False)  # stored, unleased, unpinned slots
        self._num_pinned = 0
        self._evictions = self._hits = self._misses = 0

    # -- identity (what a worker needs to attach) -------------------------------------------

    @property
    def shm_name(self) -> str:
        """POSIX shared-memory name of the segment (no leading slash)."""
        return self._shm.name

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def block_nbytes(self) -> int:
        return self._block_nbytes

    @property
    def capacity_bytes(self) -> int:
        """``num_slots * block_nbytes``: the requested capacity rounded down to whole slots."""
        return self._num_slots * self._block_nbytes

    # -- leases ------------------------------------------------------------------------------

    def reserve(self, keys: Sequence[bytes]) -> list[int | None]:
        """Slots to write ``keys`` into, leased until :meth:`commit` or :meth:`abort`.

        Returns, per key, a slot, or ``None`` when the key is already stored, already being
        written under another lease, or repeated earlier in ``keys``. Takes free slots first,
        then evicts least recently used evictable blocks (each passed to ``on_evict`` first).

        Raises:
            ArenaFullError: fewer free + evictable slots than new keys; nothing is changed.
            Exception from ``on_evict``: propagated; the slots reserved by this call are freed,
                blocks already evicted stay evicted.
        """
        with self._lock:
            self._check_open()
            out: list[int | None] = [None] * len(keys)
            new: dict[bytes, int] = {}  # key -> index in keys
            for i, key in enumerate(keys):
                if key not in self._stored and key not in self._writing and key not in new:
                    new[key] = i
            available = len(self._free) + len(self._lru)
            if len(new) > available:
                raise ArenaFullError(len(new), available)
            reserved: list[int] = []
            try:
                for key, i in new.items():
                    slot = self._take_slot()
                    self._slot_key[slot] = key
                    self._writing[key] = slot
                    self._lease(slot)
                    reserved.append(slot)
                    out[i] = slot
            except BaseException:
                self._abort_locked(reserved)
                raise
            return out

    def commit(self, keys: Sequence[bytes], slots: Sequence[int | None]) -> None:
        """Make written slots visible under their keys and end their leases (they join the LRU
        tail).

        ``slots`` is :meth:`reserve`'s answer for ``keys``; ``None`` entries are skipped.

        Raises:
            ValueError: lengths differ, or a slot is not reserved for its key; nothing changes.
        """
        if len(keys) != len(slots):
            raise ValueError(f"{len(keys)} keys but {len(slots)} slots")
        with self._lock:
            self._check_open()
            pairs = [(k, s) for k, s in zip(keys, slots) if s is not None]
            for key, slot in pairs:
                if self._writing.get(key) != slot:
                    raise ValueError(f"slot {slot} is not reserved for key {key.hex()[:16]}")
            for key, slot in pairs:
                del self._writing[key]
                self._stored[key] = slot
                self._end_lease(slot)

    def abort(self, slots: Sequence[int | None]) -> None:
        """Free reserved slots without storing them (a failed write). ``None`` entries are
        skipped.

        Raises:
            ValueError: a slot is not reserved; nothing changes.
        """
        with self._lock:
            self._check_open()
            todo = [s for s in slots if s is not None]
            for slot in todo:
                if not self._is_writing(slot):
                    raise ValueError(f"slot {slot} is not reserved")
            self._abort_locked(todo)

    def acquire(self, keys: Sequence[bytes]) -> list[int | None]:
        """Lease the slots of stored ``keys`` for reading; ``None`` for a miss.

        Each returned slot must be given back with :meth:`release`; while leased it is neither
        evicted nor reused. A key being written (reserved, not committed) is a miss.
        """
        with self._lock:
            self._check_open()
            out: list[int | None] = []
            for key in keys:
                slot = self._stored.get(key)
                if slot is None:
                    self._misses += 1
                else:
                    self._hits += 1
                    self._lease(slot)
                out.append(slot)
            return out

    def release(self, slots: Sequence[int | None]) -> None:
        """End read leases from :meth:`acquire` (a slot acquired twice is released twice). A
        stored slot left unleased and unpinned moves to the LRU tail (most recently used).
        ``None`` is skipped.

        Raises:
            ValueError: a slot is released more often than acquired, or is a write lease
                (end those with commit/abort); nothing changes.
        """
        with self._lock:
            self._check_open()
            counts = Counter(s for s in slots if s is not None)
            for slot, n in counts.items():
                if not 0 <= slot < self._num_slots or self._leases[slot] < n:
                    raise ValueError(f"slot {slot} released more often than acquired")
                if self._is_writing(slot):
                    raise ValueError(f"slot {slot} is a write lease; commit or abort it")
            for slot, n in counts.items():
                for _ in range(n):
                    self._end_lease(slot)

    # -- bytes of leased slots, copied by the owner (puts and gets over gRPC, promotions from
    # SSD); under the lock, since close() unmaps the buffer --------------------------------------

    def read_slot(self, slot: int) -> bytes:
        """A copy of ``slot``'s ``block_nbytes`` bytes, under a lease from :meth:`acquire`
        (or :meth:`reserve`).

        Raises:
            ValueError: ``slot`` is out of range or not leased.
            ArenaClosedError: the arena is closed.
        """
        with self._lock:
            start = self._leased_offset(slot)
            return bytes(self._shm.buf[start : start + self._block_nbytes])

    def write_slot(self, slot: int, data: bytes | bytearray | memoryview) -> None:
        """Copy ``data``, exactly ``block_nbytes`` bytes, into ``slot``, under a lease from
        :meth:`reserve` (commit it afterwards).

        Raises:
            ValueError: ``slot`` is out of range or not leased, or ``data`` has another size.
            ArenaClosedError: the arena is closed.
        """
        src = memoryview(data).cast("B")
        if src.nbytes != self._block_nbytes:
            raise ValueError(f"block is {src.nbytes} bytes, slots are {self._block_nbytes}")
        with self._lock:
            start = self._leased_offset(slot)
            self._shm.buf[start : start + self._block_nbytes] = src

    # -- index -------------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is stored (committed and not evicted or removed)."""
        with self._lock:
            return key in self._stored

    def is_pinned(self, key: bytes) -> bool:
        """Whether ``key`` is stored and pinned (:meth:`pin`)."""
        with self._lock:
            slot = self._stored.get(key)
            return slot is not None and self._pinned[slot]

    def remove(self, key: bytes) -> bool:
        """Drop a stored key; ``False`` if it was not stored, or is pinned (then it stays). A
        leased slot is unindexed now and freed at its last release."""
        with self._lock:
            self._check_open()
            slot = self._stored.get(key)
            if slot is None or self._pinned[slot]:
                return False
            del self._stored[key]
            if self._leases[slot] == 0:
                self._lru.remove(slot)
                self._free_slot(slot)
            return True

    def pin(self, keys: Sequence[bytes], pinned: bool = True) -> list[bool]:
        """Pin (``pinned=True``) or unpin stored ``keys``; returns per key whether it is stored
        (and so now in the requested state). Idempotent: a pin is a flag, not a count.

        A pinned block leaves the LRU: it is never evicted, hence never demoted, and
        :meth:`remove` keeps it. Unpinned, it joins the LRU tail (most recently used). While
        pins and leases hold every slot, :meth:`reserve` raises ArenaFullError. O(1) per key.
        """
        with self._lock:
            self._check_open()
            out: list[bool] = []
            for key in keys:
                slot = self._stored.get(key)
                out.append(slot is not None)
                if slot is None or self._pinned[slot] == pinned:
                    continue
                if pinned:
                    self._hold(slot)
                    self._pinned[slot] = True
                else:
                    self._pinned[slot] = False
                    self._settle(slot)
            return out

    def keys(self) -> list[bytes]:
        """Stored keys, in no particular order."""
        with self._lock:
            return list(self._stored)

    def stats(self) -> ArenaStats:
        with self._lock:
            used = self._num_slots - len(self._free)
            return ArenaStats(
                num_slots=self._num_slots,
                num_used=used,
                num_pinned=self._num_pinned,
                bytes_used=used * self._block_nbytes,
                capacity_bytes=self.capacity_bytes,
                evictions=self._evictions,
                hits=self._hits,
                misses=self._misses,
            )

    # -- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Unlink the segment (no new attach succeeds) and unmap it here. Idempotent.

        Workers already attached keep their mapping until they close their views; the memory
        is returned to the OS when the last one does. Later calls raise ArenaClosedError.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._segment.unlink()  # then drops the owner lock
            except FileNotFoundError:
                pass  # unlinked by someone else (an operator cleaning /dev/shm)
            try:
                self._shm.close()
            except BufferError:
                pass  # an on_evict view was kept; the mapping goes when that view is freed

    def __enter__(self) -> HostArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals (lock held) ---------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ArenaClosedError(f"host arena {self._shm.name} is closed")

    def _leased_offset(self, slot: int) -> int:
        """Byte offset of a slot a caller may touch now: open arena, slot in range, leased."""
        self._check_open()
        if not 0 <= slot < self._num_slots or self._leases[slot] <= 0:
            raise ValueError(f"slot {slot} is not a leased slot of this arena")
        return slot * self._block_nbytes

    def _is_writing(self, slot: int) -> bool:
        key = self._slot_key[slot] if 0 <= slot < self._num_slots else None
        return key is not None and self._writing.get(key) == slot

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        slot = self._lru.popleft()
        key = self._slot_key[slot]
        assert key is not None
        del self._stored[key]
        self._slot_key[slot] = None
        self._evictions += 1
        if self._on_evict is not None:
            view = self._shm.buf[slot * self._block_nbytes : (slot + 1) * self._block_nbytes]
            try:
                self._on_evict(key, view)
            except BaseException:
                self._free.append(slot)
                raise
            finally:
                try:
                    view.release()
                except BufferError:
                    pass  # the callback kept an export of the view
        return slot

    def _abort_locked(self, slots: list[int]) -> None:
        for slot in slots:
            key = self._slot_key[slot]
            assert key is not None
            del self._writing[key]
            self._end_lease(slot)

    def _held(self, slot: int) -> bool:
        return self._leases[slot] > 0 or self._pinned[slot]

    def _hold(self, slot: int) -> None:
        """Before a slot gets its first lease or pin: it leaves the LRU (a stored slot is in
        the LRU exactly when it is not held; a fresh or writing slot never is)."""
        if self._held(slot):
            return
        self._num_pinned += 1
        if slot in self._lru:
            self._lru.remove(slot)

    def _settle(self, slot: int) -> None:
        """After a lease or pin ends: a slot no longer held joins the LRU tail if stored, else
        (aborted, or removed while leased) it is freed."""
        if self._held(slot):
            return
        self._num_pinned -= 1
        key = self._slot_key[slot]
        if key is not None and self._stored.get(key) == slot:
            self._lru.append(slot)
        else:
            self._free_slot(slot)

    def _lease(self, slot: int) -> None:
        self._hold(slot)
        self._leases[slot] += 1

    def _end_lease(self, slot: int) -> None:
        self._leases[slot] -= 1
        self._settle(slot)

    def _free_slot(self, slot: int) -> None:
        self._slot_key[slot] = None
        self._free.append(slot)

