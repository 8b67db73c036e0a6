"""KV store gRPC data plane: real servers on port 0, real clients."""

import socket
import threading
import time

import grpc
import pytest
import torch

from pdcluster.kvstore.client import KVStoreClient
from pdcluster.kvstore.config import KVStoreConfig
from pdcluster.kvstore.errors import (BlockLayoutError, BlockNotFoundError, KVTransferError,
                                      KVTransferTimeout, StoreCapacityError)
from pdcluster.engine.core.hashing import block_keys, make_namespace
from pdcluster.kvstore.proto import kvstore_pb2 as pb
from pdcluster.kvstore.proto import kvstore_pb2_grpc as pb_grpc
from pdcluster.kvstore.transport.runs import budget_runs
from tests.kvstore.lru_block_store import LRUBlockStore

BLOCK_SHAPE = (2, 2, 16, 2, 8)  # [layers, k/v, block_size, kv_heads, head_dim]
NS = make_namespace("test-model")


def keys_for(n: int, seed: int = 0) -> list[bytes]:
    return block_keys([seed * 100003 + i for i in range(n * 16)], 16, NS)


def random_blocks(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *BLOCK_SHAPE), generator=g).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


@pytest.fixture
def server(make_server):
    return make_server()


@pytest.fixture
def client(server):
    with KVStoreClient(server.address, timeout_s=5.0) as c:
        yield c


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_bit_exact(client, dtype):
    blocks = random_blocks(3, dtype)
    flat = blocks.view(-1)
    flat[:4] = torch.tensor([float("nan"), float("inf"), -0.0, -float("inf")]).to(dtype)
    keys = keys_for(3)
    client.put_blocks(keys, blocks)
    got = client.get_blocks(keys)
    assert got.dtype == dtype and got.shape == blocks.shape
    assert torch.equal(bits(got), bits(blocks))
    sub = client.get_blocks([keys[2], keys[0], keys[2]])  # any order, duplicates
    assert torch.equal(bits(sub), bits(blocks[[2, 0, 2]]))


def test_non_contiguous_input(client):
    blocks = random_blocks(4, torch.float32)[::2]
    client.put_blocks(keys_for(2), blocks)
    assert torch.equal(client.get_blocks(keys_for(2)), blocks)


