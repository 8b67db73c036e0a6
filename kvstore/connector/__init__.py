"""KV connectors by name: the registry through which a worker builds the connectors it runs.

A new way to move KV is one module with a ``KVConnector`` subclass (``engine.core.kv_connector``),
in its transport's package under ``kvstore.transport`` beside the receiving half, and one entry
here. Entries name their module, which is imported only when the connector is
built, so a heavy or optional dependency (a transfer engine's wheel) costs nothing to workers
that do not use it.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from pdcluster.engine.core.kv_connector import KVConnector
from pdcluster.kvstore.connector.context import KVConnectorContext
from pdcluster.kvstore.connector.multi import MultiConnector

#: name -> "module:class"
KV_CONNECTORS: dict[str, str] = {
    "pool": "pdcluster.kvstore.transport.pool.connector:PoolConnector",
    "pool-load": "pdcluster.kvstore.transport.pool.connector:PoolLoadConnector",
    "layer": "pdcluster.kvstore.transport.layer_stream.connector:LayerStreamConnector",
    "torch": "pdcluster.kvstore.transport.torch_pair.push:TorchPushConnector",
    "fetch": "pdcluster.kvstore.connector.fetch:FetchConnector",
    "mooncake": "pdcluster.kvstore.transport.mooncake.connector:MooncakeConnector",
    "publish": "pdcluster.kvstore.transport.pool.publish:PublishConnector",
}


def connector_class(name: str) -> type[KVConnector]:
    """The class registered as ``name``. Raises KeyError for an unknown name."""
    module, _, cls = KV_CONNECTORS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def create_connector(names: Sequence[str], ctx: KVConnectorContext) -> KVConnector:
    """The named connectors built from ``ctx``; several run as one MultiConnector, in order."""
    connectors = [connector_class(name).from_context(ctx) for name in names]
    return connectors[0] if len(connectors) == 1 else MultiConnector(connectors)


def prefill_connector_names(backend: str, streaming: str, tp_size: int) -> list[str]:
    """What a prefill worker runs: the pool always (the prefix cache, and every decode's
    fallback), layer streaming at TP=1 when asked, the torch pair push or the Mooncake source
    when asked."""
    return (["pool"] + (["layer"] if streaming == "layer" and tp_size == 1 else [])
            + ([backend] if backend in ("torch", "mooncake") else []))
