"""KVStoreConfig and KVTransferConfig: the KV plane's settings live on KVStoreConfig only, and
the renamed and removed names still work, with a DeprecationWarning, for one release."""

from __future__ import annotations

import warnings

import pytest

from pdcluster.kvstore.config import KVStoreConfig, KVTLSConfig, KVTransferConfig, kv_plane_of
from pdcluster.kvstore.transport.registry import create_backend
from pdcluster.kvstore.transport.pool.grpc_backend import GrpcTransferBackend
from pdcluster.kvstore.transport.torch_pair.backend import TorchTransferBackend

TLS = KVTLSConfig(cert_file="c.pem", key_file="k.pem")


def test_new_store_names_set_their_fields_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = KVStoreConfig(tail_capacity_bytes=4096, rpc_timeout_s=3.5)
    assert (config.tail_capacity_bytes, config.rpc_timeout_s) == (4096, 3.5)
    assert "capacity_bytes" not in KVStoreConfig.model_fields
    assert "transfer_timeout_s" not in KVStoreConfig.model_fields


@pytest.mark.parametrize("old, new, value", [("capacity_bytes", "tail_capacity_bytes", 4096),
                                             ("transfer_timeout_s", "rpc_timeout_s", 3.5)])
def test_old_store_names_still_set_and_read_the_renamed_fields(old, new, value):
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated, use {new}"):
        config = KVStoreConfig(**{old: value})
    assert getattr(config, new) == value
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated, use {new}"):
        assert getattr(config, old) == value
    with pytest.warns(DeprecationWarning):  # YAML and CLI go through model_validate
        assert getattr(KVStoreConfig.model_validate({old: value}), new) == value


def test_an_old_store_name_given_with_its_new_one_is_ignored():
    with pytest.warns(DeprecationWarning, match="transfer_timeout_s is deprecated and ignored"):
        config = KVStoreConfig(transfer_timeout_s=1.0, rpc_timeout_s=2.0, token="secret")
    assert config.rpc_timeout_s == 2.0


def test_transfer_config_holds_no_kv_plane_settings():
    config = KVTransferConfig()
    assert config.model_dump().keys() == {"backend", "timeout_s", "max_chunk_bytes",
                                          "num_streams", "min_stream_bytes", "bind_host",
                                          "mooncake_protocol", "source_buffer_bytes",
                                          "receive_buffer_bytes",
                                          "streaming", "load_failure_policy",
                                          "decode_publish", "decode_publish_interval",
                                          "incremental_transfer"}
    assert kv_plane_of(config) == KVStoreConfig()  # no token, no TLS


@pytest.mark.parametrize("name, value", [("token", "old-token"), ("tls", TLS),
                                         ("max_message_bytes", 1 << 20)])
def test_transfer_configs_kv_plane_copies_warn_and_only_feed_a_backend_without_kv_config(
        name, value):
    with pytest.warns(DeprecationWarning, match=f"KVTransferConfig.{name} is deprecated"):
        config = KVTransferConfig(**{name: value})
    assert name not in config.model_dump() and "old-token" not in repr(config)
    with pytest.warns(DeprecationWarning):
        getattr(config, name)
    plane = kv_plane_of(config)
    got = getattr(plane, name)
    assert (got.get_secret_value() if name == "token" else got) == value
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert GrpcTransferBackend(config).kv_config == plane
        assert GrpcTransferBackend(config, KVStoreConfig()).kv_config == KVStoreConfig()


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
