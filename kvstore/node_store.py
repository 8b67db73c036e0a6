"""A node's share of the cluster KV pool: G2 (shared-memory arena) over G3 (SSD slabs).

Owned by the node's KV store actor. Keyed full blocks live in G2 while hot; G2's LRU victims
are demoted to G3 (copied before their slot is reused); G3's victims are dropped. A G3 hit is
promoted back into G2 before it is served. Every placement change goes to the global index as
(node, tier) locations, so any worker in the cluster can find the block (Mooncake FAST'25 §4:
the pool spans DRAM and SSD of every node; the index holds metadata only).

Same-node workers move bytes through the arena directly and call only the metadata methods
(reserve/commit/abort/acquire/release) over Ray RPC; other nodes use the gRPC service, which
calls put/get_many here. Both reach exists/remove/pin, the key-level half of the node store
facade (kvstore.node_store_api). Partial tail blocks stay in the TailStore this store
extends, under per-request handles, and are never indexed.
"""

from __future__ import annotations

import logging
import threading
from typing import Sequence

from pdcluster.kvstore.arena import ArenaFullError, HostArena
from pdcluster.kvstore.errors import BlockLayoutError
from pdcluster.kvstore.index import KVIndex, Location
from pdcluster.kvstore.index.base import HOST, SSD
from pdcluster.kvstore.layout import BlockLayout
from pdcluster.kvstore.ssd_tier import SSDTier
from pdcluster.kvstore.tail_store import TailStore

log = logging.getLogger(__name__)

__all__ = ["HOST", "SSD", "TieredNodeStore"]


