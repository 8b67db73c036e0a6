"""gRPC server of one node's KV store (Mooncake FAST'25 §3 Messenger).

Serves a :class:`BlockStore` (the node's TieredNodeStore) over the
``pdcluster.kvstore.v1.KVStore`` service: protobuf messages with raw tensor bytes, never pickle.
Binds only ``config.host`` (``--kv-bind``, 127.0.0.1 by default), over TLS when ``config.tls``
is set (``--kv-tls-cert/-key/-ca``; mutual TLS with a CA). With ``config.token`` set, every
call must carry ``authorization: Bearer <token>`` (or ``x-pdcluster-token: <token>``) in its
metadata, else it fails with UNAUTHENTICATED (peers' KV planes shipped unauthenticated and
bound to all interfaces, e.g. vLLM's CVE-2025-32444). A daemon thread sweeps expired tails every
``min(tail_ttl_s / 4, 5)`` seconds.

Block replies (GetBlocks, and FetchBlocks: the same replies on one long-lived stream per
client session) are pre-encoded (kvstore.transport.wire): the blocks' bytes are joined once
into the serialized message instead of being copied into a protobuf object and serialized.

Errors carry their kind in trailing metadata (kvstore.rpc_errors), so clients map them to
typed errors without parsing text.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent import futures
from typing import Protocol

import grpc

from pdcluster.kvstore import tls
from pdcluster.kvstore.config import KVStoreConfig
from pdcluster.kvstore.errors import BlockLayoutError, KVStoreError, StoreCapacityError
from pdcluster.kvstore.layout import BlockLayout
from pdcluster.kvstore.proto import kvstore_pb2 as pb
from pdcluster.kvstore.proto import kvstore_pb2_grpc as pb_grpc
from pdcluster.kvstore.rpc_errors import (ERROR_METADATA_KEY, MAX_MISSING_KEYS_IN_DETAILS,
                                          missing_details)
from pdcluster.kvstore.tail_store import StoredTail
from pdcluster.kvstore.transport.runs import budget_runs
from pdcluster.kvstore.transport.wire import encode_block_data

logger = logging.getLogger(__name__)

#: Bytes kept free in each message for keys and framing when coalescing a run of blocks.
MESSAGE_OVERHEAD_BYTES = 64 << 10
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVStore"].full_name
#: Metadata keys that may carry the shared token (gRPC lower-cases metadata keys).
AUTH_METADATA_KEY = "authorization"
TOKEN_METADATA_KEY = "x-pdcluster-token"


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """gRPC options shared by the server and its clients (tuned with benchmarks/transfer.py)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, kind: str, details: str):
    context.set_trailing_metadata(((ERROR_METADATA_KEY, kind),))
    context.abort(code, details)


def _layout(msg: pb.BlockData, context: grpc.ServicerContext) -> BlockLayout:
    try:
        return BlockLayout(msg.layout.dtype, tuple(msg.layout.shape))
    except BlockLayoutError as exc:
        _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "layout", str(exc))
        raise  # unreachable: abort raises


class BlockStore(Protocol):
    """What the gRPC service serves: keyed full blocks and tail blocks of one node.

    kvstore.node_store.TieredNodeStore is the product's; methods are called from many gRPC
    handler threads at once, so an implementation is thread-safe. Errors: BlockLayoutError
    (payload/layout mismatch), StoreCapacityError (no room), ValueError (bad argument).
    """

    def put(self, key: bytes, payload: bytes, layout: BlockLayout) -> None:
        """Store one keyed block (a key already present is kept)."""

    def get_many(self, keys: Sequence[bytes]) -> list[tuple[bytes, BlockLayout] | None]:
        """Each key's ``(payload, layout)``, ``None`` where absent."""

    def put_tail(self, handle: str, payload: bytes, layout: BlockLayout,
                 num_tokens: int) -> None:
        """Store a tail block under ``handle``."""

    def take_tail(self, handle: str) -> StoredTail | None:
        """Return and remove the tail under ``handle``; ``None`` if absent or expired."""

    def release_tail(self, handle: str) -> bool:
        """Drop the tail under ``handle``; ``False`` if it was not there."""

    def expire_tails(self) -> int:
        """Drop tails past their TTL; returns how many."""

    def stats(self) -> dict[str, int]:
        """The StatsReply fields: num_blocks, bytes_used, capacity_bytes, num_tails,
        evictions, expired_tails."""

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether a keyed block is held (touching nothing)."""

    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop keyed blocks, skipping pinned ones; returns how many were present."""

    def pin(self, keys: Sequence[bytes], pinned: bool) -> list[bool]:
        """Pin (never evicted until unpinned) or unpin keyed blocks; per key, whether it is
        present and now in the requested state."""


