"""The global KV index: block key -> live locations, and node liveness.

Mooncake FAST'25 §4 (the Conductor's cache-aware scheduling reads the
longest cached prefix of a request's block keys).

Semantics shared by every backend (``MemoryIndex``, ``RedisIndex``, ``ActorIndex``):

* **Keys** are the 32-byte chained sha256 block keys of ``engine.core.hashing``. Key i covers the
  whole prefix up to block i, so a request's cached prefix is the run of leading keys that are
  held somewhere alive (``longest_prefix``).
* **Locations** are ``Location(node_id, tier, instance_id)``. A key may be held at many.
* **Liveness.** A node is alive while its heartbeat lease runs (``heartbeat(node, lease_s)``; a
  key with a TTL in Redis, a monotonic deadline in memory). A node that never heartbeated is dead.
  Lookups leave out locations on dead nodes, but the entries stay stored: a node that
  heartbeats again gets them back. Entries are dropped only by ``remove``/``remove_location``
  (a restarting node or instance should call ``remove_location`` before publishing again).
  A node that stops heartbeating drops out of lookups within its lease (``DEFAULT_NODE_LEASE_S``);
  heartbeat every ``lease_s / 3``. ``heartbeat`` tells whether the lease was still running;
  when it was not, the index may have lost the node's entries too, so the node re-announces
  its blocks (an index restarted empty costs recompute until then, never errors).
* **Events.** ``apply_events`` replays a pool's ``engine.core.kv_events`` in order:
  ``BlockStored`` -> ``add``, ``BlockRemoved`` -> ``remove``, ``AllCleared`` -> ``remove_location``.
  Each location is assumed to have one writer (the pool or store that owns it), which publishes
  its events in order.
* **Errors.** A backend that cannot be reached raises ``KVIndexUnavailableError``; callers treat
  the index as a hint (a miss costs recompute, never correctness).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdcluster.engine.core.hashing import KEY_BYTES
from pdcluster.engine.core.kv_events import AllCleared, BlockRemoved, BlockStored, KVCacheEvent
from pdcluster.kvstore.errors import KVStoreError

TIERS = ("device", "host", "ssd", "mooncake_store")
"""G1 a worker's paged cache, G2 a node's host-DRAM arena, G3 a node's SSD slabs (fastest
first); with `--kv-pool mooncake-store`, a Mooncake Store in place of G2/G3, which says whether
it holds a block but not on which node (kvstore.index.mooncake_store)."""
DEVICE, HOST, SSD, MOONCAKE_STORE = TIERS
TIER_RANK = {tier: rank for rank, tier in enumerate(TIERS)}
DEFAULT_NODE_LEASE_S = 10.0
"""Default ``--node-lease-s``: a node that stops heartbeating drops out of lookups within this."""
_SEP = "|"


class KVIndexError(KVStoreError):
    """Base class of global index errors."""


class KVIndexUnavailableError(KVIndexError):
    """The index backend could not be reached (Redis down, index actor dead) after retries."""


@dataclass(frozen=True, slots=True)
class Location:
    """Where a block is held.

    Attributes:
        node_id: Ray node id (hex) of the holder.
        tier: one of ``TIERS``.
        instance_id: the worker instance whose paged cache holds the block; required for
            ``"device"``, usually ``None`` for node-level tiers (``"host"``, ``"ssd"``).

    Raises:
        ValueError: unknown tier, empty node id, ``"|"`` in a field, or a device location
            without an instance id.
    """

    node_id: str
    tier: str
    instance_id: str | None = None

    def __post_init__(self) -> None:
        if self.tier not in TIER_RANK:
            raise ValueError(f"unknown tier {self.tier!r}; expected one of {TIERS}")
        if not self.node_id:
            raise ValueError("node_id must be non-empty")
        if self.tier == "device" and not self.instance_id:
            raise ValueError("a device location needs its instance_id")
        for field in (self.node_id, self.instance_id or ""):
            if _SEP in field:
                raise ValueError(f"{_SEP!r} is not allowed in a location field: {field!r}")

    def encode(self) -> str:
        """``"node|tier|instance"`` (instance empty when ``None``); inverse of ``decode``."""
        return f"{self.node_id}{_SEP}{self.tier}{_SEP}{self.instance_id or ''}"

    @classmethod
    def decode(cls, text: str) -> Location:
        node_id, tier, instance_id = text.split(_SEP)
        return cls(node_id, tier, instance_id or None)

    def sort_key(self) -> tuple[int, str, str]:
        return TIER_RANK[self.tier], self.node_id, self.instance_id or ""


def sorted_locations(locations: Iterable[Location]) -> list[Location]:
    """Fastest tier first, then node id, then instance id: a deterministic order for callers."""
    return sorted(locations, key=Location.sort_key)


def check_keys(keys: Sequence[bytes]) -> None:
    """Raises ``ValueError`` unless every key is ``KEY_BYTES`` bytes (engine.core.hashing)."""
    for key in keys:
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise ValueError(f"block keys are {KEY_BYTES}-byte sha256 digests, got {key!r:.80}")


def check_events(events: Sequence[KVCacheEvent]) -> None:
    """Raises ``TypeError``/``ValueError`` for a non-event or a bad key, before any is applied."""
    for event in events:
        if isinstance(event, BlockStored):
            check_keys(event.keys)
        elif not isinstance(event, (BlockRemoved, AllCleared)):
            raise TypeError(f"not a KV cache event: {event!r}")


def check_lease(lease_s: float) -> None:
    if not lease_s > 0:
        raise ValueError(f"lease must be > 0 s, got {lease_s}")


class KVIndex(abc.ABC):
    """Block key -> locations and node liveness, behind one interface.

    Open one with ``kvstore.index.open_index(url)``. Thread-safe in every backend. Usable as a
    context manager (``close`` on exit).
    """

    @abc.abstractmethod
    def add(self, keys: Sequence[bytes], location: Location) -> None:
        """Record that ``location`` holds each of ``keys`` (idempotent)."""

    @abc.abstractmethod
    def remove(self, keys: Sequence[bytes], location: Location) -> None:
        """Forget ``location`` for each of ``keys``; keys it does not hold are ignored."""

    @abc.abstractmethod
    def remove_location(self, location: Location) -> None:
        """Forget every key held at ``location`` (a pool's ``AllCleared``, an instance restart)."""

    @abc.abstractmethod
    def lookup(self, keys: Sequence[bytes]) -> list[list[Location]]:
        """Alive locations of each key, in ``sorted_locations`` order; one list per key given
        (empty for a miss), however many misses."""

    @abc.abstractmethod
    def longest_prefix(self, keys: Sequence[bytes]) -> list[list[Location]]:
        """Alive locations of the leading keys that have at least one, stopping at the first
        miss: ``len(result)`` is the number of cached leading blocks. One round trip to the
        backend (two for Redis: the sets, then the liveness of the nodes they name)."""

    @abc.abstractmethod
    def heartbeat(self, node_id: str, lease_s: float = DEFAULT_NODE_LEASE_S) -> bool:
        """Mark ``node_id`` alive for the next ``lease_s`` seconds (> 0).

        Returns whether its lease was still running. False after a first heartbeat, a lease
        that ran out, or an index that lost its contents (a Redis restarted empty): the node
        must then publish its blocks again (``kvstore.actor`` re-announces them).
        """

    def apply_events(self, location: Location, events: Sequence[KVCacheEvent]) -> None:
        """Replay a pool's cache events, in order, for ``location`` (see the module docstring).

        Raises:
            TypeError / ValueError: a non-event or a malformed key; nothing is applied then.
        """
        check_events(events)
        for event in events:
            if isinstance(event, BlockStored):
                self.add(event.keys, location)
            elif isinstance(event, BlockRemoved):
                self.remove(event.keys, location)
            else:
                self.remove_location(location)

    @abc.abstractmethod
    def clear(self) -> None:
        """Drop every entry and liveness lease of this index."""

    def close(self) -> None:
        """Release client resources; the index's contents are untouched."""

    #: whether the index is the blocks' own store too (Mooncake Store), reached through
    #: `block_store` (kvstore.mooncake_store.MooncakeStoreClient); ours hold locations only
    holds_blocks = False
    block_store = None

    def __enter__(self) -> KVIndex:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
