"""Global KV index: block key -> live (node, tier) locations, and node liveness.

``open_index(url)`` picks the backend by URL scheme:

    memory://                      MemoryIndex, in this process (tests, single-process tools)
    redis://host:port/db           RedisIndex on a real server (``rediss://``, ``unix://`` too)
    ray://pdcluster-kv-index       ActorIndex: the embedded default, a named Ray actor
    mooncake://host:port           MooncakeStoreIndex: a Mooncake Store's own lookup
                                   (`--kv-pool mooncake-store`; the master's RPC address)

Semantics (liveness, events, errors): ``kvstore.index.base``. Importing this package imports
neither Ray nor redis-py; ``RedisIndex`` and ``ActorIndex`` load on first use.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from pdcluster.kvstore.index.base import (DEFAULT_NODE_LEASE_S, TIERS, KVIndex, KVIndexError,
                                          KVIndexUnavailableError, Location)
from pdcluster.kvstore.index.memory import MemoryIndex

DEFAULT_INDEX_URL = "ray://pdcluster-kv-index"


def open_index(url: str = DEFAULT_INDEX_URL, **kw: Any) -> KVIndex:
    """Open the index at ``url``; ``kw`` go to the backend's constructor (e.g. ``namespace``:
    the Redis key prefix, or the Ray namespace of the actor).

    Raises:
        ValueError: unknown scheme.
    """
    scheme = urlsplit(url).scheme
    if scheme == "memory":
        return MemoryIndex(**kw)
    if scheme in ("redis", "rediss", "unix"):
        from pdcluster.kvstore.index.redis_index import RedisIndex
        return RedisIndex(url, **kw)
    if scheme == "mooncake":
        from pdcluster.kvstore.index.mooncake_store import MooncakeStoreIndex
        return MooncakeStoreIndex(urlsplit(url).netloc, **kw)
    if scheme == "ray":
        from pdcluster.kvstore.index.actor import DEFAULT_INDEX_ACTOR_NAME, ActorIndex
        return ActorIndex(urlsplit(url).netloc or DEFAULT_INDEX_ACTOR_NAME, **kw)
    raise ValueError(f"unknown index URL {url!r}; schemes: memory, ray, redis, rediss, unix, "
                     "mooncake")


def __getattr__(name: str) -> Any:
    if name == "RedisIndex":
        from pdcluster.kvstore.index.redis_index import RedisIndex
        return RedisIndex
    if name in ("ActorIndex", "IndexActor", "get_or_create_index_actor"):
        from pdcluster.kvstore.index import actor
        return getattr(actor, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_INDEX_URL", "DEFAULT_NODE_LEASE_S", "TIERS", "ActorIndex",
    "IndexActor", "KVIndex", "KVIndexError", "KVIndexUnavailableError", "Location",
    "MemoryIndex", "RedisIndex", "get_or_create_index_actor", "open_index",
]
