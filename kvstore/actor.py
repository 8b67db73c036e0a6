"""One KV store per Ray node, as a pinned Ray actor serving gRPC in-process.

One KV store actor per Ray node, pinned to it (its arena is that node's memory), serving gRPC
on a port chosen at start. It owns the node's G2 arena and G3 SSD tier (TieredNodeStore), publishes
placements to the global index and heartbeats the node's lease there. When a heartbeat finds
the lease unknown to the index (Redis restarted empty, or the node was cut off past its lease),
it re-announces every block the node holds; until then a lookup misses and costs recompute.

Ray restarts it when its process dies (``max_restarts=-1``), empty: its G2 arena is a new
shared-memory segment (the dead one's resource tracker unlinks the old) and its G3 directory is
wiped. The restarted store first drops the node's G2/G3 locations from the global index (they
are gone), then serves on the port it had (recorded in a file under the temp directory, per
Ray node), so every worker's gRPC address stays valid. Same-node workers pass the arena's name
with every pin (``arena=``): a store that has a different arena raises StaleArenaError and
the worker re-attaches (kvstore/node_client.py). Requests in flight when it died end with a
clear error or recompute; later ones are served. Same-node workers call its metadata methods
and move bytes through the arena; other nodes use gRPC. KV bytes never travel through Ray (no
pickle, no object store).
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Iterable

import ray
from ray.actor import ActorHandle
from ray.util.annotations import RayDeprecationWarning
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pdcluster.kvstore.config import KVStoreConfig
from pdcluster.kvstore.errors import KVStoreError, StaleArenaError
from pdcluster.kvstore.index import Location, open_index
from pdcluster.kvstore.layout import BlockLayout
from pdcluster.kvstore.node_store import HOST, SSD, TieredNodeStore
from pdcluster.kvstore.pool_config import KVPoolConfig
from pdcluster.kvstore.server import KVStoreServer

log = logging.getLogger(__name__)

KVSTORE_ACTOR_PREFIX = "pdcluster-kvstore-"
_WILDCARD_HOSTS = {"0.0.0.0", "::", "[::]", ""}
_REANNOUNCE_BATCH = 1000  # keys per index call when re-announcing a node's blocks

class KVStoreActor:
    """Owns one node's TieredNodeStore and the KVStoreServer (gRPC thread pool) serving it.

    Args:
        config: gRPC server settings (bind host, port 0 = free port, token, tail TTL).
        pool: tier capacities, index URL, node lease.
        layout: the cluster's KV block layout (dtype, [layers, 2, block_size, kv_heads, head_dim]).
    """

    def __init__(self, config: KVStoreConfig, pool: KVPoolConfig, layout: BlockLayout):
        self._config = config
        self._node_id = ray.get_runtime_context().get_node_id()
        self._index = open_index(pool.index_url)
        ssd_dir = (os.path.join(pool.ssd_cache_dir, self._node_id[:16])
                   if pool.ssd_cache_dir else None)
        self.store = TieredNodeStore(self._node_id, layout, pool.dram_cache_bytes, ssd_dir,
                                     pool.ssd_cache_bytes, self._index,
                                     config.tail_capacity_bytes, config.tail_ttl_s)
        with warnings.catch_warnings():  # Ray's property reads its own deprecated actor_id
            warnings.simplefilter("ignore", RayDeprecationWarning)
            self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if self.restarted:  # what the dead instance held is gone
            for tier in (HOST, SSD):
                self._index.remove_location(Location(self._node_id, tier))
            log.warning("KV store of node %s restarted empty: dropped its index locations",
                        self._node_id)
        self._server = self._start_server(config)
        self._lease_s = pool.node_lease_s
        self._stop = threading.Event()
        self._heartbeat_lock = threading.Lock()
        self._index_lost = False
        self.reannouncements = 0  # times this node's blocks were published again
        self.reannounced_blocks = 0
        self._heartbeat_once()
        threading.Thread(target=self._heartbeat_loop, name="kv-heartbeat", daemon=True).start()

    def _start_server(self, config: KVStoreConfig) -> KVStoreServer:
        """Serve on ``config.port``; with port 0, on the port this node's store had before a
        restart when it is still free (else a new one), recorded for the next restart."""
        port_file = self._port_file()
        if config.port == 0 and self.restarted and port_file.exists():
            server = KVStoreServer(config.model_copy(update={"port": int(port_file.read_text())}),
                                   store=self.store)
            try:
                server.start()
                return server
            except KVStoreError as exc:
                log.warning("restarted KV store cannot reuse its port (%s); workers holding "
                            "the old address will get errors", exc)
        server = KVStoreServer(config, store=self.store)
        server.start()
        if config.port == 0:
            port_file.parent.mkdir(parents=True, exist_ok=True)
            port_file.write_text(str(server.port))
        return server

    def address(self) -> str:
        """``host:port`` for workers; a wildcard bind advertises this node's Ray IP."""
        if self._config.host in _WILDCARD_HOSTS:
            return f"{ray.util.get_node_ip_address()}:{self._server.port}"
        return self._server.address

    def stats(self) -> dict:
        """Store counters plus per-tier block states and promotions."""
        return {**self.store.stats(), "tiers": self.store.tier_stats(),
                "promotions": self.store.promotions, "node_id": self._node_id,
                "index_reannouncements": self.reannouncements,
                "index_reannounced_blocks": self.reannounced_blocks}

    # ---- metadata methods for same-node workers (see TieredNodeStore) ---------------------
    def arena_info(self) -> dict:
        return self.store.arena_info()

    def reserve(self, keys: list[bytes], arena: str | None = None) -> list[int | None]:
        self._check_arena(arena)
        return self.store.reserve(keys)

    def commit(self, keys: list[bytes], slots: list[int | None]) -> None:
        self.store.commit(keys, slots)

    def abort(self, slots: list[int | None]) -> None:
        self.store.abort(slots)

    def acquire(self, keys: list[bytes],
                arena: str | None = None) -> list[tuple[int | None, str | None]]:
        self._check_arena(arena)
        return self.store.acquire(keys)

    def _check_arena(self, arena: str | None) -> None:
        """Slots name places in this store's arena: a caller attached to another one (the
        store restarted since) must re-attach first."""
        current = self.store.arena.shm_name
        if arena is not None and arena != current:
            raise StaleArenaError(arena, current)

    def release(self, slots: list[int | None]) -> None:
        self.store.release(slots)

    # ---- key-level methods of the node store facade (kvstore.node_store_api) ---------------
    def exists(self, keys: list[bytes]) -> list[bool]:
        return self.store.exists(keys)

    def remove(self, keys: list[bytes]) -> int:
        return self.store.remove(keys)

    def pin(self, keys: list[bytes], pinned: bool = True) -> list[bool]:
        return self.store.pin(keys, pinned)

    def stop(self) -> None:
        """Stop heartbeating and serving, free the arena (the actor stays until killed)."""
        self._stop.set()
        self._server.stop(grace=1.0)
        self.store.close()
        self._port_file().unlink(missing_ok=True)  # a stopped store is not restarted

    def _port_file(self) -> Path:
        return Path(tempfile.gettempdir()) / "pdcluster" / f"kvstore-{self._node_id}.port"

    def _heartbeat_once(self) -> bool:
        """Renew the node's lease. When the index did not know the lease (first heartbeat,
        lease ran out, index restarted empty) or the last heartbeat failed (updates may have
        been lost meanwhile), re-announce every block this node holds."""
        with self._heartbeat_lock:
            try:
                renewed = self._index.heartbeat(self._node_id, self._lease_s)
                if not renewed or self._index_lost:
                    self._reannounce()
                self._index_lost = False
                return True
            except Exception as exc:  # noqa: BLE001 — keep trying; lookups skip us meanwhile
                self._index_lost = True
                log.warning("node heartbeat failed: %s", exc)
                return False

    def _reannounce(self) -> None:
        """Publish the keys resident in G2 and G3 as this node's locations (idempotent adds).
        Raises the index's error (the next heartbeat tries again)."""
        tiers = {HOST: self.store.arena.keys(),
                 SSD: self.store.ssd.keys() if self.store.ssd is not None else []}
        for tier, keys in tiers.items():
            for start in range(0, len(keys), _REANNOUNCE_BATCH):
                self._index.add(keys[start:start + _REANNOUNCE_BATCH],
                                Location(self._node_id, tier))
        self.reannouncements += 1
        self.reannounced_blocks += sum(len(k) for k in tiers.values())
        if self.reannouncements > 1:  # the first is this store's start
            log.warning("global index had lost node %s: re-announced %d G2 and %d G3 blocks",
                        self._node_id, len(tiers[HOST]), len(tiers[SSD]))

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self._lease_s / 3):
            self._heartbeat_once()


