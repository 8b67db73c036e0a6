"""KV transfer backends (kvstore.transport): run grouping, wire codec, grpc and fake receivers."""

import threading
import time

import pytest
import torch

from pdcluster.kvstore.client import KVStoreClient
from pdcluster.kvstore.config import KVStoreConfig, KVTransferConfig
from pdcluster.kvstore.errors import (BlockLayoutError, BlockNotFoundError, KVAuthError,
                                      KVTransferError)
from pdcluster.engine.core.hashing import block_keys, make_namespace
from pdcluster.kvstore.proto import kvstore_pb2 as pb
from pdcluster.kvstore.transport.base import FetchRequest, TransferState
from pdcluster.kvstore.transport.dest import CallbackDest
from pdcluster.kvstore.transport.registry import TRANSPORTS, create_backend
from pdcluster.kvstore.transport.wire import decode_block_data, encode_block_data
from pdcluster.kvstore.transport.pool.grpc_backend import GrpcTransferBackend
from pdcluster.kvstore.transport.torch_pair.backend import TorchTransferBackend
from tests.kvstore.fake_transfer import FakeTransferBackend
from tests.kvstore.lru_block_store import LRUBlockStore
from tests.kvstore.tensor_dest import BlockRun, TensorDest, coalesce_runs, wait

BLOCK_SHAPE = (2, 2, 16, 2, 8)  # [layers, k/v, block_size, kv_heads, head_dim]: 4 KiB float32
BLOCK_NBYTES = 4096
TOKEN = "transfer-test-token"


def keys_for(n: int, seed: int = 0) -> list[bytes]:
    return block_keys([seed * 100003 + i for i in range(n * 16)], 16, make_namespace("xfer"))


