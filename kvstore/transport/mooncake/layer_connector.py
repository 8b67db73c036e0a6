"""Layer streaming over Mooncake's Transfer Engine, the prefill's half: the layer stream
connector with its pieces written into the worker's TE-registered staging buffer (a
RegionSource shared with the MooncakeConnector) instead of put on the node's store."""

from __future__ import annotations

from pdcluster.kvstore.transport.context import KVConnectorContext
from pdcluster.kvstore.transport.layer_stream.connector import LayerStreamConnector
from pdcluster.kvstore.transport.mooncake.connector import RegionSource


class MooncakeLayerStreamConnector(LayerStreamConnector):
    @classmethod
    def from_context(cls, ctx: KVConnectorContext) -> MooncakeLayerStreamConnector:
        return cls(ctx.store_client, ctx.store_address, ctx.peers, ctx.worker_id,
                   ctx.transfer.timeout_s, ctx.token_budget, RegionSource.of(ctx))
