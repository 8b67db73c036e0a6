"""Transfer backends by name (``--kv-transfer``): a dict, not an if/elif chain."""

from __future__ import annotations

from pdcluster.kvstore.config import KVStoreConfig, KVTransferConfig
from pdcluster.kvstore.transfer.base import KVTransferBackend
from pdcluster.kvstore.transport.mooncake.backend import MooncakeTransferBackend
from pdcluster.kvstore.transport.pool.grpc_backend import GrpcTransferBackend
from pdcluster.kvstore.transport.torch_pair.backend import TorchTransferBackend

TRANSFER_BACKENDS: dict[str, type[KVTransferBackend]] = {
    cls.name: cls for cls in (GrpcTransferBackend, TorchTransferBackend, MooncakeTransferBackend)
}


def create_backend(config: KVTransferConfig,
                   kv_config: KVStoreConfig | None = None) -> KVTransferBackend:
    """The backend ``config.backend`` names, built from ``config`` and the KV plane's token,
    TLS and gRPC message size in ``kv_config`` (None: see KVTransferBackend)."""
    return TRANSFER_BACKENDS[config.backend](config, kv_config)


def handoff_of(config: KVTransferConfig) -> str:
    """How the prefill hands KV over on ``config.backend`` (KVTransferBackend.handoff)."""
    return TRANSFER_BACKENDS[config.backend].handoff
