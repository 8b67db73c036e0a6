"""Redis index backend: a cluster runs one ``redis-server`` that every node publishes to and
the Conductor reads.

Key layout under a namespace ``ns`` (default ``"pdc"``; one Redis can hold many namespaces):

    ns:blk:{key hex}        SET of encoded locations "node|tier|instance" that hold the block
    ns:loc:{location}       SET of raw 32-byte block keys held there (for remove_location)
    ns:node:{node id}       "1" with a PX TTL: the node's liveness lease (SET ... PX)

Liveness is a key with a TTL because Redis 7.0 (the OS packages) has no per-field expiry.
``longest_prefix``/``lookup`` cost at most two round trips whatever the number of keys: one
pipeline of SMEMBERS, then one MGET of the liveness keys of the nodes those sets name. Writes
are pipelined (one round trip per call; ``remove_location`` two per 1,000 keys).

The forward and reverse sets are written in one non-transactional pipeline; with one writer per
location (base module docstring) they stay consistent.

Redis restart (or data loss): the client reconnects on the next call (redis-py retries with
backoff, ``retries`` times); the caller then sees an empty index: lookups miss, no node is alive
until it heartbeats again. The next heartbeat finds the node's lease gone (returns
False), and the node's KV store re-announces every block it holds (kvstore.actor); G1 entries
come back as pools publish new events. While the
server is unreachable every call raises ``KVIndexUnavailableError`` after the retries.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator, Sequence

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from pdcluster.engine.core.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from pdcluster.kvstore.index.base import (DEFAULT_NODE_LEASE_S, KVIndex, KVIndexError,
                                          KVIndexUnavailableError, Location, check_events,
                                          check_keys, check_lease, sorted_locations)

DEFAULT_NAMESPACE = "pdc"
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.-]+$")  # no ':' or glob characters (clear() SCANs)
_BATCH = 1000


@functools.lru_cache(maxsize=65536)
def _decode_location(member: bytes) -> Location:
    return Location.decode(member.decode())


@contextlib.contextmanager
def _translate_errors() -> Iterator[None]:
    try:
        yield
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        raise KVIndexUnavailableError(f"Redis index unreachable: {exc}") from exc
    except redis.exceptions.RedisError as exc:
        raise KVIndexError(f"Redis index error: {exc}") from exc


class RedisIndex(KVIndex):
    """``KVIndex`` on a Redis server (redis-py, one connection pool, thread-safe).

    Args:
        url: ``redis://host:port/db`` (or ``rediss://``, ``unix://``).
        namespace: key prefix (letters, digits, ``_.-``), so several clusters or tests can
            share one server.
        client: an existing ``redis.Redis`` to use instead of ``url`` (must not decode
            responses); ``close`` leaves it open.
        socket_timeout_s: connect and read timeout per attempt.
        retries: reconnect attempts (exponential backoff, capped at 1 s) before a call raises
            ``KVIndexUnavailableError``.

    Raises:
        ValueError: bad namespace, or a client that decodes responses.
    """

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", namespace: str = DEFAULT_NAMESPACE,
                 client: redis.Redis | None = None, socket_timeout_s: float = 5.0,
                 retries: int = 3):
        if not _NAMESPACE_RE.match(namespace):
            raise ValueError(f"namespace must match {_NAMESPACE_RE.pattern}, got {namespace!r}")
        self._ns = namespace
        self._owns_client = client is None
        if client is None:
            client = redis.Redis.from_url(
                url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
                retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries),
                retry_on_error=[redis.exceptions.ConnectionError, redis.exceptions.TimeoutError])
        if client.get_connection_kwargs().get("decode_responses"):
            raise ValueError("RedisIndex needs a client with decode_responses=False")
        self._client = client

    @property
    def namespace(self) -> str:
        return self._ns

    def _blk(self, key: bytes) -> str:
        return f"{self._ns}:blk:{key.hex()}"

    def _loc(self, location: Location) -> str:
        return f"{self._ns}:loc:{location.encode()}"

    def _node(self, node_id: str) -> str:
        return f"{self._ns}:node:{node_id}"

    def _queue(self, command: Callable[..., object], keys: Sequence[bytes],
               location: Location) -> None:
        """Queue ``command``, a pipeline's ``sadd`` (add) or ``srem`` (remove), of ``location``
        in each key's set and of ``keys`` in the location's set."""
        if keys:
            member = location.encode()
            for key in keys:
                command(self._blk(key), member)
            command(f"{self._ns}:loc:{member}", *keys)

    def add(self, keys: Sequence[bytes], location: Location) -> None:
        check_keys(keys)
        with _translate_errors():
            pipe = self._client.pipeline(transaction=False)
            self._queue(pipe.sadd, keys, location)
            pipe.execute()  # an empty pipeline makes no round trip

    def remove(self, keys: Sequence[bytes], location: Location) -> None:
        with _translate_errors():
            self._remove(keys, location)

    def _remove(self, keys: Sequence[bytes], location: Location) -> None:
        for start in range(0, len(keys), _BATCH):
            pipe = self._client.pipeline(transaction=False)
            self._queue(pipe.srem, keys[start:start + _BATCH], location)
            pipe.execute()

    def remove_location(self, location: Location) -> None:
        with _translate_errors():
            keys = list(self._client.smembers(self._loc(location)))
            if keys:
                # SREM only what was read: a key added meanwhile stays in both sets.
                self._remove(keys, location)

    def lookup(self, keys: Sequence[bytes]) -> list[list[Location]]:
        return self._query(keys, stop_at_miss=False)

    def longest_prefix(self, keys: Sequence[bytes]) -> list[list[Location]]:
        return self._query(keys, stop_at_miss=True)

    def _query(self, keys: Sequence[bytes], stop_at_miss: bool) -> list[list[Location]]:
        if not keys:
            return []
        with _translate_errors():
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.smembers(self._blk(key))
            member_sets = pipe.execute()                                  # round trip 1
            holders = []
            for members in member_sets:
                if not members and stop_at_miss:
                    break
                holders.append([_decode_location(m) for m in members])
            nodes = sorted({loc.node_id for locs in holders for loc in locs})
            if not nodes:
                return [] if stop_at_miss else [[] for _ in keys]
            leases = self._client.mget([self._node(n) for n in nodes])    # round trip 2
        alive = {node for node, lease in zip(nodes, leases) if lease is not None}
        result: list[list[Location]] = []
        for locs in holders:
            live = sorted_locations(loc for loc in locs if loc.node_id in alive)
            if not live and stop_at_miss:
                break
            result.append(live)
        return result

    def heartbeat(self, node_id: str, lease_s: float = DEFAULT_NODE_LEASE_S) -> bool:
        check_lease(lease_s)
        with _translate_errors():
            previous = self._client.set(self._node(node_id), b"1", px=max(1, round(lease_s * 1000)),
                                        get=True)  # SET ... GET: Redis 6.2+
        return previous is not None

    def apply_events(self, location: Location, events: Sequence[KVCacheEvent]) -> None:
        """Pipelined replay: runs of BlockStored/BlockRemoved go in one pipeline (one round
        trip); an AllCleared flushes it, then clears the location (base class semantics).
        Events are validated before anything is written."""
        check_events(events)
        with _translate_errors():
            pipe = self._client.pipeline(transaction=False)
            for event in events:
                if isinstance(event, BlockStored):
                    self._queue(pipe.sadd, event.keys, location)
                elif isinstance(event, BlockRemoved):
                    self._queue(pipe.srem, event.keys, location)
                else:  # AllCleared
                    pipe.execute()
                    self.remove_location(location)
            pipe.execute()

    def clear(self) -> None:
        with _translate_errors():
            batch: list[bytes] = []
            for name in self._client.scan_iter(match=f"{self._ns}:*", count=_BATCH):
                batch.append(name)
                if len(batch) >= _BATCH:
                    self._client.unlink(*batch)
                    batch.clear()
            if batch:
                self._client.unlink(*batch)

    def close(self) -> None:
        if self._owns_client:
            self._client.close()