def start_kvstore_actors(config: KVStoreConfig, pool: KVPoolConfig, layout: BlockLayout,
                         namespace: str | None = None,
                         node_ids: Iterable[str] | None = None,
                         wait: bool = True,
                         actor_cls: type[KVStoreActor] = KVStoreActor,
                         detached: bool = False) -> dict[str, ActorHandle]:
    """Start one KV store actor on every ALIVE Ray node (or on each of `node_ids`: the nodes
    that may run workers, deploy/placement.py) and, with `wait`, wait until each serves
    (`wait_kvstore_actors`). Without it the caller waits later: workers created meanwhile
    find their store by name and start alongside it.

    Each actor is pinned with ``NodeAffinitySchedulingStrategy(node_id, soft=False)`` and named
    ``KVSTORE_ACTOR_PREFIX + node_id`` in ``namespace`` (default: the caller's). Lifetime is
    Ray's default: they die with the driver; ``detached``: they outlive it (a cluster that
    outlives its gateways, deploy.cluster_record). An actor already running under that name is
    reused (its config is not changed). ``actor_cls``: KVStoreActor or a subclass.

    Returns node id (hex) -> actor handle. Raises KVStoreError if one fails to start within
    ``config.rpc_timeout_s * 6`` s.
    """
    if node_ids is None:
        node_ids = [node["NodeID"] for node in ray.nodes() if node.get("Alive")]
    actors: dict[str, ActorHandle] = {
        node_id: start_kvstore_actor(node_id, config, pool, layout, namespace, actor_cls,
                                     detached)
        for node_id in node_ids}
    if wait:
        wait_kvstore_actors(actors, config.rpc_timeout_s * 6)
    return actors