def test_many_blocks_streamed_in_coalesced_runs(make_server):
    config = KVStoreConfig(max_message_bytes=1 << 20)
    server = make_server(config)
    n = 200
    blocks = random_blocks(n, torch.bfloat16, seed=3)  # 2 KiB per block
    keys = keys_for(n, seed=3)
    with KVStoreClient(server.address, max_message_bytes=1 << 20) as client:
        client.put_blocks(keys, blocks)
        assert torch.equal(bits(client.get_blocks(keys)), bits(blocks))
        assert client.stats()["num_blocks"] == n
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        msgs = list(stub.GetBlocks(pb.GetBlocksRequest(keys=keys, max_chunk_bytes=64 << 10),
                                   timeout=5))
    assert len(msgs) == -(-n * 2048 // (64 << 10))  # 32 blocks per message, rounded up
    assert [k for m in msgs for k in m.keys] == keys


def test_budget_runs():
    assert budget_runs(10, 7, 30) == [range(0, 3), range(3, 6), range(6, 7)]
    assert budget_runs(100, 2, 30) == [range(0, 1), range(1, 2)]
    assert budget_runs(10, 0, 30) == []


def test_missing_key_is_block_not_found_listing_it(client):
    keys = keys_for(3)
    client.put_blocks(keys[:2], random_blocks(2, torch.float32))
    with pytest.raises(BlockNotFoundError) as info:
        client.get_blocks(keys)
    assert info.value.missing == [keys[2]]
    assert keys[2].hex() in str(info.value)


def test_unreachable_server_is_transfer_error_quickly():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    address = f"127.0.0.1:{port}"
    with KVStoreClient(address, timeout_s=5.0) as client:
        with pytest.raises(KVTransferError) as info:
            client.get_blocks(keys_for(1))
    # quickly: failed on the refused connection, not at the 5 s deadline (KVTransferTimeout)
    assert not isinstance(info.value, KVTransferTimeout), info.value
    assert address in str(info.value) and info.value.address == address


class SlowStore(LRUBlockStore):
    """Fault injection for the deadline test only: lookups stall until the test opens ``gate``
    (30 s at most)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.gate, self.answered = threading.Event(), threading.Event()

    def get_many(self, keys):
        self.gate.wait(30.0)
        self.answered.set()
        return super().get_many(keys)


def test_deadline_is_transfer_error(make_server):
    store = SlowStore(1 << 20, 60.0)
    server = make_server(store=store)
    try:
        with KVStoreClient(server.address, timeout_s=0.3) as client:
            with pytest.raises(KVTransferError, match="deadline"):
                client.get_blocks(keys_for(1))
        assert not store.answered.is_set()  # the 0.3 s deadline ended it, not the store's answer
    finally:
        store.gate.set()


def test_tail_put_take_release(client):
    block = random_blocks(1, torch.bfloat16)[0]
    client.put_tail("req-1", block, num_tokens=5)
    assert client.stats()["num_tails"] == 1
    got, num_tokens = client.take_tail("req-1")
    assert num_tokens == 5 and torch.equal(bits(got), bits(block))
    with pytest.raises(BlockNotFoundError) as info:
        client.take_tail("req-1")
    assert info.value.handle == "req-1"
    client.put_tail("req-2", block, num_tokens=1)
    assert client.release_tail("req-2") is True
    assert client.release_tail("req-2") is False
    assert client.release_tail("never-existed") is False
    stats = client.stats()
    assert stats["num_tails"] == 0 and stats["bytes_used"] == 0


def test_tail_expires_by_sweep(make_server):
    server = make_server(KVStoreConfig(tail_ttl_s=0.2))
    with KVStoreClient(server.address) as client:
        client.put_tail("req", random_blocks(1, torch.float32)[0], num_tokens=2)
        time.sleep(0.6)
        assert server.store.stats()["expired_tails"] == 1  # swept, nobody touched it
        with pytest.raises(BlockNotFoundError):
            client.take_tail("req")


def test_typed_errors_for_bad_input(make_server):
    server = make_server(KVStoreConfig(tail_capacity_bytes=1000))
    with KVStoreClient(server.address) as client:
        with pytest.raises(StoreCapacityError):
            client.put_blocks(keys_for(1), random_blocks(1, torch.float32))
        with pytest.raises(BlockLayoutError):
            client.put_blocks(keys_for(2), torch.zeros(3, 4))
        with pytest.raises(BlockLayoutError):
            client.put_blocks(keys_for(1), torch.zeros(1, 4, dtype=torch.int64))
        with pytest.raises(ValueError):
            client.put_blocks([b"short"], torch.zeros(1, 4))
        client.put_blocks(keys_for(2), torch.zeros(2, 4))  # 16 B blocks fit
        client.put_blocks(keys_for(1, seed=1), torch.zeros(1, 4, dtype=torch.float16))
        with pytest.raises(BlockLayoutError):  # stored layouts differ
            client.get_blocks(keys_for(2) + keys_for(1, seed=1))


def test_binds_loopback_by_default(server):
    assert KVStoreConfig().host == "127.0.0.1"
    assert server.address == f"127.0.0.1:{server.port}"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            other_ip = s.getsockname()[0]
        except OSError:
            other_ip = None
    if other_ip is None or other_ip.startswith("127."):
        pytest.skip("no non-loopback IPv4 address on this machine")
    with pytest.raises(OSError):
        socket.create_connection((other_ip, server.port), timeout=2).close()


def test_closed_client_raises_transfer_error(server):
    client = KVStoreClient(server.address)
    client.close()
    with pytest.raises(KVTransferError):
        client.stats()
