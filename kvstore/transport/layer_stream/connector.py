"""The layer stream connector (``--kv-streaming layer``; Mooncake FAST'25 §3.1): each layer's
KV goes to the decode peer while the prefill computes.

Per request (it runs alone: the engine gives its chunks steps of their own, so the per-layer
calls see one request):

1. open      — right before its first chunk (bind_connector_metadata), the cached prefix in
               its blocks: plan the pieces (kvstore.transport.layer_stream.stream.plan_pieces),
               announce the stream to the decode peer (Ray, kvstore.transport.peers), queue the
               cached prefix's blocks;
2. compute   — after every decoder layer (save_kv_layer), copy that layer's K/V of the blocks
               the running chunk touches and queue it (the copy is the only work on the
               compute thread; the put runs on the sender's thread);
3. finish    — request_finished: the last chunk ran; off the loop, wait until every piece is
               on the store, then report the announce (it goes into PrefillResult.layer_stream).
               A stream that could not be completed is cancelled at the decode, which then
               fetches the request whole;
4. abort     — a failed or aborted prefill (or the decode giving the request up) drops every
               piece put and tells the decode; an abort arriving mid-compute stops the forward
               at the next layer (StepCancelled).

Only at TP=1: a rank's cache holds only its KV heads, and a per-layer gather would have to
interleave with the forward's own collectives (the worker then transfers whole requests).

With ``--kv-transfer mooncake`` the pieces go into a leased region of the worker's
TE-registered staging buffer (kvstore.transport.mooncake.connector.RegionStreamSender), which
the decode reads over TE, instead of onto the node's store; a stream that finds the buffer full
uses the store.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pdcluster.engine.core.blocks import num_blocks_for
from pdcluster.engine.core.kv_connector import (KVConnector, KVConnectorMetadata,
                                                KVConnectorRequest, KVTransferParams, StepCancelled)
from pdcluster.kvstore.transport.context import KVConnectorContext
from pdcluster.kvstore.handoff import PrefillHandoff
from pdcluster.kvstore.transport.peers import StreamPeers
from pdcluster.kvstore.transport.layer_stream.stream import (ALL_LAYERS, LayerStreamAnnounce,
                                                             LayerStreamSender, plan_pieces)
from pdcluster.kvstore.transport.mooncake.connector import RegionStreamSender

log = logging.getLogger(__name__)

MAX_PIECE_BYTES = 16 << 20  # per put: well under the store's 64 MiB message limit


@dataclass
class LayerStream:
    """One request's stream while it computes (see the module docstring)."""

    announce: LayerStreamAnnounce
    decode_id: str
    sender: LayerStreamSender
    blocks: list[int]
    by_chunk_layer: dict[tuple[int, int], list[int]]  # (chunk, layer) -> piece indices
    chunk: int = -1
    compute_end_s: dict[tuple[int, int], float] = field(default_factory=dict)
    cancelled: bool = False
    abandoned: bool = False


