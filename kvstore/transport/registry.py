"""Every way KV moves, registered once.

A transport is one package under kvstore.transport holding both halves and one entry in
TRANSPORTS: the prefill's connectors that send or offer a request's KV, the backend whose
channels the decode shares among its transfers, and the decode's sources that take the KV in
(kvstore.transport.source). The pool (``grpc``) is every decode's fallback. KV_CONNECTORS names
each connector a worker can run; entries name their module, imported only when the connector
is built, so a transfer engine's wheel costs nothing to workers that do not use it, and
reading the registry (a config check) imports neither torch nor a transport.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pydantic

from pdcluster.kvstore.config import KVStoreConfig, KVTransferConfig

if TYPE_CHECKING:  # what the entries build, imported when they are built
    from pdcluster.engine.core.kv_connector import KVConnector
    from pdcluster.kvstore.transport.base import KVTransferBackend
    from pdcluster.kvstore.transport.context import KVConnectorContext
    from pdcluster.kvstore.transport.source import FetchHost, KVSource

_HERE = "pdcluster.kvstore.transport"
#: name -> "module:class"
KV_CONNECTORS: dict[str, str] = {
    "pool": f"{_HERE}.pool.connector:PoolConnector",
    "pool-load": f"{_HERE}.pool.connector:PoolLoadConnector",
    "publish": f"{_HERE}.pool.publish:PublishConnector",
    "layer": f"{_HERE}.layer_stream.connector:LayerStreamConnector",
    "torch": f"{_HERE}.torch_pair.push:TorchPushConnector",
    "mooncake": f"{_HERE}.mooncake.connector:MooncakeConnector",
    "layer-mooncake": f"{_HERE}.mooncake.layer_connector:MooncakeLayerStreamConnector",
    "fetch": f"{_HERE}.fetch:FetchConnector",
}


@dataclass(frozen=True)
class Transport:
    """Both halves of one transport (``--kv-transfer`` name).

    backend: "module:class" of its KVTransferBackend, built as ``cls(transfer, kv_config)``.
    sources: "module:function", ``function(host, backend) -> [KVSource]``, the decode's half.
    connectors: KV_CONNECTORS names a prefill runs beside the pool's to send or offer KV.
    layer_connector: the KV_CONNECTORS name of its layer streaming (``--kv-streaming layer``).
    settings: "module:class" of the pydantic model its section of the transfer config
        (``kv_connector_extra_config``) must satisfy; None: it takes none.
    """

    backend: str
    sources: str
    connectors: tuple[str, ...] = ()
    layer_connector: str = "layer"
    settings: str | None = None


#: the pool: the prefix cache, and every decode's fallback
POOL = "grpc"
TRANSPORTS: dict[str, Transport] = {
    POOL: Transport(f"{_HERE}.pool.grpc_backend:GrpcTransferBackend",
                    f"{_HERE}.pool.source:pool_sources"),
    "torch": Transport(f"{_HERE}.torch_pair.backend:TorchTransferBackend",
                       f"{_HERE}.torch_pair.source:torch_sources", ("torch",)),
    "mooncake": Transport(f"{_HERE}.mooncake.backend:MooncakeTransferBackend",
                          f"{_HERE}.mooncake.source:mooncake_sources", ("mooncake",),
                          "layer-mooncake", f"{_HERE}.mooncake.settings:MooncakeSettings"),
}


def _load(ref: str):
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def connector_class(name: str) -> type[KVConnector]:
    """The class registered as ``name``. Raises KeyError for an unknown name."""
    return _load(KV_CONNECTORS[name])


def create_connector(names: Sequence[str], ctx: KVConnectorContext) -> KVConnector:
    """The named connectors built from ``ctx``; several run as one MultiConnector, in order."""
    from pdcluster.kvstore.transport.multi import MultiConnector

    connectors = [connector_class(name).from_context(ctx) for name in names]
    return connectors[0] if len(connectors) == 1 else MultiConnector(connectors)


def prefill_connector_names(transfer: KVTransferConfig, tp_size: int) -> list[str]:
    """What a prefill worker runs: the pool always (the prefix cache, and every decode's
    fallback), its transport's layer streaming at TP=1 when asked, its transport's
    connectors."""
    transport = TRANSPORTS[transfer.backend]
    layer = transfer.streaming == "layer" and tp_size == 1
    return ["pool"] + ([transport.layer_connector] if layer else []) + list(transport.connectors)


def check_settings(transfer: KVTransferConfig) -> None:
    """Validate ``transfer.kv_connector_extra_config`` with its transport's settings model.
    Raises ValueError naming the transport and the bad or unexpected keys."""
    transport = TRANSPORTS[transfer.backend]
    extra = transfer.kv_connector_extra_config
    if transport.settings is None:
        if extra:
            raise ValueError(f"--kv-transfer {transfer.backend} takes no "
                             f"kv_connector_extra_config; got {sorted(extra)}")
        return
    try:
        _load(transport.settings).model_validate(extra)
    except pydantic.ValidationError as exc:
        raise ValueError(f"kv_connector_extra_config of --kv-transfer {transfer.backend}: "
                         f"{exc}") from None


def backend_class(name: str) -> type[KVTransferBackend]:
    """The backend class of transport ``name``. Raises KeyError for an unknown name."""
    return _load(TRANSPORTS[name].backend)


def create_backend(config: KVTransferConfig,
                   kv_config: KVStoreConfig | None = None) -> KVTransferBackend:
    """The backend of transport ``config.backend``, built from ``config`` and the KV plane's
    token, TLS and gRPC message size in ``kv_config`` (None: see KVTransferBackend)."""
    return backend_class(config.backend)(config, kv_config)


def decode_sources(host: FetchHost, transport: str, backend: KVTransferBackend,
                   store: KVTransferBackend) -> list[KVSource]:
    """The decode's sources: transport ``transport``'s over ``backend``, and the pool's over
    ``store`` (the pool's own backend, or a test's), ordered by preference, the pool's last."""
    sources: list[KVSource] = _load(TRANSPORTS[POOL].sources)(host, store)
    if transport != POOL:
        sources += _load(TRANSPORTS[transport].sources)(host, backend)
    return sorted(sources, key=lambda s: (s.fallback, s.preference))
