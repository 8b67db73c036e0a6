"""torch.distributed transfer backend: point-to-point between one prefill and one decode worker.

Bytes move as raw tensors over a :class:`~kvstore.transport.torch_pair.channel.TorchPairChannel`
(gloo on CPU, NCCL on CUDA; never the default group; no pickle). Flow of one transfer::

    prefill: ch = TorchPairChannel(0, bind_host, 0, timeout_s, token=...)   # binds a free port
             ch.address  --(control plane)-->  decode: FetchRequest(address=ch.address, tag=t)
    prefill: TorchKVSender(ch).start(blocks, t, deadline)   # blocks: [n, *block_shape]
    decode:  TorchTransferBackend.create_receiver().start(request, dest)

Chunking: both sides split a transfer with ``budget_runs(block_nbytes, n, chunk_bytes)``;
``chunk_bytes`` is the sender's, published at setup, so the two always agree. Chunks of one
transfer share its tag (gloo matches a pair's messages per tag, in order).

A receiver never posts a recv into the caller's blocks (a late send after an abort would land
there, see torch_pair's NOTE): it receives into its own two staging chunks (double-buffered:
the next chunk lands while the previous one is copied out) and copies each into the
destination under the write guard. On failure the channel is closed and kept by the backend
until the backend closes, so a late write only ever hits staging memory that is still alive.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from pdcluster.kvstore.config import KVStoreConfig, KVTransferConfig
from pdcluster.kvstore.errors import BlockLayoutError
from pdcluster.kvstore.transport.base import (FetchRequest, KVReceiver, KVTransferBackend,
                                             TransferState, _TransferBase)
from pdcluster.kvstore.transport.dest import CallbackDest
from pdcluster.kvstore.transport.runs import budget_runs
from pdcluster.kvstore.transport.torch_pair.channel import TorchPairChannel


class TorchKVSender(_TransferBase):
    """Prefill side of one transfer: sends its blocks over a pair channel, connecting it first.

    On failure the channel is closed; its owner keeps the closed channel object until it
    shuts down (torch_pair's NOTE: a posted send may still read ``blocks``) and opens a new
    pair over the control plane.

    Args:
        channel: rank 0 of the pair.
    """

    def __init__(self, channel: TorchPairChannel):
        super().__init__()
        self.channel = channel

    def start(self, blocks: torch.Tensor, tag: int, deadline_s: float) -> None:
        """Begin sending ``blocks`` [n, *block_shape] (contiguous) under ``tag``; never blocks."""
        if not blocks.is_contiguous() or blocks.dim() < 2:
            raise BlockLayoutError(f"blocks must be a contiguous [n, *block_shape] tensor, got "
                                   f"{tuple(blocks.shape)}")
        self._begin(deadline_s, TransferState.BOOTSTRAPPING if not self.channel.connected
                    else TransferState.TRANSFERRING)
        threading.Thread(target=self._guarded, args=(self._send, blocks, tag), daemon=True,
                         name="kv-torch-send").start()

    def _send(self, blocks: torch.Tensor, tag: int) -> None:
        self.channel.connect()
        self._set_state(TransferState.TRANSFERRING)
        block_nbytes = blocks[0].numel() * blocks.element_size() if len(blocks) else 1
        for run in budget_runs(block_nbytes, len(blocks), self.channel.chunk_bytes):
            if self._cancelled:
                return
            chunk = blocks[run.start:run.stop]
            self.channel.wait(self.channel.send(chunk, tag), self._remaining_s())
            self._add_bytes(chunk.numel() * chunk.element_size())
        self._succeed()

    def _release(self) -> None:
        self.channel.close()

    def _describe(self) -> str:
        return f"TorchKVSender to {self.channel.address}"

    def _address(self) -> str | None:
        return self.channel.address


class TorchTransferBackend(KVTransferBackend):
    """The receiving side: one pair channel (rank 1) per sender address.

    A failed transfer retires its channel: closed, and kept (with the staging chunks its
    posted receives hold, at most two chunks per failure) until :meth:`close`, which the
    worker calls at shutdown. Pairs prove the KV plane's token (``kv_config.token``).
    """

    name = "torch"

    def __init__(self, config: KVTransferConfig, kv_config: KVStoreConfig | None = None):
        super().__init__(config, kv_config)
        self._lock = threading.Lock()
        self._channels: dict[str, TorchPairChannel] = {}
        self._retired: list[TorchPairChannel] = []

    def channel(self, address: str, timeout_s: float) -> TorchPairChannel:
        """The connected channel to the sender at ``address`` (connecting it if new)."""
        with self._lock:
            channel = self._channels.get(address)
            if channel is None or channel.closed:
                host, _, port = address.rpartition(":")
                channel = self._channels[address] = TorchPairChannel(
                    1, host.strip("[]"), int(port), token=self.kv_config.token,
                    timeout_s=min(timeout_s, self.config.timeout_s))
        channel.connect()
        return channel

    def retire(self, address: str) -> None:
        """Close the channel to ``address``; keep the object until :meth:`close`."""
        with self._lock:
            channel = self._channels.pop(address, None)
            if channel is not None:
                self._retired.append(channel)
        if channel is not None:
            channel.close()

    def create_receiver(self) -> TorchKVReceiver:
        return TorchKVReceiver(self)

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
            self._retired.clear()
        for channel in channels:
            channel.close()


class TorchKVReceiver(KVReceiver):
    """One transfer over a pair channel: chunks into double-buffered staging, then ``dest``."""

    def __init__(self, backend: TorchTransferBackend):
        super().__init__()
        self._backend = backend

    def start(self, request: FetchRequest, dest: CallbackDest) -> None:
        dest = self._accept(request, dest, self._backend.config.timeout_s,
                            TransferState.BOOTSTRAPPING)
        threading.Thread(target=self._guarded, args=(self._receive, dest), daemon=True,
                         name="kv-torch-recv").start()

    def _receive(self, dest: CallbackDest) -> None:
        request = self.request
        channel = self._backend.channel(request.address, self._remaining_s())
        self._set_state(TransferState.TRANSFERRING)
        runs = budget_runs(dest.block_nbytes, dest.num_blocks, channel.chunk_bytes)
        if not runs:
            self._succeed()
            return
        staging = [torch.empty((len(runs[0]), *dest.block_shape), dtype=dest.dtype,
                               device=channel.device) for _ in range(min(2, len(runs)))]

        def post(i: int) -> dist.Work:
            return channel.recv(staging[i % 2][:len(runs[i])], request.tag)

        work = post(0)
        for i, run in enumerate(runs):
            channel.wait(work, self._remaining_s())
            if i + 1 < len(runs):
                work = post(i + 1)  # the next chunk lands while this one is copied out
            self._write(dest.write_tensor, run.start, staging[i % 2][:len(run)])
            self._add_bytes(len(run) * dest.block_nbytes)
        self._succeed()

    def _release(self) -> None:
        self._backend.retire(self.request.address)
