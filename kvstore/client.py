"""gRPC client of a node's KV store: tensors in, tensors out, typed errors: protobuf
over gRPC, never pickle (bytes from a socket are never unpickled), and a deadline on every call so
a dead store cannot hang a worker.

Wire payload = raw little-endian bytes of a C-contiguous tensor; bfloat16 travels as its int16
bit pattern. Blocks are streamed in coalesced runs that fit ``max_message_bytes``; the block
stream is decoded without copying payloads (kvstore.transport.wire), so a fetched block is copied
once, from the received message into its destination.

With a ``token``, every call carries ``authorization: Bearer <token>``; a store that refuses it
raises :class:`KVAuthError`.

It is also the node store facade (kvstore.node_store_api) for a store reached over gRPC:
put/get over PutBlocks/GetBlocks, exists/remove/pin over their own RPCs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc
import numpy as np
import pydantic
import torch

from pdcluster.kvstore import tls as kv_tls
from pdcluster.kvstore.config import KVTLSConfig
from pdcluster.kvstore.errors import BlockLayoutError, BlockNotFoundError, KVTransferError
from pdcluster.kvstore.fetch_session import BlockStream, FetchSession, SessionPool
from pdcluster.kvstore.index.base import check_keys
from pdcluster.kvstore.layout import BlockLayout
from pdcluster.kvstore.node_store_api import (REMOTE, TORCH_DTYPES, NodeStore, blocks_layout,
                                              layout_of)
from pdcluster.kvstore.proto import kvstore_pb2 as pb
from pdcluster.kvstore.proto import kvstore_pb2_grpc as pb_grpc
from pdcluster.kvstore.rpc_errors import rpc_error
from pdcluster.kvstore.server import (AUTH_METADATA_KEY, MESSAGE_OVERHEAD_BYTES, SERVICE_NAME,
                                      channel_options)
from pdcluster.kvstore.tail_store import check_tail
from pdcluster.kvstore.transport.runs import budget_runs


def tensor_to_payload(t: torch.Tensor) -> bytes:
    """Raw little-endian bytes of ``t`` (any shape; float32/bfloat16/float16/uint8, any device)."""
    t = t.detach().to("cpu").contiguous()
    # Native bytes, never swapped: kvstore.transport.dest refuses non-little-endian hosts.
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


class KVStoreClient(NodeStore):
    """Client of one KV store server. Thread-safe (one gRPC channel); a context manager.

    Args:
        address: ``host:port`` of the server.
        timeout_s: deadline of each call in seconds (a whole stream counts as one call).
        max_message_bytes: max gRPC message size in bytes, both directions.
        token: the KV plane's shared secret (``--kv-token``), sent with every call; ``None``
            for a store without auth.
        tls: TLS settings (kvstore.config.KVTLSConfig) when the store serves TLS; ``None``:
            plaintext. Unreadable files raise KVStoreError here.
        max_idle_sessions, session_idle_s: block fetches run on pooled FetchBlocks sessions
            (kvstore.fetch_session); at most this many stay open while idle, none longer than
            this many seconds.

    Every method raises :class:`KVTransferError` (naming the address and reason) on a deadline
    or RPC failure and :class:`KVAuthError` when the store refuses the token;
    ``grpc.RpcError`` never escapes.
    """

    def __init__(self, address: str, timeout_s: float = 10.0, max_message_bytes: int = 64 << 20,
                 token: str | pydantic.SecretStr | None = None, tls: KVTLSConfig | None = None,
                 max_idle_sessions: int = 4, session_idle_s: float = 10.0):
        self.address = address
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes
        self._chunk_budget = max(1, max_message_bytes - MESSAGE_OVERHEAD_BYTES)
        if isinstance(token, pydantic.SecretStr):
            token = token.get_secret_value()
        self._metadata = ((AUTH_METADATA_KEY, f"Bearer {token}"),) if token else ()
        options = [*channel_options(max_message_bytes), *kv_tls.channel_options(tls)]
        self._channel = grpc.insecure_channel(address, options=options) if tls is None else \
            grpc.secure_channel(address, kv_tls.channel_credentials(tls), options=options)
        self._stub = pb_grpc.KVStoreStub(self._channel)
        fetch = self._channel.stream_stream(  # replies decoded by kvstore.transport.wire
            f"/{SERVICE_NAME}/FetchBlocks",
            request_serializer=pb.GetBlocksRequest.SerializeToString,
            response_deserializer=None, _registered_method=True)
        self.sessions = SessionPool(lambda: FetchSession(fetch, self._metadata),
                                    max_idle_sessions, session_idle_s)

    def __repr__(self) -> str:
        return f"KVStoreClient({self.address!r}, auth={'on' if self._metadata else 'off'})"

    def put_blocks(self, keys: Sequence[bytes], blocks: torch.Tensor) -> None:
        """Store full blocks under their chained keys (engine.core.hashing.block_keys).

        Args:
            keys: n keys of 32 bytes.
            blocks: [n, *block_shape], float32/bfloat16/float16/uint8, any device.

        Raises:
            ValueError: a key is not 32 bytes.
            BlockLayoutError: ``blocks.shape[0] != len(keys)``, unsupported dtype, or a block
                larger than ``max_message_bytes``.
            StoreCapacityError: a block does not fit in the store at all.
            KVTransferError: deadline or RPC failure.
        """
        layout = blocks_layout(keys, blocks)
        if not keys:
            return
        self._check_fits(layout)
        flat = blocks.reshape(len(keys), -1)

        def messages() -> Iterator[pb.BlockData]:
            for run in budget_runs(layout.nbytes, len(keys), self._chunk_budget):
                yield pb.BlockData(keys=list(keys[run.start:run.stop]),
                                   layout=_layout_msg(layout),
                                   payload=tensor_to_payload(flat[run.start:run.stop]))

        self._call("PutBlocks", messages())

    def get_blocks(self, keys: Sequence[bytes]) -> torch.Tensor:
        """Fetch full blocks, all or nothing.

        Args:
            keys: n >= 1 keys of 32 bytes (duplicates allowed).

        Returns:
            CPU tensor [n, *block_shape] in the stored dtype, block i under ``keys[i]``.

        Raises:
            ValueError: empty ``keys`` or a key not 32 bytes.
            BlockNotFoundError: any key is missing; ``.missing`` lists them (at most the first
                64 when many are missing; the message gives the total).
            BlockLayoutError: the blocks do not share one layout, or the reply is malformed.
            KVTransferError: deadline or RPC failure.
        """
        check_keys(keys)
        if not keys:
            raise ValueError("get_blocks needs at least one key (the block shape is unknown)")
        out: torch.Tensor | None = None
        flat: np.ndarray | None = None
        for chunk in self.stream_blocks(keys):
            if out is None:
                out = torch.empty((len(keys), *chunk.layout.shape),
                                  dtype=TORCH_DTYPES[chunk.layout.dtype])
                flat = out.view(-1).view(torch.uint8).numpy()
            offset = chunk.start * chunk.layout.nbytes  # one memcpy per chunk
            flat[offset:offset + len(chunk.payload)] = np.frombuffer(chunk.payload, np.uint8)
        assert out is not None  # stream_blocks checked that every block came
        return out

    def stream_blocks(self, keys: Sequence[bytes], max_chunk_bytes: int | None = None,
                      timeout_s: float | None = None) -> BlockStream:
        """Fetch blocks on a pooled FetchBlocks session; they arrive in order, coalesced into
        chunks (nothing is sent until iteration starts).

        Args:
            keys: n >= 1 keys of 32 bytes.
            max_chunk_bytes: payload budget per message (capped by ``max_message_bytes``).
            timeout_s: deadline of the whole fetch (default ``self.timeout_s``).

        Raises (on iteration): as :meth:`get_blocks`.
        """
        budget = self._chunk_budget
        if max_chunk_bytes is not None:
            budget = max(1, min(budget, max_chunk_bytes))
        request = pb.GetBlocksRequest(keys=list(keys), max_chunk_bytes=budget)
        return BlockStream(self.address, self.sessions, keys, request,
                           self.timeout_s if timeout_s is None else timeout_s)

    def put_tail(self, handle: str, block: torch.Tensor, num_tokens: int) -> None:
        """Store a request's partial tail block under ``handle`` (never keyed or indexed).

        Args:
            handle: per-request handle (e.g. the request id), non-empty.
            block: [*block_shape], float32/bfloat16/float16/uint8, any device.
            num_tokens: valid tokens in the block.

        Raises:
            ValueError: empty handle or negative ``num_tokens``.
            BlockLayoutError, StoreCapacityError, KVTransferError: as for :meth:`put_blocks`.
        """
        layout = layout_of(block.shape, block.dtype)
        self._check_fits(layout)
        payload = tensor_to_payload(block)
        check_tail(handle, payload, layout, num_tokens)
        self._call("PutTail", pb.BlockData(handle=handle, layout=_layout_msg(layout),
                                           payload=payload, num_tokens=num_tokens))

    def take_tail(self, handle: str, timeout_s: float | None = None) -> tuple[torch.Tensor, int]:
        """Return and remove the tail under ``handle``: (CPU tensor [*block_shape], num_tokens).

        Raises:
            BlockNotFoundError: absent, already taken, or expired (``.handle`` is set).
            BlockLayoutError, KVTransferError.
        """
        msg = self._call("TakeTail", pb.TailRequest(handle=handle), timeout_s, handle=handle)
        layout = BlockLayout(msg.layout.dtype, tuple(msg.layout.shape))
        if len(msg.payload) != layout.nbytes:
            raise BlockLayoutError(f"malformed TakeTail reply from {self.address}")
        out = torch.empty(layout.shape, dtype=TORCH_DTYPES[layout.dtype])
        out.view(-1).view(torch.uint8).numpy()[:] = np.frombuffer(msg.payload, np.uint8)
        return out, msg.num_tokens

    def release_tail(self, handle: str) -> bool:
        """Drop the tail under ``handle``; idempotent. ``True`` if it was there."""
        return self._call("ReleaseTail", pb.TailRequest(handle=handle)).released

    def stats(self) -> dict[str, int]:
        """Server counters: num_blocks, bytes_used, capacity_bytes, num_tails, evictions,
        expired_tails."""
        reply = self._call("Stats", pb.StatsRequest())
        return {f.name: getattr(reply, f.name) for f in pb.StatsReply.DESCRIPTOR.fields}

    # ---- the node store facade (kvstore.node_store_api.NodeStore) ----------------------------
    def put(self, keys: Sequence[bytes], blocks: torch.Tensor) -> None:
        """:meth:`put_blocks` (a store whose host DRAM is held full by pins raises
        StoreCapacityError)."""
        self.put_blocks(keys, blocks)

    def get(self, keys: Sequence[bytes], out: torch.Tensor) -> list[str | None]:
        """Fetch the leading run of present keys into ``out`` (see NodeStore.get); every
        block fetched reports tier ``"remote"``: the reply does not say which of the store's
        tiers served it.

        One GetBlocks when every key is present. On a miss, the store names the missing keys
        in key order, so the run ends at the first of them and is fetched again; a block that
        leaves the store meanwhile shortens the run once more.

        Raises:
            BlockLayoutError: ``out`` is not [len(keys), *block_shape] of the stored dtype.
            KVTransferError: deadline or RPC failure.
        """
        blocks_layout(keys, out)
        run = len(keys)
        while run:
            try:
                got = self.get_blocks(keys[:run])
                break
            except BlockNotFoundError as exc:
                missing = set(exc.missing)
                first = next((i for i, k in enumerate(keys[:run]) if k in missing), None)
                if first is None:  # the store named none of our keys: not a miss we can use
                    raise
                run = first
        if run:
            if got.shape[1:] != out.shape[1:] or got.dtype != out.dtype:
                raise BlockLayoutError(f"stored blocks are {got.dtype} {tuple(got.shape[1:])}, "
                                       f"out is {out.dtype} {tuple(out.shape[1:])}")
            out[:run] = got
        return [REMOTE] * run + [None] * (len(keys) - run)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        check_keys(keys)
        return list(self._call("Exists", pb.KeysRequest(keys=list(keys))).exists)

    def remove(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        return self._call("Remove", pb.KeysRequest(keys=list(keys))).num_removed

    def pin(self, keys: Sequence[bytes], pinned: bool = True) -> list[bool]:
        check_keys(keys)
        return list(self._call("Pin", pb.PinRequest(keys=list(keys), pinned=pinned)).applied)

    def close(self) -> None:
        """Close the sessions and the channel. Idempotent."""
        self.sessions.close()
        self._channel.close()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------

    def _check_fits(self, layout: BlockLayout) -> None:
        if layout.nbytes > self._chunk_budget:
            raise BlockLayoutError(f"one block of {layout.nbytes} bytes exceeds the message "
                                   f"budget of {self._chunk_budget} bytes (max_message_bytes="
                                   f"{self.max_message_bytes})")

    def _call(self, method: str, request, timeout_s: float | None = None,
              handle: str | None = None):
        """Call RPC ``method`` with ``request`` (a message, or an iterator of them for
        PutBlocks) under the call deadline and the token, mapping failures to typed errors."""
        try:
            return getattr(self._stub, method)(
                request, timeout=self.timeout_s if timeout_s is None else timeout_s,
                metadata=self._metadata)
        except grpc.RpcError as exc:
            raise rpc_error(self.address, method, exc, handle) from None
        except ValueError as exc:  # grpc raises ValueError on a closed channel
            raise KVTransferError(f"{self.address}: {method} failed: {exc}",
                                  address=self.address) from None


def _layout_msg(layout: BlockLayout) -> pb.BlockLayout:
    return pb.BlockLayout(dtype=layout.dtype, shape=layout.shape)
