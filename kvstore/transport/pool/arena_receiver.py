"""The KV store path between two workers of one node: full blocks through the node's
shared-memory arena (kvstore.arena), the request's tail block by its handle over gRPC."""

from __future__ import annotations

import torch

from pdcluster.kvstore.errors import BlockNotFoundError
from pdcluster.kvstore.node_client import NodeStoreClient
from pdcluster.kvstore.transport.pool.grpc_backend import GrpcKVReceiver, GrpcTransferBackend


class ArenaReceiver(GrpcKVReceiver):
    """Store path on the prefill's own node: full blocks from the node's shared-memory arena
    (only metadata over Ray RPC) in one read, then the tail as GrpcKVReceiver takes it.

    Args:
        backend: the gRPC backend (the tail's client, the threads, the deadline).
        node_client: this node's KV store (its arena).

    Attributes:
        arena_bytes: bytes of the full blocks (the rest of result() came over gRPC).
    """

    def __init__(self, backend: GrpcTransferBackend, node_client: NodeStoreClient) -> None:
        super().__init__(backend)
        self._node_client = node_client
        self.arena_bytes = 0

    def _bounds(self, num_keys: int, block_nbytes: int) -> list[int]:
        return [0, num_keys]

    def _fetch_slice(self, lo: int, hi: int) -> None:
        dest, keys = self._dest, list(self.request.keys[lo:hi])
        out = torch.empty((len(keys), *dest.block_shape), dtype=dest.dtype)
        tiers = self._node_client.get(keys, out)
        missing = [k for k, t in zip(keys, tiers) if t is None]
        if missing:
            raise BlockNotFoundError(f"{len(missing)} of {len(keys)} blocks left this node's "
                                     "pool before decode read them", missing=missing)
        self._write(dest.write_tensor, lo, out)
        self.arena_bytes = len(keys) * dest.block_nbytes
        self._add_bytes(self.arena_bytes)
