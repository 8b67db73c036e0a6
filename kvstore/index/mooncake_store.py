"""The global index of `--kv-pool mooncake-store`: a Mooncake Store's own key lookup.

Mooncake Store holds the blocks and knows which it holds; it does not say on which node. So
this index stores nothing: `longest_prefix` is one batched existence check, and every block
found is at the one location ``Location(POOL_NODE, "mooncake_store")``, which no instance
counts as its own node's (the Conductor prices loading it at the pool's measured cost, the
``remote`` path unless `pdcluster profile` measured ``pool:mooncake_store``). Publishing
(`add`, `remove`, events) and node leases are no-ops: a block is published by putting it into
the store (kvstore.transport.pool.connector), and the store's own leases and eviction say how
long it stays.

The client connects on first use, so a process that only publishes never opens one.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from pdcluster.kvstore.errors import KVStoreError
from pdcluster.kvstore.index.base import (DEFAULT_NODE_LEASE_S, KVIndex, KVIndexUnavailableError,
                                          Location, check_keys)

#: the node id of every Mooncake Store location: the store, not a Ray node
POOL_NODE = "mooncake-store"
POOL_LOCATION = Location(POOL_NODE, "mooncake_store")


class MooncakeStoreIndex(KVIndex):
    """The index over the Mooncake Store whose master is at `master` ("host:port"); `kw` go
    to kvstore.mooncake_store.MooncakeStoreClient (bind_host, protocol, segment_bytes,
    buffer_bytes). Lookups raise KVIndexUnavailableError when the store cannot be reached."""

    holds_blocks = True

    def __init__(self, master: str, **kw) -> None:
        # a pure lookup client (the Conductor's) needs no large staging buffer
        self.master, self._kw = master, {"buffer_bytes": 1 << 20, **kw}
        self._client = None
        self._lock = threading.Lock()

    @property
    def block_store(self):
        """The store client (connected now if it was not). Raises KVIndexUnavailableError."""
        with self._lock:
            if self._client is None:
                from pdcluster.kvstore.mooncake_store import MooncakeStoreClient

                try:
                    self._client = MooncakeStoreClient(self.master, **self._kw)
                except KVStoreError as exc:
                    raise KVIndexUnavailableError(str(exc)) from exc
            return self._client

    def add(self, keys: Sequence[bytes], location: Location) -> None:
        check_keys(keys)

    def remove(self, keys: Sequence[bytes], location: Location) -> None:
        pass

    def remove_location(self, location: Location) -> None:
        pass

    def lookup(self, keys: Sequence[bytes]) -> list[list[Location]]:
        check_keys(keys)
        return [[POOL_LOCATION] if held else [] for held in self._ask("exists", keys)]

    def longest_prefix(self, keys: Sequence[bytes]) -> list[list[Location]]:
        check_keys(keys)
        return [[POOL_LOCATION] for _ in range(self._ask("longest_prefix", keys))]

    def heartbeat(self, node_id: str, lease_s: float = DEFAULT_NODE_LEASE_S) -> bool:
        return True

    def clear(self) -> None:
        """Nothing to drop here: the store's objects are the store's."""

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def _ask(self, method: str, keys: Sequence[bytes]):
        """The store client's `method`(keys); its errors as KVIndexUnavailableError."""
        store = self.block_store
        try:
            return getattr(store, method)(keys)
        except KVStoreError as exc:
            raise KVIndexUnavailableError(str(exc)) from exc
