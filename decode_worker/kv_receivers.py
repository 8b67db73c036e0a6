"""The decode side's own receivers and writers (kv_fetch.py drives them): the store path on
the prefill's own node (shared-memory arena, then the tail over gRPC), and the writer that puts
a layer stream's pieces into the reserved cache blocks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.kv_cache import PagedKVCache
from kvstore.errors import BlockLayoutError, BlockNotFoundError, KVStoreError, KVTransferError
from kvstore.transfer.base import FetchRequest, KVReceiver, TransferState
from kvstore.transfer.dest import BlockDest
from kvstore.transfer.layer_stream import ALL_LAYERS, LayerPiece

if TYPE_CHECKING:  # kv_fetch imports this module
    from decode_worker.kv_fetch import KVFetcher


class LayerWriter:
    """Puts a layer stream's pieces into the reserved blocks: straight into the paged cache
    (TP=1), else into a staging copy written whole at the end, each rank keeping its KV heads
    (the ShardedKVView writes only whole blocks)."""

    def __init__(self, fetcher: KVFetcher, table: list[int]) -> None:
        self._fetcher, self.table, self.cache = fetcher, table, fetcher.kv_cache
        self.direct = isinstance(self.cache, PagedKVCache)
        self.staging = None if self.direct else torch.zeros(
            (len(table), *self.cache.block_shape), dtype=self.cache.dtype)

    def piece_shape(self, piece: LayerPiece) -> tuple[int, ...]:
        shape = self.cache.block_shape  # (layers, 2, block_size, kv_heads, head_dim)
        return (piece.num_blocks, *(shape if piece.layer == ALL_LAYERS else shape[1:]))

    def write(self, piece: LayerPiece, data: torch.Tensor) -> None:
        whole = piece.layer == ALL_LAYERS
        data = self._fetcher._perturbed(data, 2 if whole else 1)
        lo, hi = piece.block_start, piece.block_start + piece.num_blocks
        if not self.direct:
            if whole:
                self.staging[lo:hi] = data
            else:
                self.staging[lo:hi, piece.layer] = data
        elif whole:
            self.cache.write_blocks(self.table[lo:hi], data)
        else:
            index = torch.tensor(self.table[lo:hi], device=self.cache.device)
            data = data.to(self.cache.device)
            self.cache.k[piece.layer][index] = data[:, 0]
            self.cache.v[piece.layer][index] = data[:, 1]

    def finish(self) -> None:
        if self.staging is not None:
            self.cache.write_blocks(self.table, self.staging)


class ArenaReceiver(KVReceiver):
    """Store path on the prefill's own node: full blocks from the node's shared-memory arena
    (only metadata over Ray RPC), then the tail by handle over gRPC; on the fetcher's threads.

    Attributes:
        arena_bytes: bytes of the full blocks (the rest of result() came over gRPC).
    """

    def __init__(self, fetcher: KVFetcher) -> None:
        super().__init__()
        self._fetcher = fetcher
        self.arena_bytes = 0

    def start(self, request: FetchRequest, dest: BlockDest | torch.Tensor) -> None:
        dest = self._accept(request, dest, self._fetcher.transfer.timeout_s,
                            TransferState.TRANSFERRING)
        self._fetcher._threads.submit(self._run, dest)

    def _run(self, dest: BlockDest) -> None:
        request = self.request
        try:
            keys = list(request.keys)
            if keys:
                out = torch.empty((len(keys), *dest.block_shape), dtype=dest.dtype)
                tiers = self._fetcher.node_client.read(keys, out)
                missing = [k for k, t in zip(keys, tiers) if t is None]
                if missing:
                    raise BlockNotFoundError(f"{len(missing)} of {len(keys)} blocks left this "
                                             "node's pool before decode read them",
                                             missing=missing)
                self._write(dest.write_tensor, 0, out)
                self.arena_bytes = len(keys) * dest.block_nbytes
                self._add_bytes(self.arena_bytes)
            if request.tail_handle is not None:
                client = self._fetcher.grpc.client(request.address)
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