class _KVStoreServicer(pb_grpc.KVStoreServicer):
    def __init__(self, store: BlockStore, max_message_bytes: int):
        self._store = store
        self._chunk_budget = max(1, max_message_bytes - MESSAGE_OVERHEAD_BYTES)

    def _store_call(self, context: grpc.ServicerContext, fn, *args):
        try:
            return fn(*args)
        except StoreCapacityError as exc:
            _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "capacity", str(exc))
        except BlockLayoutError as exc:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "layout", str(exc))
        except ValueError as exc:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "invalid", str(exc))

    def PutBlocks(self, request_iterator: Iterable[pb.BlockData], context) -> pb.PutReply:
        num_blocks = 0
        for msg in request_iterator:
            layout = _layout(msg, context)
            n, size = len(msg.keys), layout.nbytes
            if msg.handle or len(msg.payload) != n * size:
                _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "layout",
                       f"message with {n} key(s) of {size} bytes each carries "
                       f"{len(msg.payload)} payload bytes (handle={msg.handle!r})")
            view = memoryview(msg.payload)
            for i, key in enumerate(msg.keys):
                self._store_call(context, self._store.put, key,
                                 bytes(view[i * size:(i + 1) * size]), layout)
            num_blocks += n
        return pb.PutReply(num_blocks=num_blocks)

    def GetBlocks(self, request: pb.GetBlocksRequest, context) -> Iterator[bytes]:
        """Yields serialized BlockData messages (see :func:`_method_handlers`)."""
        missing, messages = self._reply(request)
        if missing:
            _abort(context, grpc.StatusCode.NOT_FOUND, "not_found",
                   missing_details(missing, len(request.keys)))
        yield from messages

    def FetchBlocks(self, request_iterator: Iterable[pb.GetBlocksRequest],
                    context) -> Iterator[bytes]:
        """A session: each request's reply (ending ``last``), or an in-band ``error``."""
        for request in request_iterator:
            missing, messages = self._reply(request)
            if missing:
                error = pb.FetchError(kind="not_found",
                                      details=missing_details(missing, len(request.keys)),
                                      missing=missing[:MAX_MISSING_KEYS_IN_DETAILS])
                yield pb.BlockData(error=error, last=True).SerializeToString()
            else:
                yield from messages

    def _reply(self, request: pb.GetBlocksRequest) -> tuple[list[bytes], Iterator[bytes]]:
        """(missing keys, the encoded reply messages: coalesced runs, the final one ``last``).

        All or nothing: when any key is missing the messages are not to be sent."""
        keys = list(request.keys)
        entries = self._store.get_many(keys)
        missing = [k for k, e in zip(keys, entries) if e is None]
        if missing:
            return missing, iter(())
        budget = self._chunk_budget
        if request.max_chunk_bytes > 0:
            budget = min(budget, request.max_chunk_bytes)
        chunks: list[tuple[range, pb.BlockLayout]] = []
        start = 0
        while start < len(keys):
            layout = entries[start][1]
            end = start + 1  # a run shares one layout
            while end < len(keys) and entries[end][1] == layout:
                end += 1
            layout_msg = pb.BlockLayout(dtype=layout.dtype, shape=layout.shape)
            chunks.extend((range(start + run.start, start + run.stop), layout_msg)
                          for run in budget_runs(layout.nbytes, end - start, budget))
            start = end

        def messages() -> Iterator[bytes]:
            if not chunks:
                yield pb.BlockData(last=True).SerializeToString()
            for i, (idx, layout_msg) in enumerate(chunks):
                yield encode_block_data([entries[j][0] for j in idx],
                                        keys=keys[idx.start:idx.stop], layout=layout_msg,
                                        last=i == len(chunks) - 1)
        return missing, messages()

    def PutTail(self, request: pb.BlockData, context) -> pb.PutReply:
        layout = _layout(request, context)
        if request.keys:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "invalid", "a tail carries no keys")
        self._store_call(context, self._store.put_tail, request.handle, request.payload,
                         layout, request.num_tokens)
        return pb.PutReply(num_blocks=1)

    def TakeTail(self, request: pb.TailRequest, context) -> pb.BlockData:
        tail = self._store.take_tail(request.handle)
        if tail is None:
            _abort(context, grpc.StatusCode.NOT_FOUND, "not_found",
                   f"tail {request.handle!r} is absent, already taken, or expired")
        return pb.BlockData(
            handle=request.handle,
            layout=pb.BlockLayout(dtype=tail.layout.dtype, shape=tail.layout.shape),
            payload=tail.payload,
            num_tokens=tail.num_tokens,
        )

    def ReleaseTail(self, request: pb.TailRequest, context) -> pb.ReleaseTailReply:
        return pb.ReleaseTailReply(released=self._store.release_tail(request.handle))

    def Stats(self, request: pb.StatsRequest, context) -> pb.StatsReply:
        return pb.StatsReply(**self._store.stats())

    def Exists(self, request: pb.KeysRequest, context) -> pb.ExistsReply:
        return pb.ExistsReply(
            exists=self._store_call(context, self._store.exists, list(request.keys)))

    def Remove(self, request: pb.KeysRequest, context) -> pb.RemoveReply:
        return pb.RemoveReply(
            num_removed=self._store_call(context, self._store.remove, list(request.keys)))

    def Pin(self, request: pb.PinRequest, context) -> pb.PinReply:
        return pb.PinReply(applied=self._store_call(context, self._store.pin,
                                                    list(request.keys), request.pinned))


