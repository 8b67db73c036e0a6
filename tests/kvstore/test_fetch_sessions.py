"""FetchBlocks sessions (kvstore.fetch_session): reuse, in-band errors, cancel, deadline,
idle expiry freeing server threads; and the one-shot GetBlocks RPC beside them. Real gRPC
servers on port 0, real clients."""

import threading
import time

import grpc
import pytest
import torch

from pdcluster.kvstore.client import KVStoreClient
from pdcluster.kvstore.errors import BlockNotFoundError, KVTransferError
from pdcluster.engine.core.hashing import block_keys, make_namespace
from pdcluster.kvstore.proto import kvstore_pb2 as pb
from pdcluster.kvstore.proto import kvstore_pb2_grpc as pb_grpc
from pdcluster.kvstore.transport.wire import decode_block_data
from tests.kvstore.lru_block_store import LRUBlockStore

BLOCK_SHAPE = (2, 2, 16, 2, 8)
NS = make_namespace("session-test")


def keys_for(n: int, seed: int = 0) -> list[bytes]:
    return block_keys([seed * 100003 + i for i in range(n * 16)], 16, NS)


def blocks(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn((n, *BLOCK_SHAPE), generator=torch.Generator().manual_seed(seed))


def test_one_session_serves_many_fetches_and_survives_not_found(make_server):
    server = make_server()
    keys, data = keys_for(6), blocks(6)
    with KVStoreClient(server.address, timeout_s=5.0) as client:
        client.put_blocks(keys, data)
        for i in range(20):
            assert torch.equal(client.get_blocks(keys[i % 6:]), data[i % 6:])
        with pytest.raises(BlockNotFoundError) as info:
            client.get_blocks([*keys[:2], keys_for(1, seed=9)[0]])
        assert info.value.missing == [keys_for(1, seed=9)[0]]
        assert torch.equal(client.get_blocks(keys), data)  # the same session, still in step
        assert client.sessions.opened == 1 and len(client.sessions._idle) == 1


def test_concurrent_fetches_use_separate_sessions(make_server):
    server = make_server()
    keys, data = keys_for(8), blocks(8)
    errors: list[BaseException] = []
    with KVStoreClient(server.address, timeout_s=5.0, max_idle_sessions=2) as client:
        client.put_blocks(keys, data)

        def fetch(lo: int) -> None:
            try:
                for _ in range(25):
                    assert torch.equal(client.get_blocks(keys[lo:]), data[lo:])
            except BaseException as exc:  # noqa: BLE001 -- reported below
                errors.append(exc)
        threads = [threading.Thread(target=fetch, args=(lo,)) for lo in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert 1 <= client.sessions.opened <= 4 * 25
        assert len(client.sessions._idle) <= 2


def test_abandoned_or_cancelled_fetch_closes_its_session(make_server):
    server = make_server()
    keys, data = keys_for(8), blocks(8)
    block_nbytes = data[0].numel() * 4
    with KVStoreClient(server.address, timeout_s=5.0) as client:
        client.put_blocks(keys, data)
        stream = client.stream_blocks(keys, max_chunk_bytes=2 * block_nbytes)
        chunks = iter(stream)
        first = next(chunks)  # 2 of 8 blocks read, the rest of the reply still in flight
        assert first.count == 2
        stream.cancel()
        with pytest.raises(KVTransferError, match="cancelled"):
            list(chunks)
        assert len(client.sessions._idle) == 0  # never handed out with a reply half read
        stream = client.stream_blocks(keys, max_chunk_bytes=2 * block_nbytes)
        next(iter(stream))  # abandoned mid-reply: the dropped generator's finally closes it
        assert torch.equal(client.get_blocks(keys), data)
        assert client.sessions.opened == 3


class SlowOnceStore(LRUBlockStore):
    """Fault injection: the first lookup stalls (a slow node) until the test opens ``gate``
    (30 s at most), later ones do not."""

    def __init__(self, *args):
        super().__init__(*args)
        self.stalled, self.gate, self.answered = (threading.Event() for _ in range(3))

    def get_many(self, keys):
        if not self.stalled.is_set():
            self.stalled.set()
            self.gate.wait(30.0)
            self.answered.set()
        return super().get_many(keys)


def test_deadline_closes_the_session_and_the_next_fetch_opens_a_new_one(make_server):
    store = SlowOnceStore(1 << 22, 60.0)
    server = make_server(store=store)
    keys, data = keys_for(2), blocks(2)
    with KVStoreClient(server.address, timeout_s=0.3) as client:
        client.put_blocks(keys, data)
        try:
            with pytest.raises(KVTransferError, match="deadline"):
                client.get_blocks(keys)
            # the client's deadline ended it while the lookup still stalled on the server
            assert store.stalled.is_set() and not store.answered.is_set()
        finally:
            store.gate.set()
        assert store.answered.wait(10.0)  # the stalled lookup ends on the server
        assert torch.equal(client.get_blocks(keys), data)
        assert client.sessions.opened == 2


def test_idle_sessions_expire_and_free_the_servers_threads(make_server):
    """A server with 3 handler threads and 5 clients, each leaving a session open: the 4th and
    5th clients' fetches wait for idle sessions to expire (0.5 s) instead of hanging."""
    server = make_server(max_workers=3)
    keys, data = keys_for(1), blocks(1)
    with KVStoreClient(server.address) as writer:
        writer.put_blocks(keys, data)
    clients = [KVStoreClient(server.address, timeout_s=10.0, session_idle_s=0.5)
               for _ in range(5)]
    try:
        for client in clients:  # a fetch with no free handler thread would fail at its 10 s
            assert torch.equal(client.get_blocks(keys), data)
        # the 4th and 5th were served on threads freed by expiry: of the four sessions open
        # before the 5th fetch, at least two were swept (the server holds 3 streams at most)
        assert sum(not c.sessions._idle for c in clients[:4]) >= 2
        deadline = time.monotonic() + 10.0  # the sweep runs every 0.25 s
        while any(c.sessions._idle for c in clients) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(len(c.sessions._idle) == 0 for c in clients)  # swept
    finally:
        for client in clients:
            client.close()


def test_get_blocks_rpc_still_answers_one_shot_clients(make_server):
    """GetBlocks (unary request, streamed reply) for clients without sessions: the reply ends
    with `last`, a missing key is NOT_FOUND before any data."""
    server = make_server()
    keys, data = keys_for(3), blocks(3)
    with KVStoreClient(server.address) as client:
        client.put_blocks(keys, data)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        replies = list(stub.GetBlocks(pb.GetBlocksRequest(keys=keys), timeout=5.0))
        assert [r.last for r in replies] == [False] * (len(replies) - 1) + [True]
        payload = b"".join(r.payload for r in replies)
        assert payload == data.numpy().tobytes()
        view = decode_block_data(replies[-1].SerializeToString())
        assert view.last and view.error is None
        with pytest.raises(grpc.RpcError) as info:
            list(stub.GetBlocks(pb.GetBlocksRequest(keys=keys_for(1, seed=5)), timeout=5.0))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
