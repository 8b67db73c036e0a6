"""gRPC transfer backend: pull blocks from a node's KV store (works everywhere).

(Named ``grpc_backend`` rather than ``grpc`` so that ``import grpc`` can never resolve to it.)

One transfer = ``k`` concurrent fetches, each on its own pooled FetchBlocks session
(kvstore.fetch_session: one long-lived stream per session, no new RPC per transfer), over
contiguous slices of the key list
(``k = min(num_streams, total_bytes // min_stream_bytes)``, at least 1), each delivering
coalesced chunks of at most ``max_chunk_bytes`` that are copied straight from the received
message into the destination; then, once every keyed block is in, the tail block by TakeTail
(taken last because taking is destructive: a transfer that failed earlier leaves the tail for
a retry). All calls carry the transfer's remaining deadline.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from pdcluster.kvstore.client import KVStoreClient
from pdcluster.kvstore.config import KVStoreConfig, KVTransferConfig
from pdcluster.kvstore.errors import BlockLayoutError, KVStoreError
from pdcluster.kvstore.fetch_session import BlockStream
from pdcluster.kvstore.transport.base import FetchRequest, KVReceiver, KVTransferBackend, _Cancelled
from pdcluster.kvstore.transport.dest import WIRE_DTYPES, CallbackDest


class GrpcTransferBackend(KVTransferBackend):
    """Shares one KVStoreClient (gRPC channel) per store address and one thread pool.

    Each client's channel uses the KV plane's token, TLS and max message size
    (``kv_config``); its calls' default deadline is the transfer's ``config.timeout_s``.
    """

    name = "grpc"

    def __init__(self, config: KVTransferConfig, kv_config: KVStoreConfig | None = None):
        super().__init__(config, kv_config)
        self._clients: dict[str, KVStoreClient] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=4 * config.num_streams + 4,
                                        thread_name_prefix="kv-grpc-recv")

    def client(self, address: str) -> KVStoreClient:
        """The shared client of the store at ``address``."""
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = self._clients[address] = KVStoreClient(
                    address, timeout_s=self.config.timeout_s,
                    max_message_bytes=self.kv_config.max_message_bytes,
                    token=self.kv_config.token, tls=self.kv_config.tls)
            return client

    def create_receiver(self) -> GrpcKVReceiver:
        return GrpcKVReceiver(self)

    def submit(self, fn, *args) -> None:
        self._pool.submit(fn, *args)

    def release_handles(self, address: str, handles: list[str]) -> None:
        """Drop one-shot handles (a tail, a layer stream's pieces) on the store at
        ``address``, in the background; a store that cannot be reached reclaims them at its
        tail TTL."""
        if handles:
            self.submit(self._release_handles, address, list(handles))

    def _release_handles(self, address: str, handles: list[str]) -> None:
        client = self.client(address)
        for handle in handles:
            try:
                client.release_tail(handle)
            except KVStoreError:
                pass

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()


class GrpcKVReceiver(KVReceiver):
    """One transfer over gRPC; see the module docstring."""

    def __init__(self, backend: GrpcTransferBackend):
        super().__init__()
        self._backend = backend
        self._streams: list[BlockStream] = []
        self._pending = 0
        self._dest: CallbackDest | None = None

    def start(self, request: FetchRequest, dest: CallbackDest) -> None:
        self._dest = self._accept(request, dest, self._backend.config.timeout_s)
        bounds = self._bounds(len(request.keys), dest.block_nbytes)
        self._pending = len(bounds) - 1
        for lo, hi in zip(bounds, bounds[1:]):
            self._backend.submit(self._run_slice, lo, hi)

    def _bounds(self, num_keys: int, block_nbytes: int) -> list[int]:
        """Where the key list is cut into slices, one stream each."""
        config = self._backend.config
        num = max(1, min(config.num_streams, num_keys * block_nbytes // config.min_stream_bytes,
                         num_keys))
        return [num_keys * i // num for i in range(num + 1)]

    # ---- worker threads ---------------------------------------------------------------

    def _run_slice(self, lo: int, hi: int) -> None:
        if hi > lo and not self._guarded(self._fetch_slice, lo, hi):
            return
        with self._lock:
            self._pending -= 1
            last = self._pending == 0
        if not last:
            return
        if self.request.tail_handle is not None and not self._guarded(self._fetch_tail):
            return
        self._succeed()

    def _fetch_slice(self, lo: int, hi: int) -> None:
        request, dest = self.request, self._dest
        client = self._backend.client(request.address)
        stream = client.stream_blocks(request.keys[lo:hi], self._backend.config.max_chunk_bytes,
                                      timeout_s=self._remaining_s())
        with self._lock:
            self._streams.append(stream)
            cancelled = self._state.done
        if cancelled:
            stream.cancel()
            raise _Cancelled()
        for chunk in stream:
            _check_layout(dest, chunk.layout.dtype, chunk.layout.shape, request.address)
            self._write(dest.write_bytes, lo + chunk.start, chunk.payload)
            self._add_bytes(len(chunk.payload))

    def _fetch_tail(self) -> None:
        request, dest = self.request, self._dest
        client = self._backend.client(request.address)
        tail, num_tokens = client.take_tail(request.tail_handle, timeout_s=self._remaining_s())
        if num_tokens != request.num_tail_tokens:
            raise BlockLayoutError(f"tail {request.tail_handle!r} from {request.address} holds "
                                   f"{num_tokens} tokens, expected {request.num_tail_tokens}")
        _check_layout(dest, WIRE_DTYPES.get(tail.dtype, str(tail.dtype)), tail.shape,
                      request.address)
        self._write(dest.write_tensor, len(request.keys), tail.unsqueeze(0))
        self._add_bytes(dest.block_nbytes)

    def _release(self) -> None:
        with self._lock:
            streams = list(self._streams)
        for stream in streams:
            stream.cancel()


def _check_layout(dest: CallbackDest, dtype: str, shape, address: str) -> None:
    if dtype != dest.wire_dtype or tuple(shape) != dest.block_shape:
        raise BlockLayoutError(f"blocks from {address} are {dtype} {tuple(shape)}, the "
                               f"destination {dest.wire_dtype} {dest.block_shape}")
