"""A layer stream as a decode's source: the pieces the prefill puts on its node's store as each
layer ends, taken into the request's reserved blocks (kvstore.transport.layer_stream.stream).
The announce travels in kv_transfer_params under ``layer_stream``; a stream can start before
its request reaches the decode (decode_worker.kv_streams)."""

from __future__ import annotations

import torch

from pdcluster.engine.core.kv_connector import BlockCache
from pdcluster.kvstore.transport.base import KVReceiver
from pdcluster.kvstore.transport.source import KVSource, Params
from pdcluster.kvstore.transport.layer_stream.stream import (ALL_LAYERS, LayerPiece,
                                                             LayerStreamAnnounce,
                                                             LayerStreamReceiver)

#: the kv_transfer_params key the prefill's LayerStreamConnector writes
PARAM = "layer_stream"


def announce_of(params: Params) -> LayerStreamAnnounce | None:
    return params.get(PARAM)  # type: ignore[return-value]


class LayerStreamSource(KVSource):
    """Pieces over gRPC from the prefill node's store (a stream without a TE region)."""

    name = "layer"
    pushed = True
    preference = 0

    def offered(self, params: Params) -> bool:
        announce = announce_of(params)
        return announce is not None and announce.region is None

    def num_blocks(self, params: Params) -> int:
        return announce_of(params).num_blocks

    def receiver(self, announce: LayerStreamAnnounce, writer: LayerWriter) -> KVReceiver:
        return LayerStreamReceiver(self.host.grpc.client(announce.address), announce,
                                   writer.write, writer.finish, writer.piece_shape,
                                   torch.uint8, self.host.timeout_s)

    def start(self, params: Params, table: list[int], skip_blocks: int,
              attempt: int) -> tuple[str, KVReceiver]:
        announce = announce_of(params)
        receiver = self.receiver(announce, LayerWriter(self.host.cache, table))
        receiver.start()
        return "layer", receiver

    def left(self, params: Params, receiver: KVReceiver) -> None:
        self._release_pieces(announce_of(params), receiver.num_taken)

    def release(self, params: Params) -> None:
        self._release_pieces(announce_of(params), 0)

    def _release_pieces(self, announce: LayerStreamAnnounce, start: int) -> None:
        """Drop the pieces ``start..`` nobody will take from the prefill's store."""
        self.host.grpc.release_handles(announce.address, announce.handles[start:])


class LayerWriter:
    """Puts a layer stream's pieces into the reserved blocks: straight into the paged cache
    (TP=1), else into a staging copy written whole at the end, each rank keeping its share
    (the ShardedKVView writes only whole blocks)."""

    def __init__(self, cache: BlockCache, table: list[int]) -> None:
        self.table, self.cache = table, cache
        self.direct = hasattr(cache, "write_layer")  # the paged cache itself, not a sharded view
        self.staging = None if self.direct else torch.zeros(
            (len(table), self.cache.block_nbytes), dtype=torch.uint8)

    def piece_shape(self, piece: LayerPiece) -> tuple[int, ...]:
        if piece.layer == ALL_LAYERS:
            return piece.num_blocks, self.cache.block_nbytes
        start, end = self.cache.spec.layer_span(piece.layer)
        return piece.num_blocks, end - start

    def write(self, piece: LayerPiece, data: torch.Tensor) -> None:
        lo, hi = piece.block_start, piece.block_start + piece.num_blocks
        if piece.layer == ALL_LAYERS:
            if self.direct:
                self.cache.write_blocks(self.table[lo:hi], data)
            else:
                self.staging[lo:hi] = data
        elif self.direct:
            self.cache.write_layer(self.table[lo:hi], piece.layer, data)
        else:
            start, end = self.cache.spec.layer_span(piece.layer)
            self.staging[lo:hi, start:end] = data

    def finish(self) -> None:
        if self.staging is not None:
            self.cache.write_blocks(self.table, self.staging)