class LayerStreamConnector(KVConnector):
    """Streams each prefill's KV layer by layer to its decode peer; one per prefill worker.

    Args:
        client, address: the node's KV store (where pieces go) and its ``host:port``.
        peers: how to reach decode workers (announce, cancel).
        worker_id: this prefill worker's id (the decode tells it when it gives up).
        finish_timeout_s: how long a finish waits for the last pieces to be put.
        token_budget: tokens per step; a streamed request's chunks are cut by it.
    """

    uses_layer_hooks = True

    def __init__(self, client, address: str, peers: StreamPeers, worker_id: str,
                 finish_timeout_s: float, token_budget: int, regions=None) -> None:
        self.client, self.address, self.regions = client, address, regions
        self.peers, self.worker_id = peers, worker_id
        self.finish_timeout_s, self.token_budget = finish_timeout_s, token_budget
        self._lock = threading.Lock()
        self._streams: dict[str, LayerStream] = {}
        self._opened: set[str] = set()  # tried, stream or not
        self._active: LayerStream | None = None
        self._sent: dict[str, KVTransferParams | BaseException] = {}
        self._finishes = ThreadPoolExecutor(1, thread_name_prefix="layer-stream-finish")
        self.streams_total = 0
        self.bytes_sent_total = 0

    @classmethod
    def from_context(cls, ctx: KVConnectorContext) -> LayerStreamConnector:
        return cls(ctx.store_client, ctx.store_address, ctx.peers, ctx.worker_id,
                   ctx.transfer.timeout_s, ctx.token_budget)

    def register_kv_caches(self, cache) -> None:
        """Starts the worker's TE where streams go over it. Raises KVTransferError when TE is
        missing or fails to start."""
        super().register_kv_caches(cache)
        if self.regions is not None:
            self.regions.start()

    def runs_alone(self, request: KVConnectorRequest) -> bool:
        # max_tokens 1: the decode finishes such a request at admission, fetching nothing
        return (PrefillHandoff.of(request.kv_transfer_params).decode_peer is not None
                and request.max_tokens != 1)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        stream = None
        chunks = metadata.chunks
        if len(chunks) == 1 and chunks[0].request.runs_alone:
            request, start = chunks[0].request, chunks[0].start
            if request.request_id not in self._opened:
                self._opened.add(request.request_id)
                self._open(request, start)
            stream = self._streams.get(request.request_id)
            if stream is not None:
                stream.chunk += 1
        with self._lock:
            self._active = stream

    def save_kv_layer(self, layer: int) -> None:
        stream = self._active
        if stream is None:
            return
        if stream.cancelled:
            with self._lock:
                self._active = None
            raise StepCancelled(stream.announce.request_id)
        stream.compute_end_s[(stream.chunk, layer)] = time.time()
        cache = self.cache
        for i in stream.by_chunk_layer.get((stream.chunk, layer), []):
            piece = stream.announce.pieces[i]
            ids = stream.blocks[piece.block_start:piece.block_start + piece.num_blocks]
            stream.sender.put(i, cache.read_layer(ids, layer).cpu())

    def wait_for_save(self) -> None:
        with self._lock:
            self._active = None

    def request_finished(self, request: KVConnectorRequest, block_ids: Sequence[int]
                         ) -> tuple[bool, dict | None]:
        """Streamed: the params (``layer_stream``, the announce or None when the stream could
        not be completed; ``extra.layer_compute_end_s``) once every piece is put."""
        self._opened.discard(request.request_id)
        stream = self._streams.get(request.request_id)
        if stream is None or not block_ids:  # an abort drops a stream that ended early
            return False, {}
        self._finishes.submit(self._finish, stream)
        return False, None

    def get_finished(self) -> tuple[dict[str, KVTransferParams | BaseException], dict]:
        with self._lock:
            sent, self._sent = self._sent, {}
        return sent, {}

    def abort(self, request_id: str) -> None:
        """Any thread: a stream computing now stops at its next layer; one not computing is
        dropped on both sides now."""
        self._opened.discard(request_id)
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is None:
                return
            stream.cancelled = True
            computing = self._active is stream
        if not computing:
            self._abandon(stream)

    def stats(self) -> dict:
        return {"layer_streams_total": self.streams_total,
                "layer_stream_bytes_total": self.bytes_sent_total}

    def close(self) -> None:
        self._finishes.shutdown(wait=False)

    # ---- internals --------------------------------------------------------------------------
    def _open(self, request: KVConnectorRequest, start: int) -> None:
        """Announce and start a stream, its chunks planned as the steps of their own will cut
        them; an unreachable peer: no stream (the decode fetches the request whole)."""
        cache, n = self.cache, request.num_prompt_tokens
        bs, layers = cache.block_size, cache.num_layers
        chunks = [(s, min(n, s + self.token_budget)) for s in range(start, n, self.token_budget)]
        layer_nbytes = [end - start for start, end in map(cache.spec.layer_span, range(layers))]
        per_layer = max(1, MAX_PIECE_BYTES // max(layer_nbytes))
        per_block = max(1, MAX_PIECE_BYTES // cache.block_nbytes)
        segments = [plan_pieces(start // bs, [], bs, layers, per_layer, per_block)]
        segments += [plan_pieces(0, [chunk], bs, layers, per_layer, per_block) for chunk in chunks]
        by_chunk_layer: dict[tuple[int, int], list[int]] = {}
        index = 0
        for chunk, segment in enumerate(segments, start=-1):  # -1: the cached prefix
            for piece in segment:
                by_chunk_layer.setdefault((chunk, piece.layer), []).append(index)
                index += 1
        pieces = tuple(p for segment in segments for p in segment)
        request_id = request.request_id
        decode_id = PrefillHandoff.of(request.kv_transfer_params).decode_peer
        announce = LayerStreamAnnounce(request_id, self.address, f"layer:{request_id}:", pieces,
                                       num_blocks_for(n, bs), n, layers, self.worker_id)
        lease = None
        if self.regions is not None:
            sizes = [p.num_blocks * (cache.block_nbytes if p.layer == ALL_LAYERS
                                     else layer_nbytes[p.layer]) for p in pieces]
            offsets = [0, *itertools.accumulate(sizes)]
            lease = self.regions.lease(offsets[-1], pinned=True)
            if lease is not None:
                announce = dataclasses.replace(
                    announce, region=self.regions.stream_region(lease, offsets))
        if not self.peers.announce(decode_id, announce):
            if lease is not None:
                self.regions.unpin(lease)
                self.regions.drop(lease)
            return
        blocks = list(request.block_table)
        if lease is not None:
            sender = RegionStreamSender(self.regions, lease, announce)
        else:
            sender = LayerStreamSender(self.client, announce)
        stream = LayerStream(announce, decode_id, sender, blocks, by_chunk_layer)
        for i in by_chunk_layer.get((-1, -1), []):  # the cached prefix, whole blocks
            piece = pieces[i]
            ids = blocks[piece.block_start: piece.block_start + piece.num_blocks]
            stream.sender.put(i, cache.read_blocks(ids).cpu())
        with self._lock:
            self._streams[request_id] = stream
            self.streams_total += 1

    def _finish(self, stream: LayerStream) -> None:
        ok = stream.sender.finish(self.finish_timeout_s)
        self.bytes_sent_total += stream.sender.bytes_sent
        request_id = stream.announce.request_id
        if not ok or stream.cancelled:
            self._abandon(stream)
        last = max((c for c, _ in stream.compute_end_s), default=-1)
        timings = [stream.compute_end_s.get((last, layer)) for layer in range(self.cache.num_layers)]
        with self._lock:
            self._streams.pop(request_id, None)
            self._sent[request_id] = {
                "layer_stream": None if stream.abandoned else stream.announce,
                "extra": {"layer_compute_end_s": timings}}
        self.wakeup()

    def _abandon(self, stream: LayerStream) -> None:
        """Drop the stream on both sides (failed or aborted prefill). Idempotent."""
        with self._lock:
            if stream.abandoned:
                return
            stream.abandoned = stream.cancelled = True
            if self._active is stream:
                self._active = None
            self._streams.pop(stream.announce.request_id, None)
        stream.sender.cancel()
        self.peers.cancel_at_decode(stream.decode_id, stream.announce.request_id)
