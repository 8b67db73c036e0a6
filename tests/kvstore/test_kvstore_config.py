"""KVStoreConfig and KVTransferConfig: the KV plane's settings live on KVStoreConfig only."""

from __future__ import annotations

import pydantic
import pytest

from pdcluster.kvstore.config import KVStoreConfig, KVTransferConfig
from pdcluster.kvstore.transport.registry import create_backend
from pdcluster.kvstore.transport.pool.grpc_backend import GrpcTransferBackend
from pdcluster.kvstore.transport.torch_pair.backend import TorchTransferBackend

def test_store_names_set_their_fields():
    config = KVStoreConfig(tail_capacity_bytes=4096, rpc_timeout_s=3.5)
    assert (config.tail_capacity_bytes, config.rpc_timeout_s) == (4096, 3.5)


@pytest.mark.parametrize("model, name", [(KVStoreConfig, "capacity_bytes"),
                                         (KVStoreConfig, "transfer_timeout_s"),
                                         (KVTransferConfig, "token"),
                                         (KVTransferConfig, "tls"),
                                         (KVTransferConfig, "max_message_bytes")])
def test_names_that_never_shipped_are_refused_by_name(model, name):
    with pytest.raises(pydantic.ValidationError, match=name):
        model.model_validate({name: 1})


def test_transfer_config_holds_no_kv_plane_settings():
    config = KVTransferConfig()
    assert config.model_dump().keys() == {"backend", "timeout_s", "max_chunk_bytes",
                                          "num_streams", "min_stream_bytes", "bind_host",
                                          "streaming", "load_failure_policy",
                                          "decode_publish", "decode_publish_interval",
                                          "incremental_transfer", "kv_connector_extra_config"}
    # a backend built without the store's config: no token, no TLS (stores without auth)
    backend = GrpcTransferBackend(config)
    assert backend.kv_config == KVStoreConfig()
    backend.close()


def test_grpc_backend_dials_with_the_store_configs_token_tls_and_message_size():
    kv = KVStoreConfig(token="kv-token", max_message_bytes=1 << 20, rpc_timeout_s=99)
    backend = GrpcTransferBackend(KVTransferConfig(timeout_s=7.0), kv)
    try:
        client = backend.client("127.0.0.1:1")  # channels connect lazily: nothing listens
        assert client.max_message_bytes == 1 << 20
        assert client.timeout_s == 7.0  # a transfer's deadline, not one RPC's
        assert ("authorization", "Bearer kv-token") in client._metadata
    finally:
        backend.close()


def test_create_backend_hands_every_backend_the_store_config():
    kv = KVStoreConfig(token="kv-token")
    for name, cls in (("grpc", GrpcTransferBackend), ("torch", TorchTransferBackend)):
        backend = create_backend(KVTransferConfig(backend=name), kv)
        assert isinstance(backend, cls) and backend.kv_config is kv
        backend.close()