#: gRPC handler factory per (request streaming, response streaming).
_HANDLER_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}
#: Methods whose handlers yield pre-encoded ``bytes`` (their serializer is the identity).
_PRE_ENCODED = frozenset({"GetBlocks", "FetchBlocks"})


def _method_handlers(servicer: _KVStoreServicer) -> dict[str, grpc.RpcMethodHandler]:
    """The generated ``add_KVStoreServicer_to_server`` table, built from the service
    descriptor, except that GetBlocks and FetchBlocks yield pre-encoded ``bytes``."""
    return {
        m.name: _HANDLER_FACTORIES[(m.client_streaming, m.server_streaming)](
            getattr(servicer, m.name),
            request_deserializer=getattr(pb, m.input_type.name).FromString,
            response_serializer=(None if m.name in _PRE_ENCODED
                                 else getattr(pb, m.output_type.name).SerializeToString))
        for m in pb.DESCRIPTOR.services_by_name["KVStore"].methods
    }


class _TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call not carrying the shared token.

    The token is compared in constant time (``hmac.compare_digest``) and never logged.
    """

    def __init__(self, token: str):
        self._token = token.encode()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or self._authorized(handler_call_details.invocation_metadata):
            return handler
        return _refusing_handler(handler)

    def _authorized(self, metadata) -> bool:
        presented = b""
        for key, value in metadata or ():
            if key == AUTH_METADATA_KEY and value.startswith("Bearer "):
                presented = value[len("Bearer "):].encode()
            elif key == TOKEN_METADATA_KEY:
                presented = value.encode() if isinstance(value, str) else value
        return hmac.compare_digest(presented, self._token)


def _refusing_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    def refuse(request_or_iterator, context):
        context.set_trailing_metadata(((ERROR_METADATA_KEY, "auth"),))
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid KV store token")

    return _HANDLER_FACTORIES[(handler.request_streaming, handler.response_streaming)](refuse)


class KVStoreServer:
    """One node's KV store gRPC server (thread pool; no asyncio).

    Args:
        config: bind host/port, TLS, token, max message size.
        store: the block store to serve.
        max_workers: gRPC handler threads. Each open stream holds one, a FetchBlocks session
            for as long as it stays open (clients close theirs after a few idle seconds,
            kvstore.fetch_session), so this bounds concurrent sessions plus other calls.
    """

    def __init__(
        self, config: KVStoreConfig, store: BlockStore, max_workers: int = 64
    ):
        self.config = config
        self.store = store
        self._max_workers = max_workers
        self._server: grpc.Server | None = None
        self._port: int | None = None
        self._stop_sweep = threading.Event()
        self._sweeper: threading.Thread | None = None

    def start(self) -> int:
        """Bind and start serving; returns the bound port.

        Raises:
            KVStoreError: already started, or ``config.host:config.port`` cannot be bound.
        """
        if self._server is not None:
            raise KVStoreError(f"KV store server already started on {self.address}")
        options = [*channel_options(self.config.max_message_bytes), ("grpc.so_reuseport", 0)]
        interceptors = []
        if self.config.token is not None:
            interceptors.append(_TokenAuthInterceptor(self.config.token.get_secret_value()))
        server = grpc.server(futures.ThreadPoolExecutor(
            max_workers=self._max_workers, thread_name_prefix="kvstore-grpc"), options=options,
            interceptors=interceptors)
        handlers = _method_handlers(_KVStoreServicer(self.store, self.config.max_message_bytes))
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        server.add_registered_method_handlers(SERVICE_NAME, handlers)
        bind = f"{_host_for_uri(self.config.host)}:{self.config.port}"
        try:
            if self.config.tls is None:
                port = server.add_insecure_port(bind)
            else:
                port = server.add_secure_port(bind, tls.server_credentials(self.config.tls))
        except RuntimeError as exc:
            raise KVStoreError(f"cannot bind KV store server to {bind}: {exc}") from exc
        if port == 0:
            raise KVStoreError(f"cannot bind KV store server to {bind}")
        server.start()
        self._server, self._port = server, port
        self._stop_sweep.clear()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="kvstore-tail-sweep",
                                         daemon=True)
        self._sweeper.start()
        logger.info("KV store server listening on %s (auth %s, TLS %s)", self.address,
                    "on" if self.config.token is not None else "OFF",
                    "on" if self.config.tls is not None else "off")
        return port

    @property
    def port(self) -> int:
        """Bound port. Raises KVStoreError if not started."""
        if self._port is None:
            raise KVStoreError("KV store server not started")
        return self._port

    @property
    def address(self) -> str:
        """``host:port`` the server is bound to (the configured host, IPv6 in brackets)."""
        return f"{_host_for_uri(self.config.host)}:{self.port}"

    def stop(self, grace: float | None = None) -> None:
        """Stop serving (in-flight RPCs get ``grace`` seconds). Idempotent."""
        self._stop_sweep.set()
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None
        if self._sweeper is not None:
            self._sweeper.join(timeout=5.0)
            self._sweeper = None

    def _sweep_loop(self) -> None:
        interval = max(0.05, min(self.config.tail_ttl_s / 4, 5.0))
        while not self._stop_sweep.wait(interval):
            dropped = self.store.expire_tails()
            if dropped:
                logger.info("dropped %d expired tail block(s)", dropped)


def _host_for_uri(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
