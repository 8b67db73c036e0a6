"""KV store gRPC auth: a shared token in the call metadata, checked in constant time."""

import logging

import grpc
import pytest
import torch

from pdcluster.kvstore.client import KVStoreClient
from pdcluster.kvstore.config import KVStoreConfig
from pdcluster.kvstore.errors import KVAuthError
from pdcluster.engine.core.hashing import block_keys, make_namespace
from pdcluster.kvstore.proto import kvstore_pb2 as pb
from pdcluster.kvstore.proto import kvstore_pb2_grpc as pb_grpc
from tests.kvstore.lru_block_store import lru_server
from tests.markers import starts

TOKEN = "s3cret-kv-token-for-tests"
KEYS = block_keys(list(range(32)), 16, make_namespace("auth-test"))


@pytest.fixture
@starts("server")
def server():
    server = lru_server(KVStoreConfig(token=TOKEN))
    server.start()
    yield server
    server.stop(grace=0)


@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN[:-1], ""])
def test_refused_without_the_right_token(server, token):
    with KVStoreClient(server.address, timeout_s=5.0, token=token) as client:
        for call in (client.stats,
                     lambda: client.get_blocks(KEYS[:1]),
                     lambda: client.put_blocks(KEYS[:1], torch.zeros(1, 4)),
                     lambda: client.take_tail("h"),
                     lambda: client.release_tail("h"),
                     lambda: client.exists(KEYS[:1]),
                     lambda: client.remove(KEYS[:1]),
                     lambda: client.pin(KEYS[:1])):
            with pytest.raises(KVAuthError) as info:
                call()
            assert info.value.address == server.address
    assert server.store.stats()["num_blocks"] == 0


def test_accepted_with_the_right_token(server):
    blocks = torch.randn(2, 2, 16, 4)
    with KVStoreClient(server.address, timeout_s=5.0, token=TOKEN) as client:
        client.put_blocks(KEYS, blocks)
        assert torch.equal(client.get_blocks(KEYS), blocks)
        client.put_tail("h", blocks[0], 3)
        assert client.take_tail("h")[1] == 3
        assert client.stats()["num_blocks"] == 2
        assert client.pin(KEYS[:1]) == [True] and client.exists(KEYS) == [True, True]
        assert client.remove(KEYS) == 1  # the pinned block stays


def test_token_header_alternative(server):
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        stub.Stats(pb.StatsRequest(), timeout=5, metadata=(("x-pdcluster-token", TOKEN),))
        with pytest.raises(grpc.RpcError) as info:
            stub.Stats(pb.StatsRequest(), timeout=5,
                       metadata=(("authorization", f"Basic {TOKEN}"),))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.server
def test_no_token_configured_means_no_auth():
    server = lru_server(KVStoreConfig())
    server.start()
    try:
        with KVStoreClient(server.address, token="anything") as client:
            assert client.stats()["num_blocks"] == 0
    finally:
        server.stop(grace=0)


def test_token_never_shown(server, caplog):
    config = KVStoreConfig(token=TOKEN)
    assert TOKEN not in repr(config) and TOKEN not in str(config)
    assert TOKEN not in config.model_dump_json()
    with caplog.at_level(logging.DEBUG):
        with KVStoreClient(server.address, token="wrong") as client:
            assert TOKEN not in repr(client)
            with pytest.raises(KVAuthError) as info:
                client.stats()
        logged = lru_server(KVStoreConfig(token=TOKEN))
        logged.start()
        logged.stop(grace=0)
    assert "wrong" not in str(info.value) and TOKEN not in str(info.value)
    assert TOKEN not in caplog.text