def wait_kvstore_actors(actors: dict[str, ActorHandle], timeout_s: float) -> None:
    """Wait until each of `actors` (node id -> handle) serves. Raises KVStoreError if one
    fails to start within `timeout_s` s."""
    refs = [a.address.remote() for a in actors.values()]
    try:
        ray.get(refs, timeout=timeout_s)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as exc:
        raise KVStoreError(f"KV store actors failed to start: {exc}") from exc


def kvstore_actor_class(cls: type[KVStoreActor] = KVStoreActor):
    """The Ray actor class of ``cls`` (KVStoreActor or a subclass): threaded, as the tiered
    store is thread-safe."""
    return ray.remote(num_cpus=0, max_concurrency=8)(cls)


def start_kvstore_actor(node_id: str, config: KVStoreConfig, pool: KVPoolConfig,
                        layout: BlockLayout, namespace: str | None = None,
                        actor_cls: type[KVStoreActor] = KVStoreActor,
                        detached: bool = False) -> ActorHandle:
    """The KV store actor of one node (created, or the running one of that name)."""
    return kvstore_actor_class(actor_cls).options(
        name=KVSTORE_ACTOR_PREFIX + node_id, namespace=namespace, get_if_exists=True,
        max_restarts=-1, lifetime="detached" if detached else None,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
    ).remote(config, pool, layout)


def kvstore_actor(node_id: str | None = None, namespace: str | None = None,
                  timeout_s: float = 30.0) -> ActorHandle:
    """The KV store actor of `node_id` (default: the caller's own node), waiting up to
    `timeout_s` for it to exist. Raises KVStoreError."""
    node_id = node_id or ray.get_runtime_context().get_node_id()
    name = KVSTORE_ACTOR_PREFIX + node_id
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get_actor(name, namespace=namespace)
        except ValueError:
            if time.monotonic() >= deadline:
                raise KVStoreError(f"no KV store actor {name!r} on node {node_id} "
                                   f"after {timeout_s} s") from None
            time.sleep(0.1)
