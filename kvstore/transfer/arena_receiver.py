"""The KV store path between two workers of one node: full blocks through the node's
shared-memory arena (kvstore.arena), the request's tail block by its handle over gRPC."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor

import torch

from kvstore.client import KVStoreClient
from kvstore.errors import BlockLayoutError, BlockNotFoundError, KVStoreError, KVTransferError
from kvstore.node_client import NodeStoreClient
from kvstore.transfer.base import FetchRequest, KVReceiver, TransferState
from kvstore.transfer.dest import BlockDest


class ArenaReceiver(KVReceiver):
    """Store path on the prefill's own node: full blocks from the node's shared-memory arena
    (only metadata over Ray RPC), then the tail by handle over gRPC; on `executor`'s threads.

    Args:
        node_client: this node's KV store (its arena).
        store_client: the gRPC client of a store address (for the tail).
        executor: runs the transfer.
        timeout_s: the transfer's deadline, seconds.

    Attributes:
        arena_bytes: bytes of the full blocks (the rest of result() came over gRPC).
    """

    def __init__(self, node_client: NodeStoreClient, store_client: Callable[[str], KVStoreClient],
                 executor: Executor, timeout_s: float) -> None:
        super().__init__()
        self._node_client, self._store_client = node_client, store_client
        self._executor, self._timeout_s = executor, timeout_s
        self.arena_bytes = 0

    def start(self, request: FetchRequest, dest: BlockDest | torch.Tensor) -> None:
        dest = self._accept(request, dest, self._timeout_s, TransferState.TRANSFERRING)
        self._executor.submit(self._run, dest)

    def _run(self, dest: BlockDest) -> None:
        request = self.request
        try:
            keys = list(request.keys)
            if keys:
                out = torch.empty((len(keys), *dest.block_shape), dtype=dest.dtype)
                tiers = self._node_client.get(keys, out)
                missing = [k for k, t in zip(keys, tiers) if t is None]
                if missing:
                    raise BlockNotFoundError(f"{len(missing)} of {len(keys)} blocks left this "
                                             "node's pool before decode read them",
                                             missing=missing)
                self._write(dest.write_tensor, 0, out)
                self.arena_bytes = len(keys) * dest.block_nbytes
                self._add_bytes(self.arena_bytes)
            if request.tail_handle is not None:
                client = self._store_client(request.address)
                tail, num_tokens = client.take_tail(request.tail_handle,
                                                    timeout_s=self._remaining_s())
                if num_tokens != request.num_tail_tokens:
                    raise BlockLayoutError(f"tail {request.tail_handle!r} holds {num_tokens} "
                                           f"tokens, expected {request.num_tail_tokens}")
                self._write(dest.write_tensor, len(keys), tail.unsqueeze(0))
                self._add_bytes(dest.block_nbytes)
            self._succeed()
        except KVStoreError as exc:
            self._fail(exc)  # a no-op once aborted
        except Exception as exc:  # noqa: BLE001 — the write guard after an abort, or a bug
            self._fail(KVTransferError(f"{self._describe()}: {exc!r}", address=request.address))
