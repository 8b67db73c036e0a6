"""gRPC clients for other nodes' KV stores, found by Ray node id (never by IP: on one machine
every node shares 127.0.0.1)."""

from __future__ import annotations

import threading

from pdcluster.engine import ray_calls
from pdcluster.kvstore.actor import kvstore_actor
from pdcluster.kvstore.client import KVStoreClient
from pdcluster.kvstore.config import KVTLSConfig
from pdcluster.kvstore.errors import KVTransferError


class RemoteStores:
    """node id → KVStoreClient, resolved through the node's named KV store actor and cached.

    Thread-safe. Raises KVTransferError when a node's store cannot be resolved in time.
    """

    def __init__(self, namespace: str | None, token: str | None, timeout_s: float,
                 tls: KVTLSConfig | None = None) -> None:
        self.namespace = namespace
        self.token = token
        self.tls = tls
        self.timeout_s = timeout_s
        self._clients: dict[str, KVStoreClient] = {}
        self._lock = threading.Lock()

    def client(self, node_id: str) -> KVStoreClient:
        with self._lock:
            client = self._clients.get(node_id)
        if client is not None:
            return client
        try:
            actor = kvstore_actor(node_id, self.namespace, timeout_s=self.timeout_s)
            address = ray_calls.result(actor.address.remote(), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 — dead node, missing actor, Ray timeout
            raise KVTransferError(f"no KV store reachable on node {node_id}: {exc}") from exc
        client = KVStoreClient(address, timeout_s=self.timeout_s, token=self.token,
                               tls=self.tls)
        with self._lock:
            return self._clients.setdefault(node_id, client)

    def forget(self, node_id: str) -> None:
        with self._lock:
            client = self._clients.pop(node_id, None)
        if client is not None:
            client.close()

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
