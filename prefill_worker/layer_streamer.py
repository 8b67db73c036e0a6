"""Prefill side of layer-wise KV streaming (``--kv-streaming layer``; Mooncake FAST'25 §3.1).

Per request (the prefill engine runs a streamed request's chunks back to back, in steps of
their own, so the hooks see one request):

1. open      — right before its first chunk, the cached prefix in its blocks: plan the pieces
               (kvstore.transfer.layer_stream.plan_pieces), announce the stream to the decode
               peer (Ray, kvstore.transfer.peers), queue the cached prefix's blocks;
2. compute   — a forward hook on every decoder layer copies that layer's K/V of the blocks the
               running chunk touches and queues it, right after the layer ran (the copy is the
               only work on the compute thread; the put runs on the sender's thread);
3. finish    — after the last chunk, end_compute (on the engine loop: the hooks stop seeing
               it), then finish (off the loop): wait until every piece is on the store, then
               return the announce (it goes into PrefillResult.layer_stream). A stream that could
               not be
               completed is cancelled at the decode, which then fetches the request whole.
4. abandon / cancel — a failed or aborted prefill (PrefillEngine.abort, or the decode giving
               the request up) drops every piece put and tells the decode; a cancel arriving
               mid-compute stops the forward at the next layer (RequestAborted).

Only at TP=1: a rank's cache holds only its KV heads, and a per-layer gather would have to
interleave with the forward's own collectives (the actor falls back to whole-request transfer).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from engine.runner import ModelRunner
from kvstore.client import KVStoreClient
from kvstore.blocks import num_blocks_for
from kvstore.transfer.layer_stream import (LayerStreamAnnounce, LayerStreamSender,
                                           plan_pieces)
from kvstore.transfer.peers import StreamPeers

log = logging.getLogger(__name__)

MAX_PIECE_BYTES = 16 << 20  # per put: well under the store's 64 MiB message limit


class StreamCancelled(RuntimeError):
    """The request's layer stream was cancelled while it computed (abort or decode gave up)."""


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


class LayerStreamer:
    """Streams each prefill's KV layer by layer to its decode peer; one per prefill worker.

    Args:
        runner: the worker's model runner (TP=1); a forward hook is added to each layer.
        client, address: the node's KV store (where pieces go) and its ``host:port``.
        peers: how to reach decode workers (announce, cancel).
        worker_id: this prefill worker's id (the decode tells it when it gives up).
        finish_timeout_s: how long finish() waits for the last pieces to be put.
    """

    def __init__(self, runner: ModelRunner, client: KVStoreClient, address: str,
                 peers: StreamPeers, worker_id: str, finish_timeout_s: float) -> None:
        if runner.tp.world_size != 1:
            raise ValueError("layer streaming needs a TP=1 prefill worker")
        self.runner, self.client, self.address = runner, client, address
        self.peers, self.worker_id = peers, worker_id
        self.finish_timeout_s = finish_timeout_s
        self.cache = runner.kv_cache
        self._lock = threading.Lock()
        self._active: LayerStream | None = None
        self.streams_total = 0
        self.bytes_sent_total = 0
        for index, layer in enumerate(runner.model.model.layers):
            layer.register_forward_hook(self._hook(index))

    def open(self, request_id: str, decode_id: str, num_prompt_tokens: int, blocks: list[int],
             num_cached: int, chunks: list[tuple[int, int]]) -> LayerStream | None:
        """Announce and start a stream; None when the decode peer cannot be reached."""
        bs, layers = self.cache.block_size, self.cache.num_layers
        per_layer = max(1, MAX_PIECE_BYTES // (self.cache.block_nbytes // layers))
        per_block = max(1, MAX_PIECE_BYTES // self.cache.block_nbytes)
        segments = [plan_pieces(num_cached // bs, [], bs, layers, per_layer, per_block)]
        segments += [plan_pieces(0, [chunk], bs, layers, per_layer, per_block) for chunk in chunks]
        by_chunk_layer: dict[tuple[int, int], list[int]] = {}
        index = 0
        for chunk, segment in enumerate(segments, start=-1):  # -1: the cached prefix
            for piece in segment:
                by_chunk_layer.setdefault((chunk, piece.layer), []).append(index)
                index += 1
        pieces = tuple(p for segment in segments for p in segment)
        announce = LayerStreamAnnounce(request_id, self.address, f"layer:{request_id}:", pieces,
                                       num_blocks_for(num_prompt_tokens, bs), num_prompt_tokens, layers,
                                       self.worker_id)
        if not self.peers.announce(decode_id, announce):
            return None
        stream = LayerStream(announce, decode_id, LayerStreamSender(self.client, announce),
                             list(blocks), by_chunk_layer)
        for i in by_chunk_layer.get((-1, -1), []):  # the cached prefix, whole blocks
            piece = pieces[i]
            ids = blocks[piece.block_start: piece.block_start + piece.num_blocks]
            stream.sender.put(i, self.runner.wire_kv.read_blocks(ids).cpu())
        with self._lock:
            self._active = stream
            self.streams_total += 1
        return stream

    def next_chunk(self, stream: LayerStream) -> None:
        """Call before each chunk's forward."""
        stream.chunk += 1

    def end_compute(self, stream: LayerStream) -> None:
        """Its last chunk ran: later forwards are other requests'."""
        with self._lock:
            if self._active is stream:
                self._active = None

    def finish(self, stream: LayerStream) -> LayerStreamAnnounce | None:
        """After end_compute: the announce once every piece is on the store; None (and the
        decode told to drop it) when the stream could not be completed. Blocks up to
        ``finish_timeout_s``."""
        self.end_compute(stream)
        ok = stream.sender.finish(self.finish_timeout_s)
        self.bytes_sent_total += stream.sender.bytes_sent
        if ok and not stream.cancelled:
            return stream.announce
        self.abandon(stream)
        return None

    def abandon(self, stream: LayerStream) -> None:
        """Drop the stream on both sides (failed or aborted prefill). Idempotent."""
        with self._lock:
            if self._active is stream:
                self._active = None
        stream.cancelled = True
        stream.sender.cancel()
        self.peers.cancel_at_decode(stream.decode_id, stream.announce.request_id)

    def cancel(self, request_id: str) -> bool:
        """Abort the stream of ``request_id`` if it is computing (its forward stops at the next
        layer); never blocks. True if it was."""
        with self._lock:
            stream = self._active
            if stream is None or stream.announce.request_id != request_id:
                return False
            stream.cancelled = True
        return True

    def timings(self, stream: LayerStream) -> dict:
        last = max((c for c, _ in stream.compute_end_s), default=-1)
        return {"layer_compute_end_s": [stream.compute_end_s.get((last, layer))
                                        for layer in range(self.cache.num_layers)]}

    def stats(self) -> dict:
        return {"layer_streams_total": self.streams_total,
                "layer_stream_bytes_total": self.bytes_sent_total}

    def _hook(self, layer: int):
        def after_layer(module, args, output) -> None:
            stream = self._active
            if stream is None:
                return
            if stream.cancelled:
                raise StreamCancelled(stream.announce.request_id)
            stream.compute_end_s[(stream.chunk, layer)] = time.time()
            for i in stream.by_chunk_layer.get((stream.chunk, layer), []):
                piece = stream.announce.pieces[i]
                ids = torch.tensor(stream.blocks[piece.block_start:
                                                 piece.block_start + piece.num_blocks],
                                   device=self.cache.device)
                data = torch.stack((self.cache.k[layer][ids], self.cache.v[layer][ids]), dim=1)
                stream.sender.put(i, data.cpu())
        return after_layer