def random_blocks(n: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn((n, *BLOCK_SHAPE), generator=torch.Generator().manual_seed(seed)).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


# ---- run grouping and wire codec ------------------------------------------------------------

def test_coalesce_runs_groups_consecutive_destination_blocks():
    assert coalesce_runs([7, 8, 9, 3, 4, 12], 10, 1000) == [
        BlockRun(0, 7, 3), BlockRun(3, 3, 2), BlockRun(5, 12, 1)]
    # each group is further split by the byte budget (kvstore.transport.runs.budget_runs)
    assert coalesce_runs([0, 1, 2, 3, 4], 10, 20) == [
        BlockRun(0, 0, 2), BlockRun(2, 2, 2), BlockRun(4, 4, 1)]
    assert coalesce_runs([5, 5, 4], 10, 1000) == [  # repeats and backwards steps break runs
        BlockRun(0, 5, 1), BlockRun(1, 5, 1), BlockRun(2, 4, 1)]
    assert coalesce_runs([], 10, 1000) == []
    assert coalesce_runs([3], 100, 10) == [BlockRun(0, 3, 1)]  # oversized block: its own run
    ids = [9, 10, 11, 0, 1, 2, 3, 40]
    runs = coalesce_runs(ids, 1, 3)
    assert [i for r in runs for i in range(r.src, r.src + r.count)] == list(range(len(ids)))
    assert all(ids[r.src + j] == r.dest + j for r in runs for j in range(r.count))


def test_wire_codec_is_protobuf_both_ways():
    keys = keys_for(3)
    layout = pb.BlockLayout(dtype="bfloat16", shape=[2, 3])
    raw = encode_block_data([b"a" * 12, memoryview(b"b" * 12), bytearray(b"c" * 12)],
                            keys=keys, layout=layout)
    msg = pb.BlockData.FromString(raw)
    assert list(msg.keys) == keys and msg.layout == layout
    assert msg.payload == b"a" * 12 + b"b" * 12 + b"c" * 12
    view = decode_block_data(raw)
    assert bytes(view.payload) == msg.payload and list(view.keys) == keys
    assert isinstance(view.payload, memoryview)  # zero-copy
    other = pb.BlockData(handle="h", num_tokens=5, payload=b"xyz", layout=layout)
    view = decode_block_data(other.SerializeToString())
    assert (view.handle, view.num_tokens, bytes(view.payload)) == ("h", 5, b"xyz")
    with pytest.raises(BlockLayoutError):
        decode_block_data(raw[:-5])


def test_registry_maps_names_to_backends():
    assert set(TRANSPORTS) == {"grpc", "torch", "mooncake"}
    backend = create_backend(KVTransferConfig(backend="torch"))
    assert isinstance(backend, TorchTransferBackend)
    backend.close()


# ---- grpc backend ---------------------------------------------------------------------------

@pytest.fixture
def make_server(make_server):
    """conftest's make_server, with the cluster's token by default."""
    def make(store: LRUBlockStore | None = None, token: str | None = TOKEN):
        return make_server(KVStoreConfig(token=token), store)
    return make


@pytest.fixture
def make_backend():
    backends = []

    def make(token: str = TOKEN, **overrides):
        backend = GrpcTransferBackend(KVTransferConfig(**overrides), KVStoreConfig(token=token))
        backends.append(backend)
        return backend

    yield make
    for backend in backends:
        backend.close()


def publish(server, n: int, dtype=torch.float32, tail_tokens: int | None = None, seed: int = 0):
    blocks, keys = random_blocks(n + 1, dtype, seed), keys_for(n, seed)
    with KVStoreClient(server.address, token=TOKEN) as client:
        client.put_blocks(keys, blocks[:n])
        if tail_tokens is not None:
            client.put_tail(f"tail-{seed}", blocks[n], tail_tokens)
    return keys, blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grpc_streams_coalesced_runs_into_scattered_blocks(make_server, make_backend, dtype):
    server = make_server()
    n = 40
    keys, blocks = publish(server, n, dtype, tail_tokens=7)
    # 3 streams over 40 blocks, 5 blocks (or fewer) per message
    backend = make_backend(num_streams=3, min_stream_bytes=1, max_chunk_bytes=5 * BLOCK_NBYTES)
    pool = torch.zeros((64, *BLOCK_SHAPE), dtype=dtype)
    block_ids = [*range(10, 30), 3, 4, 5, *range(40, 56), 0, 60]  # 40 full + the tail
    receiver = backend.create_receiver()
    receiver.start(FetchRequest(server.address, keys, "tail-0", 7, deadline_s=10.0),
                   TensorDest(pool, block_ids))
    assert wait(receiver, 10.0) is TransferState.SUCCESS
    assert receiver.result() == (n + 1) * blocks[0].numel() * blocks.element_size()
    expected = torch.zeros_like(pool)
    expected[block_ids] = blocks
    assert torch.equal(bits(pool), bits(expected))
    assert server.store.stats()["num_tails"] == 0  # taken


def test_grpc_callback_destination_and_tensor_view(make_server, make_backend):
    server = make_server()
    keys, blocks = publish(server, 6)
    backend = make_backend(max_chunk_bytes=2 * BLOCK_NBYTES)
    got = {}

    def write(start, chunk):
        assert chunk.shape[1:] == BLOCK_SHAPE and chunk.dtype == torch.float32
        for i in range(chunk.shape[0]):
            got[start + i] = chunk[i].clone()

    receiver = backend.create_receiver()
    receiver.start(FetchRequest(server.address, keys),
                   CallbackDest(write, 6, BLOCK_SHAPE, torch.float32))
    assert wait(receiver, 10.0) is TransferState.SUCCESS
    assert torch.equal(torch.stack([got[i] for i in range(6)]), blocks[:6])

    staging = torch.empty((6, *BLOCK_SHAPE))
    receiver = backend.create_receiver()
    receiver.start(FetchRequest(server.address, keys[2:]), TensorDest(staging[:4]))
    assert wait(receiver, 10.0) is TransferState.SUCCESS
    assert torch.equal(staging[:4], blocks[2:6])


class SlowStore(LRUBlockStore):
    """Fault injection: lookups stall for ``delay_s``."""

    delay_s = 1.5

    def get_many(self, keys):
        time.sleep(self.delay_s)
        return super().get_many(keys)


class GatedStore(LRUBlockStore):
    """Fault injection: lookups stall until the test opens ``gate`` (30 s at most)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.gate, self.stalled, self.answered = (threading.Event() for _ in range(3))

    def get_many(self, keys):
        self.stalled.set()
        self.gate.wait(30.0)
        try:
            return super().get_many(keys)
        finally:
            self.answered.set()


def test_grpc_deadline_fails_with_transfer_error(make_server, make_backend):
    store = GatedStore(1 << 20, 60.0)
    server = make_server(store=store)
    keys, _ = publish(server, 2)
    receiver = make_backend().create_receiver()
    try:
        receiver.start(FetchRequest(server.address, keys, deadline_s=1.0),
                       TensorDest(torch.zeros(2, 4)))
        # start never blocks: it returned before the transfer's outcome, the 1 s deadline
        assert not receiver.poll().done
        assert wait(receiver, 10.0) is TransferState.FAILED
        # the deadline failed it while the store was still stalled, not its late answer
        assert store.stalled.is_set() and not store.answered.is_set()
    finally:
        store.gate.set()
    with pytest.raises(KVTransferError, match="deadline") as info:
        receiver.result()
    assert info.value.address == server.address


def test_grpc_failures_are_typed(make_server, make_backend):
    server = make_server()
    keys, _ = publish(server, 3, tail_tokens=4)
    backend = make_backend()
    cases = [
        (FetchRequest(server.address, (*keys, keys_for(1, seed=9)[0])), 4, BlockNotFoundError),
        (FetchRequest(server.address, keys, "tail-0", 5), 4, BlockLayoutError),  # token count
        (FetchRequest(server.address, keys, "no-such-tail", 1), 4, BlockNotFoundError),
    ]
    for request, n, error in cases:
        receiver = backend.create_receiver()
        receiver.start(request, TensorDest(torch.zeros((n, *BLOCK_SHAPE))))
        assert wait(receiver, 10.0) is TransferState.FAILED
        with pytest.raises(error):
            receiver.result()
    receiver = backend.create_receiver()
    wrong_layout = TensorDest(torch.zeros((3, 2, 2)))
    receiver.start(FetchRequest(server.address, keys), wrong_layout)
    assert wait(receiver, 10.0) is TransferState.FAILED
    with pytest.raises(BlockLayoutError):
        receiver.result()
    with pytest.raises(BlockLayoutError):  # block count mismatch is refused at start
        backend.create_receiver().start(FetchRequest(server.address, keys),
                                        TensorDest(torch.zeros(2, 4)))
    bad_auth = make_backend(token="wrong").create_receiver()
    bad_auth.start(FetchRequest(server.address, keys), TensorDest(torch.zeros((3, *BLOCK_SHAPE))))
    assert wait(bad_auth, 10.0) is TransferState.FAILED
    with pytest.raises(KVAuthError):
        bad_auth.result()


def test_grpc_abort_stops_writes(make_server, make_backend):
    server = make_server(SlowStore(1 << 20, 60.0))
    keys, _ = publish(server, 2)
    dest = torch.zeros((2, *BLOCK_SHAPE))
    receiver = make_backend().create_receiver()
    receiver.start(FetchRequest(server.address, keys, deadline_s=10.0), TensorDest(dest))
    time.sleep(0.1)
    assert receiver.poll() is TransferState.TRANSFERRING
    receiver.abort()
    receiver.abort()  # idempotent
    assert receiver.poll() is TransferState.FAILED
    with pytest.raises(KVTransferError, match="aborted"):
        receiver.result()
    time.sleep(SlowStore.delay_s + 0.3)  # the server answers late: nothing may land
    assert not dest.any()


# ---- fake backend ---------------------------------------------------------------------------

def fake_source(n: int):
    blocks = random_blocks(n + 1)
    keys = keys_for(n)
    return keys, blocks, dict(zip(keys, blocks[:n])), {"t": (blocks[n], 3)}


def test_fake_fails_once_then_succeeds_on_retry():
    keys, blocks, source, tails = fake_source(4)
    backend = FakeTransferBackend(blocks=source, tails=tails, fail_on_calls={1})
    request = FetchRequest("fake:0", keys, "t", 3)
    dest = torch.zeros((5, *BLOCK_SHAPE))
    first = backend.create_receiver()
    first.start(request, TensorDest(dest))
    assert first.poll() is TransferState.FAILED
    with pytest.raises(KVTransferError, match="injected"):
        first.result()
    assert not dest.any()
    retry = backend.create_receiver()
    retry.start(request, TensorDest(dest))
    assert retry.poll() is TransferState.SUCCESS
    assert retry.result() == 5 * BLOCK_NBYTES and torch.equal(dest, blocks)
    assert "t" not in tails  # taken only on success


def test_fake_fails_after_bytes_and_with_delay_past_deadline():
    keys, blocks, source, tails = fake_source(4)
    partial = FakeTransferBackend(blocks=source, tails=tails, fail_after_bytes=2 * BLOCK_NBYTES)
    dest = torch.zeros((4, *BLOCK_SHAPE))
    receiver = partial.create_receiver()
    receiver.start(FetchRequest("fake:0", keys), TensorDest(dest))
    assert receiver.poll() is TransferState.FAILED
    with pytest.raises(KVTransferError, match="after 8192 bytes"):
        receiver.result()
    assert torch.equal(dest[:2], blocks[:2]) and not dest[2:].any()  # caller frees all 4

    slow = FakeTransferBackend(blocks=source, delay_s=0.2)
    receiver = slow.create_receiver()
    receiver.start(FetchRequest("fake:0", keys[:1]), TensorDest(torch.zeros((1, *BLOCK_SHAPE))))
    assert receiver.poll() is TransferState.TRANSFERRING
    assert wait(receiver, 2.0, interval_s=0.01) is TransferState.SUCCESS
    receiver = slow.create_receiver()
    receiver.start(FetchRequest("fake:0", keys[:1], deadline_s=0.05),
                   TensorDest(torch.zeros((1, *BLOCK_SHAPE))))
    assert wait(receiver, 2.0, interval_s=0.01) is TransferState.FAILED
    with pytest.raises(KVTransferError, match="deadline"):
        receiver.result()


def test_result_before_done_and_double_start_are_caller_errors():
    keys, _, source, _ = fake_source(1)
    receiver = FakeTransferBackend(blocks=source, delay_s=5.0).create_receiver()
    assert receiver.poll() is TransferState.WAITING_FOR_INPUT
    dest = TensorDest(torch.zeros((1, *BLOCK_SHAPE)))
    receiver.start(FetchRequest("fake:0", keys), dest)
    with pytest.raises(RuntimeError, match="not finished"):
        receiver.result()
    with pytest.raises(RuntimeError, match="already started"):
        receiver.start(FetchRequest("fake:0", keys), dest)
    receiver.abort()
    assert receiver.poll() is TransferState.FAILED


def test_abort_waits_for_a_write_in_progress():
    keys, blocks, source, _ = fake_source(1)
    entered, release = threading.Event(), threading.Event()

    def slow_write(start, chunk):
        entered.set()
        release.wait(5.0)

    receiver = FakeTransferBackend(blocks=source).create_receiver()
    receiver.start(FetchRequest("fake:0", keys), CallbackDest(slow_write, 1, BLOCK_SHAPE,
                                                              torch.float32))
    poller = threading.Thread(target=receiver.poll)
    poller.start()
    assert entered.wait(5.0)
    aborted = threading.Event()
    aborter = threading.Thread(target=lambda: (receiver.abort(), aborted.set()))
    aborter.start()
    assert not aborted.wait(0.2)  # abort returns only once the write has finished
    release.set()
    assert aborted.wait(5.0)
    poller.join(5.0)
    aborter.join(5.0)
    assert receiver.poll() in (TransferState.SUCCESS, TransferState.FAILED)
