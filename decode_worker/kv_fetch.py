"""Pulls a request's prompt KV from the prefill node's KV store into the decode paged cache.

Full blocks come by key: through the node's shared-memory arena when the prefill ran on this
node, over the store's gRPC service otherwise. The partial tail block comes by its one-shot
per-request handle over gRPC. Protobuf or shared memory only: no pickle, no Ray object store.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

from engine.kv_cache import PagedKVCache
from engine.protocol import PrefillResult
from kvstore.client import KVStoreClient
from kvstore.errors import BlockNotFoundError, KVStoreError
from kvstore.node_client import NodeStoreClient


class KVFetcher:
    """Fetches into a PagedKVCache; thread-safe (one gRPC channel per store address).

    v_perturbation: TEST-ONLY hook. When non-zero, this value is added to every received V
    block before it is written to the cache, so a test can prove the decode output depends on
    the KV that came over the wire. Always 0 in serving.
    """

    def __init__(self, kv_cache: PagedKVCache, timeout_s: float, token: str | None = None,
                 node_id: str | None = None, node_client: NodeStoreClient | None = None) -> None:
        self.kv_cache = kv_cache
        self.timeout_s = timeout_s
        self.token = token
        self.node_id = node_id
        self.node_client = node_client
        self.v_perturbation = 0.0
        self.bytes_fetched_total = 0
        self._clients: dict[str, KVStoreClient] = {}
        self._lock = threading.Lock()

    def _client(self, address: str) -> KVStoreClient:
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = self._clients[address] = KVStoreClient(address, timeout_s=self.timeout_s,
                                                                token=self.token)
            return client

    def fetch(self, prefill: PrefillResult, block_table: Sequence[int]) -> int:
        """Write the prompt's KV into block_table[0 : n_full (+1 if tail)]. Returns bytes read.

        Raises kvstore.errors.KVStoreError subclasses (missing block, timeout, RPC failure);
        the caller frees the blocks it reserved.
        """
        client = self._client(prefill.kv_address)
        parts: list[torch.Tensor] = []
        if prefill.block_keys:
            parts.append(self._full_blocks(prefill, client))
        if prefill.tail_handle is not None:
            tail, num_tokens = client.take_tail(prefill.tail_handle)
            if num_tokens != prefill.num_tail_tokens:
                raise KVStoreError(f"tail {prefill.tail_handle} holds {num_tokens} tokens, "
                                   f"expected {prefill.num_tail_tokens}")
            parts.append(tail.unsqueeze(0))
        if not parts:
            return 0
        data = torch.cat(parts) if len(parts) > 1 else parts[0]
        if self.v_perturbation:
            data[:, :, 1] += self.v_perturbation  # block layout [n, layers, k|v, ...]
        self.kv_cache.write_blocks(block_table[: data.shape[0]], data)
        nbytes = data.numel() * data.element_size()
        self.bytes_fetched_total += nbytes
        return nbytes

    def _full_blocks(self, prefill: PrefillResult, client: KVStoreClient) -> torch.Tensor:
        keys = list(prefill.block_keys)
        if self.node_client is None or prefill.kv_node_id != self.node_id:
            return client.get_blocks(keys)
        out = torch.empty((len(keys), *self.kv_cache.block_shape), dtype=self.kv_cache.dtype)
        tiers = self.node_client.read(keys, out)
        missing = [k for k, t in zip(keys, tiers) if t is None]
        if missing:
            raise BlockNotFoundError(f"{len(missing)} of {len(keys)} blocks left this node's "
                                     "pool before decode read them", missing=missing)
        return out

    def release_tail(self, prefill: PrefillResult | None) -> None:
        """Drop the tail block on the prefill side for a request that will never fetch it
        (nothing to do for a colocated request: prefill None)."""
        if prefill is None or prefill.tail_handle is None:
            return
        try:
            self._client(prefill.kv_address).release_tail(prefill.tail_handle)
        except KVStoreError:
            pass  # the store's tail TTL reclaims it

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
