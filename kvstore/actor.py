"""One KV store per Ray node, as a pinned Ray actor serving gRPC in-process.

DESIGN.md "Control plane": one KV store actor per Ray node, pinned to it, serving gRPC on a
port chosen at start. Workers find their own node's store with :func:`local_kvstore_address`.
Only the address goes through Ray; KV bytes go over gRPC (never the Ray object store).
"""

from __future__ import annotations

import time

import ray
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvstore.config import KVStoreConfig
from kvstore.errors import KVStoreError
from kvstore.server import KVStoreServer

KVSTORE_ACTOR_PREFIX = "pdcluster-kvstore-"
_WILDCARD_HOSTS = {"0.0.0.0", "::", "[::]", ""}


@ray.remote(num_cpus=0)
class KVStoreActor:
    """Owns one :class:`KVStoreServer` (gRPC thread pool) on the node it is scheduled on.

    Args:
        config: server and store settings; ``port=0`` picks a free port.
    """

    def __init__(self, config: KVStoreConfig):
        self._config = config
        self._server = KVStoreServer(config)
        self._server.start()
        self._node_id = ray.get_runtime_context().get_node_id()

    def address(self) -> str:
        """``host:port`` for workers; a wildcard bind advertises this node's Ray IP."""
        if self._config.host in _WILDCARD_HOSTS:
            return f"{ray.util.get_node_ip_address()}:{self._server.port}"
        return self._server.address

    def node_id(self) -> str:
        """Hex Ray node id this actor runs on."""
        return self._node_id

    def stats(self) -> dict:
        """The store's counters (see HostBlockStore.stats)."""
        return self._server.store.stats()

    def stop(self) -> None:
        """Stop the gRPC server (the actor stays alive until killed). Idempotent."""
        self._server.stop(grace=1.0)


def start_kvstore_actors(
    config: KVStoreConfig, namespace: str | None = None
) -> dict[str, ActorHandle]:
    """Start one KV store actor on every ALIVE Ray node and wait until each serves.

    Each actor is pinned with ``NodeAffinitySchedulingStrategy(node_id, soft=False)`` and named
    ``KVSTORE_ACTOR_PREFIX + node_id`` in ``namespace`` (default: the caller's). Lifetime is
    Ray's default: they die with the driver. An actor already running under that name is
    reused (its config is not changed).

    Returns:
        node id (hex) -> actor handle.

    Raises:
        KVStoreError: an actor failed to start within ``config.transfer_timeout_s * 6`` s.
    """
    actors: dict[str, ActorHandle] = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        node_id = node["NodeID"]
        actors[node_id] = KVStoreActor.options(
            name=KVSTORE_ACTOR_PREFIX + node_id,
            namespace=namespace,
            get_if_exists=True,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        ).remote(config)
    refs = {node_id: a.address.remote() for node_id, a in actors.items()}
    try:
        ray.get(list(refs.values()), timeout=config.transfer_timeout_s * 6)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as exc:
        raise KVStoreError(f"KV store actors failed to start: {exc}") from exc
    return actors


def local_kvstore_address(namespace: str | None = None, timeout_s: float = 30.0) -> str:
    """Address of the KV store actor on the caller's own Ray node.

    Call from inside a Ray worker or driver. Waits up to ``timeout_s`` seconds for the actor
    to exist (it may still be starting).

    Raises:
        KVStoreError: no KV store actor on this node within ``timeout_s``.
    """
    node_id = ray.get_runtime_context().get_node_id()
    name = KVSTORE_ACTOR_PREFIX + node_id
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            actor = ray.get_actor(name, namespace=namespace)
            break
        except ValueError:
            if time.monotonic() >= deadline:
                raise KVStoreError(f"no KV store actor {name!r} on node {node_id} "
                                   f"after {timeout_s} s") from None
            time.sleep(0.1)
    remaining = max(0.1, deadline - time.monotonic())
    try:
        return ray.get(actor.address.remote(), timeout=remaining)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as exc:
        raise KVStoreError(f"KV store actor {name!r} did not answer: {exc}") from exc
