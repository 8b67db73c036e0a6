"""The embedded default index: one named Ray actor holding a ``MemoryIndex``, and a client.

``open_index("ray://pdcluster-kv-index")`` returns an ``ActorIndex`` bound to the actor of that
name, creating it if needed. Every call is one actor call (one round trip), executed in order
on the actor. Only this module of ``kvstore.index`` imports Ray.

The actor restarts empty if its process dies (``max_restarts=-1``), as a Redis server restarted
without persistence would: lookups miss until pools publish again and nodes heartbeat again;
calls made while it is down raise ``KVIndexUnavailableError``. Its lifetime is Ray's default
(it dies with the process that created it) unless ``detached=True``, so create it from the
driver (the launcher), not from a worker that may go away.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray
from ray.actor import ActorHandle

from pdcluster.engine import ray_calls
from pdcluster.engine.core.kv_events import KVCacheEvent
from pdcluster.kvstore.index.base import (DEFAULT_NODE_LEASE_S, KVIndex, KVIndexUnavailableError,
                                          Location, check_events, check_keys, check_lease)
from pdcluster.kvstore.index.memory import MemoryIndex

DEFAULT_INDEX_ACTOR_NAME = "pdcluster-kv-index"


#: A ``MemoryIndex`` in its own actor: the ``KVIndex`` interface, method for method.
IndexActor = ray.remote(num_cpus=0, max_restarts=-1)(MemoryIndex)


#: Ray's resource of the head node: a detached actor that needs no CPU goes there, since the
#: other CPU-less nodes (a gateway's, a job's) come and go.
HEAD_NODE_RESOURCE = "node:__internal_head__"


def get_or_create_index_actor(name: str = DEFAULT_INDEX_ACTOR_NAME, namespace: str | None = None,
                              detached: bool = False) -> ActorHandle:
    """The ``IndexActor`` named ``name`` in Ray ``namespace`` (default: the caller's), created
    if none runs (``detached``: outliving the caller, on the head node). Needs a connected Ray
    (``ray.init`` or inside a Ray worker)."""
    options = {"lifetime": "detached", "resources": {HEAD_NODE_RESOURCE: 0.001}} \
        if detached else {}
    return IndexActor.options(name=name, namespace=namespace, get_if_exists=True,
                              **options).remote()


class ActorIndex(KVIndex):
    """``KVIndex`` client of an ``IndexActor``; each call is one ``ray.get``.

    Args:
        name / namespace: the actor's name and Ray namespace; created if it does not run
            (``detached``: created to outlive this process).
        timeout_s: per-call deadline; a call past it, or to a dead actor, raises
            ``KVIndexUnavailableError``.

    Arguments are validated here, so bad input raises ``ValueError``/``TypeError`` in the
    caller instead of a ``RayTaskError``.
    """

    def __init__(self, name: str = DEFAULT_INDEX_ACTOR_NAME, namespace: str | None = None,
                 timeout_s: float = 10.0, detached: bool = False):
        self._actor = get_or_create_index_actor(name, namespace, detached)
        self._timeout_s = timeout_s

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return ray_calls.result(getattr(self._actor, method).remote(*args), self._timeout_s)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as exc:
            raise KVIndexUnavailableError(f"index actor unavailable: {exc}") from exc

    def add(self, keys: Sequence[bytes], location: Location) -> None:
        check_keys(keys)
        self._call("add", list(keys), location)

    def remove(self, keys: Sequence[bytes], location: Location) -> None:
        self._call("remove", list(keys), location)

    def remove_location(self, location: Location) -> None:
        self._call("remove_location", location)

    def lookup(self, keys: Sequence[bytes]) -> list[list[Location]]:
        return self._call("lookup", list(keys))

    def longest_prefix(self, keys: Sequence[bytes]) -> list[list[Location]]:
        return self._call("longest_prefix", list(keys))

    def heartbeat(self, node_id: str, lease_s: float = DEFAULT_NODE_LEASE_S) -> bool:
        check_lease(lease_s)
        return self._call("heartbeat", node_id, lease_s)

    def apply_events(self, location: Location, events: Sequence[KVCacheEvent]) -> None:
        check_events(events)
        self._call("apply_events", location, list(events))

    def clear(self) -> None:
        self._call("clear")
