"""Layer-wise KV streaming (``--kv-streaming layer``; Mooncake FAST'25 §3.1): each layer's KV
for a prefill chunk's new tokens goes to the decode worker as soon as that layer's compute
ends, overlapping the remaining layers (and chunks).

Wire: a stream is a fixed, ordered list of pieces (LayerStreamAnnounce.pieces). Piece i is put
on the prefill node's KV store as a one-shot tail under ``{handle_prefix}{i}`` (never keyed,
never indexed; the store's tail TTL reclaims what nobody takes) and the decode takes the pieces
in order over gRPC (TakeTail; NOT_FOUND means "not yet put": poll again). So no new RPC, no
pickle: raw little-endian tensors in protobuf, as for every block.

    piece  layer  payload (uint8)                                 when
    -----  -----  ----------------------------------------------  ------------------------------
    prefix   -1   [n, block_nbytes]: whole blocks                 before compute (cached prefix)
    chunk     l   [n, layer l's bytes] (KVCacheSpec.layer_span)   after layer l of the chunk

A chunk's pieces cover the request blocks its tokens touch; a block a chunk leaves partly
filled is sent again (complete) by the next chunk, later in the same ordered stream, so the
last write wins. The stream ends with the last piece of the last chunk's last layer.

Control plane (Ray, kvstore.transport.peers): the prefill announces the stream to the decode
peer before computing; the decode reserves cache blocks and starts taking pieces at once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pdcluster.engine.core.blocks import num_blocks_for
from pdcluster.kvstore.client import KVStoreClient
from pdcluster.kvstore.errors import BlockLayoutError, BlockNotFoundError, KVStoreError
from pdcluster.kvstore.transport.base import KVReceiver, TransferState, _Cancelled
from pdcluster.kvstore.transport.dest import WIRE_DTYPES

log = logging.getLogger(__name__)

ALL_LAYERS = -1
POLL_MIN_S, POLL_MAX_S = 0.0005, 0.008  # receiver's NOT_FOUND backoff


@dataclass(frozen=True)
class LayerPiece:
    """Request blocks ``[block_start, block_start + num_blocks)`` of one layer (or of every
    layer: ``layer == ALL_LAYERS``)."""

    layer: int
    block_start: int
    num_blocks: int


@dataclass(frozen=True)
class LayerStreamAnnounce:
    """What the prefill tells the decode peer before computing (Ray control plane; handles
    only, no tensors).

    address: ``host:port`` of the prefill node's KV store, where the pieces are put.
    handle_prefix: piece i is the tail handle ``handle_prefix + str(i)``.
    pieces: the stream, in order; num_blocks: request blocks it fills (full ones + tail).
    num_prompt_tokens: prompt length (the decode reserves blocks for it plus one token).
    num_layers: the model's layers; prefill_worker_id: who to tell on an abort.
    region: over Mooncake's Transfer Engine
        (kvstore.transport.mooncake.layer_stream.StreamRegion): the pieces are written into
        this region of the prefill's registered memory instead of the store, and the decode
        reads them there; None: the store carries them.
    """

    request_id: str
    address: str
    handle_prefix: str
    pieces: tuple[LayerPiece, ...]
    num_blocks: int
    num_prompt_tokens: int
    num_layers: int
    prefill_worker_id: str
    region: Any = None

    def handle(self, index: int) -> str:
        return f"{self.handle_prefix}{index}"

    @property
    def handles(self) -> list[str]:
        return [self.handle(i) for i in range(len(self.pieces))]


def plan_pieces(num_prefix_blocks: int, chunks: list[tuple[int, int]], block_size: int,
                num_layers: int, max_blocks_per_layer: int, max_prefix_blocks: int
                ) -> tuple[LayerPiece, ...]:
    """The stream's pieces: the cached prefix (whole blocks, at most max_prefix_blocks per
    piece), then for each chunk (token range [start, end)) and layer the blocks it touches (at
    most max_blocks_per_layer per piece)."""
    pieces = [LayerPiece(ALL_LAYERS, b, min(max_prefix_blocks, num_prefix_blocks - b))
              for b in range(0, num_prefix_blocks, max_prefix_blocks)]
    for start, end in chunks:
        first, stop = start // block_size, num_blocks_for(end, block_size)
        for layer in range(num_layers):
            pieces += [LayerPiece(layer, b, min(max_blocks_per_layer, stop - b))
                       for b in range(first, stop, max_blocks_per_layer)]
    return tuple(pieces)


class LayerStreamSender:
    """Prefill side: puts pieces on the node's KV store from one background thread, in order.

    ``put(index, tensor)`` never blocks the compute thread. Thread-safe. A put that fails ends
    the stream (logged; the decode times out and retries from the store's keyed copy).
    """

    def __init__(self, client: KVStoreClient, announce: LayerStreamAnnounce) -> None:
        self.client, self.announce = client, announce
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._put: list[str] = []
        self._lock = threading.Lock()
        self.cancelled = False
        self.error: KVStoreError | None = None
        self.bytes_sent = 0
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"layer-send-{announce.request_id}")
        self._thread.start()

    def put(self, index: int, piece: torch.Tensor) -> None:
        """Queue piece ``index`` (a new contiguous tensor, owned by the sender from now on)."""
        self._queue.put((index, piece))

    def finish(self, timeout_s: float) -> bool:
        """Wait until every queued piece is on the store (or the stream failed/cancelled);
        True when all of them are."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        with self._lock:
            return not self._thread.is_alive() and self.error is None and not self.cancelled

    def cancel(self) -> None:
        """Stop putting and drop every piece put so far (idempotent; never blocks)."""
        with self._lock:
            self.cancelled = True
        self._queue.put(None)
        threading.Thread(target=self._drop, daemon=True).start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            index, piece = item
            with self._lock:
                if self.cancelled or self.error is not None:
                    continue
            try:
                self._deliver(index, piece)
            except KVStoreError as exc:
                log.warning("layer stream of %s stopped at piece %d: %s",
                            self.announce.request_id, index, exc)
                self.error = exc
                continue
            with self._lock:
                self.bytes_sent += piece.numel() * piece.element_size()
                late = self.cancelled
            if late:  # cancelled while this put was in flight
                self._drop()
        self._stopped()

    def _deliver(self, index: int, piece: torch.Tensor) -> None:
        """Piece ``index`` onto the store (subclasses: elsewhere). Raises KVStoreError."""
        self.client.put_tail(self.announce.handle(index), piece, 0)
        with self._lock:
            self._put.append(self.announce.handle(index))

    def _stopped(self) -> None:
        """The sender's thread ends: nothing more will be delivered."""

    def _drop(self) -> None:
        with self._lock:
            handles, self._put = self._put, []
        for handle in handles:
            try:
                self.client.release_tail(handle)
            except KVStoreError:
                pass  # the store's tail TTL reclaims it


class LayerStreamReceiver(KVReceiver):
    """Decode side: takes the announced pieces in order and hands each to ``write``.

    Args:
        client: gRPC client of the announce's store address.
        announce: the stream.
        write: ``write(piece, tensor)``: puts one piece into the reserved blocks (called on the
            receiver's thread, under the write guard: never after poll() returned FAILED or
            abort() returned).
        finish: called once after the last piece, before SUCCESS (e.g. flush a staging copy).
        piece_shape: ``piece_shape(piece)`` -> the payload shape expected; dtype: the cache's.
        timeout_s: the stream's deadline is this long after its start or its latest piece.

    Attributes:
        arrivals: (piece index, layer, time.time() when it landed) per piece so far.
    """

    def __init__(self, client: KVStoreClient, announce: LayerStreamAnnounce,
                 write: Callable[[LayerPiece, torch.Tensor], None], finish: Callable[[], None],
                 piece_shape: Callable[[LayerPiece], tuple[int, ...]], dtype: torch.dtype,
                 timeout_s: float) -> None:
        super().__init__()
        self._client, self.announce = client, announce
        self._write_piece, self._finish = write, finish
        self._piece_shape, self._dtype, self._timeout_s = piece_shape, dtype, timeout_s
        self.arrivals: list[tuple[int, int, float]] = []
        self.num_taken = 0

    def start(self, request=None, dest=None) -> None:
        """Begin taking pieces on a thread of its own; returns at once (the FetchRequest and
        destination of other receivers are the announce and ``write`` here)."""
        self._begin(self._timeout_s, TransferState.TRANSFERRING)
        threading.Thread(target=self._guarded, args=(self._receive,), daemon=True,
                         name=f"layer-recv-{self.announce.request_id}").start()

    def _receive(self) -> None:
        for index, piece in enumerate(self.announce.pieces):
            tensor = self._take(index)
            expected = self._piece_shape(piece)
            if tuple(tensor.shape) != expected or tensor.dtype != self._dtype:
                raise BlockLayoutError(
                    f"layer piece {index} from {self.announce.address} is "
                    f"{WIRE_DTYPES.get(tensor.dtype, tensor.dtype)} {tuple(tensor.shape)}, "
                    f"expected {WIRE_DTYPES.get(self._dtype)} {expected}")
            self._write(self._write_piece, piece, tensor)
            self.num_taken = index + 1
            self.arrivals.append((index, piece.layer, time.time()))
            self._add_bytes(tensor.numel() * tensor.element_size())
            self._extend_deadline(self._timeout_s)
        self._write(self._finish)
        self._succeed()

    def _take(self, index: int) -> torch.Tensor:
        handle, wait = self.announce.handle(index), POLL_MIN_S
        while True:
            if self._cancelled or self.poll().done:
                raise _Cancelled()
            try:
                tensor, _ = self._client.take_tail(handle, timeout_s=max(self._remaining_s(),
                                                                         0.001))
                return tensor
            except BlockNotFoundError:
                time.sleep(wait)  # not put yet
                wait = min(wait * 2, POLL_MAX_S)

    def _describe(self) -> str:
        return f"layer stream of {self.announce.request_id} from {self.announce.address}"

    def _address(self) -> str | None:
        return self.announce.address