class TieredNodeStore(TailStore):
    """G2 + G3 for keyed blocks of one fixed layout, and the node's tail blocks (TailStore's
    methods, holding at most ``tail_capacity_bytes`` for ``tail_ttl_s`` each).

    layout: the one block layout this cluster's model produces (dtype, shape); puts of any
        other layout raise BlockLayoutError.
    ssd_dir: None disables G3 (G2 victims are then dropped).
    index: where placements are published; None keeps the store local (tests).
    Thread-safe: the arena and SSD tier lock themselves; index updates are queued under a
    small lock and sent after each operation, outside the arena's lock.
    """

    def __init__(self, node_id: str, layout: BlockLayout, dram_bytes: int,
                 ssd_dir: str | None, ssd_bytes: int, index: KVIndex | None,
                 tail_capacity_bytes: int, tail_ttl_s: float) -> None:
        super().__init__(tail_capacity_bytes, tail_ttl_s)
        self.node_id = node_id
        self.layout = layout
        self.index = index
        self._pending: list[tuple[str, bytes, str]] = []  # (add|remove, key, tier)
        self._pending_lock = threading.Lock()
        self._flush_lock = threading.Lock()  # flushes are sent in order, one at a time
        self.ssd = (SSDTier(ssd_dir, ssd_bytes, layout.nbytes, on_evict=self._ssd_evicted)
                    if ssd_dir else None)
        self.arena = HostArena(dram_bytes, layout.nbytes, on_evict=self._arena_evicted,
                               node_id=node_id)
        self.promotions = 0

    # ---- same-node workers: metadata only -------------------------------------------------
    def arena_info(self) -> dict:
        return {"shm_name": self.arena.shm_name, "num_slots": self.arena.num_slots,
                "block_nbytes": self.arena.block_nbytes, "layout": self.layout}

    def reserve(self, keys: Sequence[bytes]) -> list[int | None]:
        """Slots to write new keys into (None: already stored), leased until commit/abort.
        Raises ArenaFullError when leases and pins hold every other slot."""
        try:
            return self.arena.reserve(keys)
        finally:
            self._flush_index()

    def commit(self, keys: Sequence[bytes], slots: Sequence[int | None]) -> None:
        self.arena.commit(keys, slots)
        self._queue("add", [k for k, s in zip(keys, slots) if s is not None], HOST)
        self._flush_index()

    def abort(self, slots: Sequence[int | None]) -> None:
        self.arena.abort(slots)

    def acquire(self, keys: Sequence[bytes]) -> list[tuple[int | None, str | None]]:
        """Lease each key's G2 slot for reading, promoting G3 hits into G2 first.

        Returns (slot, tier it was found in) per key; (None, None) is a miss. Release the slots.
        """
        slots = self.arena.acquire(keys)
        tiers: list[str | None] = [HOST if s is not None else None for s in slots]
        missing = [i for i, s in enumerate(slots) if s is None]
        if missing and self.ssd is not None:
            promoted = self._promote([keys[i] for i in missing])
            for i, slot in zip(missing, promoted):
                if slot is not None:
                    slots[i], tiers[i] = slot, SSD
        self._flush_index()
        return list(zip(slots, tiers))

    def release(self, slots: Sequence[int | None]) -> None:
        self.arena.release(slots)

    # ---- the gRPC service's store interface (other nodes; the tail methods are TailStore's) -
    def put(self, key: bytes, payload: bytes, layout: BlockLayout) -> None:
        if layout != self.layout:
            raise BlockLayoutError(f"block layout {layout} is not this cluster's {self.layout}")
        [slot] = self.reserve([key])
        if slot is None:
            return  # already stored (content-addressed)
        try:
            self.arena.write_slot(slot, payload)
        except Exception:
            self.arena.abort([slot])
            raise
        self.commit([key], [slot])

    def get_many(self, keys: Sequence[bytes]) -> list[tuple[bytes, BlockLayout] | None]:
        """Block by block, so a request larger than G2 never leases it full; an SSD block that
        cannot be promoted (G2 held full by leases and pins) is served from SSD directly."""
        out: list[tuple[bytes, BlockLayout] | None] = []
        for key in keys:
            [(slot, _)] = self.acquire([key])
            if slot is not None:
                try:
                    out.append((self.arena.read_slot(slot), self.layout))
                finally:
                    self.release([slot])
                continue
            payload = self.ssd.get(key) if self.ssd is not None else None
            out.append(None if payload is None else (payload, self.layout))
        return out

    def contains(self, key: bytes) -> bool:
        return self.arena.contains(key) or (self.ssd is not None and self.ssd.contains(key))

    # ---- key-level facade methods (kvstore.node_store_api), for both kinds of client --------
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether G2 or G3 holds it (no LRU order is touched)."""
        return [self.contains(k) for k in keys]

    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop keys from G2 and G3 and their locations from the index; returns how many were
        present. A pinned key is skipped whole (its G3 copy too) and not counted."""
        removed = 0
        for key in keys:
            in_g2 = self.arena.remove(key)
            if not in_g2 and self.arena.is_pinned(key):
                continue
            in_g3 = self.ssd is not None and self.ssd.remove(key)
            if in_g2:
                self._queue("remove", [key], HOST)
            if in_g3:
                self._queue("remove", [key], SSD)
            removed += int(in_g2 or in_g3)
        self._flush_index()
        return removed

    def pin(self, keys: Sequence[bytes], pinned: bool = True) -> list[bool]:
        """Pin keys in G2 (never evicted or demoted, skipped by remove) or unpin them.

        A key held only in G3 is promoted into G2 to be pinned (``False`` when G2 has no free
        or evictable slot for it); unpinning it just reports it present. Returns per key
        whether it is present and now in the requested state.
        """
        done = self.arena.pin(keys, pinned)
        missing = [i for i, ok in enumerate(done) if not ok]
        if missing and self.ssd is not None:
            missing_keys = [keys[i] for i in missing]
            if pinned:
                leased = self._promote(missing_keys)  # leased: not evicted before the pin
                try:
                    again = self.arena.pin(missing_keys, True)
                finally:
                    self.arena.release(leased)
                self._flush_index()
            else:
                again = [self.ssd.contains(k) for k in missing_keys]
            for i, ok in zip(missing, again):
                done[i] = ok
        return done

    def stats(self) -> dict[str, int]:
        """The gRPC Stats fields: blocks and bytes over G2 + G3, plus tail counters."""
        arena, tails = self.arena.stats(), super().stats()
        ssd = self.ssd.stats() if self.ssd is not None else {}
        return {"num_blocks": arena.num_used + ssd.get("num_blocks", 0),
                "bytes_used": arena.bytes_used + ssd.get("bytes_used", 0),
                "capacity_bytes": arena.capacity_bytes + ssd.get("capacity_bytes", 0),
                "num_tails": tails["num_tails"], "evictions": arena.evictions,
                "expired_tails": tails["expired_tails"]}

    def tier_stats(self) -> dict[str, dict]:
        """Per-tier block counts for pdcluster_kv_blocks{tier,state}."""
        arena = self.arena.stats()
        out = {HOST: {"used": arena.num_pinned, "cached": arena.num_used - arena.num_pinned,
                      "free": arena.num_slots - arena.num_used}}
        if self.ssd is not None:
            ssd = self.ssd.stats()
            out[SSD] = {"used": 0, "cached": ssd["num_blocks"],
                        "free": ssd["capacity_blocks"] - ssd["num_blocks"],
                        "corruptions": ssd["corruptions"]}
        return out

    def close(self) -> None:
        self.arena.close()
        if self.ssd is not None:
            self.ssd.close()

    # ---- internals --------------------------------------------------------------------------
    def _promote(self, keys: list[bytes]) -> list[int | None]:
        """G3 → G2 for keys found on SSD; returns leased G2 slots (None where not found, or
        all None when G2 has no free or evictable slot for them)."""
        payloads = [self.ssd.get(k) for k in keys]
        # a miss may be a corrupt or vanished block the index still lists: drop the listing
        self._queue("remove", [k for k, p in zip(keys, payloads) if p is None], SSD)
        found = [(k, p) for k, p in zip(keys, payloads) if p is not None]
        if found:
            try:
                slots = self.arena.reserve([k for k, _ in found])
            except ArenaFullError:  # G2 is held full by leases and pins: no promotion
                return [None] * len(keys)
            for (key, payload), slot in zip(found, slots):
                if slot is not None:
                    self.arena.write_slot(slot, payload)
            self.arena.commit([k for k, _ in found], slots)
            self.promotions += sum(s is not None for s in slots)
            self._queue("add", [k for (k, _), s in zip(found, slots) if s is not None], HOST)
        acquired = iter(self.arena.acquire([k for k, _ in found]))
        return [next(acquired) if p is not None else None for p in payloads]

    def _arena_evicted(self, key: bytes, view: memoryview) -> None:
        """Runs under the arena's lock: copy the bytes out, queue the index change."""
        self._queue("remove", [key], HOST)
        if self.ssd is not None:
            self.ssd.put_async(key, bytes(view))
            self._queue("add", [key], SSD)

    def _ssd_evicted(self, key: bytes) -> None:
        self._queue("remove", [key], SSD)

    def _queue(self, op: str, keys: list[bytes], tier: str) -> None:
        if self.index is not None and keys:
            with self._pending_lock:
                self._pending.extend((op, k, tier) for k in keys)

    def _flush_index(self) -> None:
        if self.index is None:
            return
        with self._flush_lock:
            with self._pending_lock:
                pending, self._pending = self._pending, []
            self._send(pending)

    def _send(self, pending: list[tuple[str, bytes, str]]) -> None:
        final: dict[tuple[bytes, str], str] = {}  # the last change per (key, tier) wins
        for op, key, tier in pending:
            final[(key, tier)] = op
        groups: dict[tuple[str, str], list[bytes]] = {}
        for (key, tier), op in final.items():
            groups.setdefault((op, tier), []).append(key)
        for (op, tier), keys in groups.items():
            location = Location(self.node_id, tier)
            try:
                (self.index.add if op == "add" else self.index.remove)(keys, location)
            except Exception as exc:  # noqa: BLE001 — an index outage costs hits, not requests
                log.warning("index %s of %d keys (%s) failed: %s", op, len(keys), tier, exc)
