"""Mooncake's Transfer Engine as a decode's sources: a whole prompt the prefill holds in a
region of its TE-registered memory (``kv_region`` in kv_transfer_params, written by
kvstore.transport.mooncake.connector), and a layer stream whose pieces it writes into such a
region as its layers end (an announce with a ``region``). Both are read one-sided; a read
under way cannot be cancelled, so an abort waits for TE to report it."""

from __future__ import annotations

import torch

from pdcluster.kvstore.handoff import DecodeHandoff
from pdcluster.kvstore.transport.base import FetchRequest, KVReceiver
from pdcluster.kvstore.transport.source import FetchHost, KVSource, Params
from pdcluster.kvstore.transport.layer_stream.source import (LayerStreamSource, LayerWriter,
                                                             announce_of)
from pdcluster.kvstore.transport.layer_stream.stream import LayerStreamAnnounce
from pdcluster.kvstore.transport.mooncake.backend import MooncakeTransferBackend, RemoteRegion
from pdcluster.kvstore.transport.mooncake.layer_stream import MooncakeLayerStreamReceiver


#: the kv_transfer_params key the prefill's MooncakeConnector writes
PARAM = "kv_region"


def region_of(params: Params) -> RemoteRegion | None:
    return params.get(PARAM)  # type: ignore[return-value]


class MooncakeRegionSource(KVSource):
    name = "mooncake"
    pushed = True
    cancellable = False

    def __init__(self, host: FetchHost, backend: MooncakeTransferBackend) -> None:
        super().__init__(host)
        self.backend = backend

    def offered(self, params: Params) -> bool:
        return region_of(params) is not None

    def start(self, params: Params, table: list[int], skip_blocks: int,
              attempt: int) -> tuple[str, KVReceiver]:
        prefill, region = DecodeHandoff.of(params), region_of(params)
        receiver = self.backend.create_receiver()
        receiver.start(FetchRequest(region.session, prefill.block_keys, prefill.tail_handle,
                                    prefill.num_tail_tokens, region=region),
                       self.host.dest(table))
        return self.name, receiver

    def release(self, params: Params) -> None:
        self.host.grpc.submit(self.backend.release, region_of(params))


class MooncakeLayerStreamSource(LayerStreamSource):
    """A layer stream whose pieces wait in a TE region (its announce's ``region``)."""

    name = "layer-mooncake"

    def __init__(self, host: FetchHost, backend: MooncakeTransferBackend) -> None:
        super().__init__(host)
        self.backend = backend

    def offered(self, params: Params) -> bool:
        announce = announce_of(params)
        return announce is not None and announce.region is not None

    def receiver(self, announce: LayerStreamAnnounce, writer: LayerWriter) -> KVReceiver:
        return MooncakeLayerStreamReceiver(self.backend, announce, writer.write, writer.finish,
                                           writer.piece_shape, torch.uint8,
                                           self.host.timeout_s)

    def left(self, params: Params, receiver: KVReceiver) -> None:
        self.release(params)

    def release(self, params: Params) -> None:
        self.host.grpc.submit(self.backend.release, announce_of(params).region)

    def bytes_moved(self, path: str, receiver: KVReceiver) -> dict[str, int]:
        return {"layer-mooncake": receiver.result()}


def mooncake_sources(host: FetchHost, backend: MooncakeTransferBackend) -> list[KVSource]:
    return [MooncakeLayerStreamSource(host, backend), MooncakeRegionSource(host, backend)]
