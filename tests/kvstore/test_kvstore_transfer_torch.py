"""torch.distributed pair channels (kvstore.transport.torch_pair.backend): gloo between two real
processes on 127.0.0.1, never the default group; timeouts end in typed errors."""

import multiprocessing as mp
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from pdcluster.kvstore.config import KVStoreConfig, KVTransferConfig
from pdcluster.kvstore.errors import KVAuthError, KVTransferError
from pdcluster.kvstore.transport.base import FetchRequest, TransferState
from pdcluster.kvstore.transport.torch_pair.backend import TorchKVSender, TorchTransferBackend
from pdcluster.kvstore.transport.torch_pair.channel import TorchPairChannel
from tests.kvstore.tensor_dest import TensorDest, wait

TOKEN = "pair-test-token"
MIB4 = 1 << 20  # float32 elements in 4 MiB
BLOCK_SHAPE = (2, 2, 16, 2, 8)
TIMEOUT_S = 60.0  # generous: the peer process imports torch first


def _tensor(seed: int, n: int = MIB4) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _peer(address: str, blocks_address_queue, results) -> None:
    """The other process: rank 1 of a raw pair channel, then the sender of a second pair."""
    try:
        host, port = address.rsplit(":", 1)
        channel = TorchPairChannel(1, host, int(port), timeout_s=TIMEOUT_S, token=TOKEN)
        channel.connect()
        got = torch.empty(MIB4)
        channel.wait(channel.recv(got, 5), TIMEOUT_S)
        channel.wait(channel.send(_tensor(2), 6), TIMEOUT_S)
        results.put(("recv_exact", torch.equal(got, _tensor(1))))
        channel.close()

        sender_channel = TorchPairChannel(0, "127.0.0.1", 0, timeout_s=TIMEOUT_S, token=TOKEN,
                                          chunk_bytes=3 * 4096)  # 3 blocks per chunk
        blocks_address_queue.put(sender_channel.address)
        blocks = torch.randn((10, *BLOCK_SHAPE), generator=torch.Generator().manual_seed(3))
        sender = TorchKVSender(sender_channel)
        sender.start(blocks, 11, TIMEOUT_S)
        results.put(("sender", wait(sender, TIMEOUT_S).name, sender.result()))
        sender_channel.close()
    except Exception as exc:  # reported to the test, which fails with it
        results.put(("error", repr(exc)))


def test_pair_channel_between_two_processes_both_ways_and_kv_transfer():
    default_group_before = dist.is_initialized()
    channel = TorchPairChannel(0, "127.0.0.1", 0, timeout_s=TIMEOUT_S, token=TOKEN)
    ctx = mp.get_context("spawn")
    queue, results = ctx.Queue(), ctx.Queue()
    peer = ctx.Process(target=_peer, args=(channel.address, queue, results), daemon=True)
    peer.start()
    try:
        channel.connect()
        channel.wait(channel.send(_tensor(1), 5), TIMEOUT_S)
        back = torch.empty(MIB4)
        channel.wait(channel.recv(back, 6), TIMEOUT_S)
        assert torch.equal(back, _tensor(2))  # 4 MiB, byte-exact, peer -> us
        assert results.get(timeout=TIMEOUT_S) == ("recv_exact", True)  # us -> peer
        channel.close()

        backend = TorchTransferBackend(KVTransferConfig(backend="torch"),
                                       KVStoreConfig(token=TOKEN))
        pool = torch.zeros((16, *BLOCK_SHAPE))
        block_ids = [5, 6, 7, 8, 0, 1, 12, 13, 14, 15]
        receiver = backend.create_receiver()
        receiver.start(FetchRequest(queue.get(timeout=TIMEOUT_S), keys=(b"k" * 32,) * 10, tag=11,
                                    deadline_s=TIMEOUT_S), TensorDest(pool, block_ids))
        assert wait(receiver, TIMEOUT_S) is TransferState.SUCCESS, receiver.poll()
        expected = torch.randn((10, *BLOCK_SHAPE), generator=torch.Generator().manual_seed(3))
        assert torch.equal(pool[block_ids], expected)
        assert receiver.result() == expected.numel() * 4
        assert results.get(timeout=TIMEOUT_S) == ("sender", "SUCCESS", expected.numel() * 4)
        backend.close()
        assert dist.is_initialized() == default_group_before  # never the default group
    finally:
        peer.join(timeout=TIMEOUT_S)
        if peer.is_alive():
            peer.kill()
        channel.close()
    assert peer.exitcode == 0


def test_peer_never_shows_is_a_clean_transfer_error():
    channel = TorchPairChannel(0, "127.0.0.1", 0, timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="could not connect"):
        channel.connect()
    # its 0.5 s setup limit ended the wait (a generous 60x: the bound is against a hang)
    assert time.monotonic() - start < 60 * channel.timeout_s
    with pytest.raises(KVTransferError, match="closed"):  # torn down: never reused
        channel.connect()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    backend = TorchTransferBackend(KVTransferConfig(backend="torch", timeout_s=0.5))
    receiver = backend.create_receiver()
    receiver.start(FetchRequest(f"127.0.0.1:{port}", (b"k" * 32,)), TensorDest(torch.zeros(1, 4)))
    assert receiver.poll() is TransferState.BOOTSTRAPPING
    # failed by its 0.5 s timeout, not left bootstrapping (polled for a generous 60x of it)
    assert wait(receiver, 60 * backend.config.timeout_s) is TransferState.FAILED
    with pytest.raises(KVTransferError):
        receiver.result()
    backend.close()


def test_wrong_token_is_refused_before_the_group_forms():
    sender_side = TorchPairChannel(0, "127.0.0.1", 0, timeout_s=2.0, token=TOKEN)
    errors = {}

    def join():
        host, port = sender_side.address.rsplit(":", 1)
        try:
            TorchPairChannel(1, host, int(port), timeout_s=1.0, token="wrong").connect()
        except KVTransferError as exc:
            errors["receiver"] = exc

    joiner = threading.Thread(target=join)
    joiner.start()
    with pytest.raises(KVAuthError):
        sender_side.connect()
    joiner.join(10.0)
    assert isinstance(errors.get("receiver"), KVTransferError)
