"""Prefill engine: compute a prompt's KV, sample the first token, publish the KV blocks.

Lifecycle of a request on a prefill worker:

1. the prompt's full blocks get chained sha256 keys; the longest prefix of them cached in this
   worker's block pool (G1) is reused as is — capped so at least one prompt token is computed,
   since the first output token needs the last position's logits (vLLM does the same);
2. blocks for the rest are allocated; the next part of the prefix that G1 lacks is loaded from
   the cluster pool (this node's G2/G3, or another node's) into them (PrefixLoader);
3. the uncached suffix runs through the model in chunks of at most max_num_batched_tokens
   (chunked prefill), and output token 0 is sampled; chunks of concurrent requests share
   forward steps under that token budget (prefill_worker/step_batcher.py);
4. the prompt's full blocks are published to this node's G2 under their keys, and the loaded
   and computed ones are cached in G1 (their events go to the global index); the partial tail
   block goes to the node's store under a per-request handle, never keyed or indexed; with
   --kv-transfer torch, all of the prompt's blocks are also pushed to the request's decode
   worker over their pair channel (TorchKVPusher), in the background; with --kv-streaming
   layer, each layer's KV went to the decode worker already during step 3, as soon as that
   layer ran (prefill_worker/layer_streamer.py), and nothing is pushed;
5. the request's references on its blocks are dropped — on success and on every error path;
   cached blocks stay in G1 until evicted (LRU).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.core.kv_cache_manager import KVCacheManager
from engine.protocol import PrefillRequest, PrefillResult
from engine.runner import ModelRunner, SequenceChunk
from engine.sampler import SampleInput, draw_seed, sample
from kvstore.block_pool import BlockPool
from kvstore.blocks import num_full_blocks
from kvstore.client import KVStoreClient
from kvstore.config import KVTransferConfig
from kvstore.errors import KVTransferError
from kvstore.events import BlockStored
from kvstore.hashing import block_keys, make_namespace
from kvstore.index import KVIndex, Location
from kvstore.publish import BlockPublisher
from kvstore.transfer.torch_dist import TorchKVSender
from kvstore.transfer.torch_pair import TorchPairChannel
from prefill_worker.layer_streamer import LayerStream, LayerStreamer, StreamCancelled
from prefill_worker.prefix_loader import LoadResult, PrefixLoader
from prefill_worker.step_batcher import StepBatcher

log = logging.getLogger(__name__)


MAX_TRACKED_ABORTS = 4096
#: Seconds between checks that the global index still lists this worker's G1 blocks.
INDEX_CHECK_S = 2.0


class PrefillRejected(ValueError):
    """The request cannot be prefilled here (empty or too long prompt, or no free blocks)."""


class RequestAborted(RuntimeError):
    """The request was aborted before its prefill ran."""


@dataclass
class PrefillKV:
    """Where a prefill worker's KV goes and comes from.

    tail_client / address / node_id: this node's KV store (gRPC), which decode workers reach;
    publisher: puts full blocks into the node's G2; loader: cluster-wide prefix reuse beyond G1
    (None: G1 only); index: receives G1 cache events as (node, "device", worker) locations;
    pusher: --kv-transfer torch, pushes each request's blocks to its decode peer (None: off).
    streamer: --kv-streaming layer, streams each layer's KV to the decode peer while the
        prefill computes (None: off, the decode fetches the request's KV whole).
    """

    tail_client: KVStoreClient
    address: str
    node_id: str
    publisher: BlockPublisher
    loader: PrefixLoader | None = None
    index: KVIndex | None = None
    pusher: TorchKVPusher | None = None
    streamer: LayerStreamer | None = None


class PrefillEngine:
    """Runs prefills — concurrent callers' chunks share forward steps (StepBatcher) — and
    publishes their KV."""

    def __init__(self, runner: ModelRunner, kv: PrefillKV, worker_id: str, pid: int,
                 call: Callable[..., torch.Tensor] | None = None) -> None:
        self.runner = runner
        self.kv = kv
        self.kv_client = kv.tail_client
        self.kv_address = kv.address
        self.worker_id = worker_id
        self.pid = pid
        cfg = runner.engine_config
        self.block_size = cfg.block_size
        self.max_model_len = cfg.resolved_max_model_len(runner.model_config)
        self.model_id = runner.model_config.name
        self.eos_token_ids = frozenset(runner.model_config.eos_token_ids)
        self.pool = BlockPool(cfg.num_kv_blocks, enable_caching=cfg.enable_prefix_caching)
        self.kv_manager = KVCacheManager(self.pool, self.block_size)
        self._lock = threading.Lock()  # pool, publishing, counters (not the forward)
        self._model_lock = threading.RLock()
        self.batcher = StepBatcher(runner, cfg.max_num_batched_tokens, self._model_lock, call)
        # ids aborted before their prefill ran; bounded, as aborts may name finished requests
        self._aborted: OrderedDict[str, None] = OrderedDict()
        # tails of finished prefills, by request id (bounded), so an abort can release one
        self._tails: OrderedDict[str, str] = OrderedDict()
        self._abort_lock = threading.Lock()
        self._index_checked_at = 0.0
        self.g1_reannouncements_total = 0
        self.num_prefill_tokens_total = 0  # tokens run through the model
        self.num_requests_total = 0
        self.prefix_cache_queried_tokens_total = 0  # prompt tokens looked up (vLLM's "queries")
        self.prefix_cache_hit_tokens_total: Counter[str] = Counter()  # of those, by tier

    def abort(self, request_id: str) -> None:
        """Idempotent: a request not yet started is skipped when its turn comes; one that is
        streaming its layers stops at the next layer (RequestAborted); one already prefilled,
        whose decode never took its tail (the client left at the first token), has its tail
        dropped from the node's store now rather than at the store's TTL."""
        if self.kv.streamer is not None and self.kv.streamer.cancel(request_id):
            return
        with self._abort_lock:
            tail_handle = self._tails.pop(request_id, None)
            if tail_handle is None:  # not started, or running: its own thread checks this
                self._aborted[request_id] = None
                while len(self._aborted) > MAX_TRACKED_ABORTS:
                    self._aborted.popitem(last=False)
        if tail_handle is not None:
            self._release_tail(tail_handle)

    def _release_tail(self, handle: str) -> None:
        try:
            self.kv_client.release_tail(handle)
        except Exception as exc:  # noqa: BLE001 — the store's TTL drops it anyway
            log.warning("tail %s not released: %s", handle, exc)

    def prefill(self, request: PrefillRequest) -> PrefillResult:
        """Run one request's prefill. Raises PrefillRejected, RequestAborted or KVStoreError."""
        if self.kv.streamer is None:
            return self._prefill(request)
        with self._model_lock:  # --kv-streaming layer: one request at a time (its hooks)
            return self._prefill(request)

    def _prefill(self, request: PrefillRequest) -> PrefillResult:
        prompt = list(request.prompt_token_ids)
        if not prompt:
            raise PrefillRejected("prompt is empty")
        if len(prompt) > self.max_model_len:
            raise PrefillRejected(f"prompt has {len(prompt)} tokens, max_model_len is "
                                  f"{self.max_model_len}")
        seed = request.sampling.seed if request.sampling.seed is not None else draw_seed()
        began = time.perf_counter()
        keys = block_keys(prompt, self.block_size, make_namespace(self.model_id, request.cache_salt))
        blocks: list[int] = []
        stream: LayerStream | None = None
        layer_stream, extra = None, {}
        try:
            max_hit = num_full_blocks(len(prompt) - 1, self.block_size)  # >= 1 token computed
            with self._lock:  # admission, G1 hits, allocation, cluster-pool prefix
                hit, blocks = self._allocate(request, keys, len(prompt))
                loaded = self._load_prefix(keys[len(hit):max_hit], blocks[len(hit):])
                num_cached = (len(hit) + loaded.num_blocks) * self.block_size
                chunks = self._chunks(len(prompt), num_cached)
                stream = self._open_stream(request, blocks, num_cached, chunks)
            # the forward runs outside the engine lock: concurrent prefills share steps
            logits = self._compute(prompt, chunks, blocks, stream)
            extra["compute_end_s"] = time.time()
            [(first_token, first_logprob)] = sample(
                logits, [SampleInput(request.sampling, seed, prompt, ())], self.eos_token_ids)
            with self._lock:  # publish, cache in G1, count
                tail_handle, num_tail, data = self._publish(request, prompt, keys, blocks)
                self.pool.cache_full_blocks(blocks[len(hit): len(keys)], keys[len(hit):],
                                            keys[len(hit) - 1] if hit else None)
                if stream is not None:
                    extra.update(self.kv.streamer.timings(stream))
                    stream, layer_stream = None, self.kv.streamer.finish(stream)
                self.num_prefill_tokens_total += len(prompt) - num_cached
                self.num_requests_total += 1
                self.prefix_cache_queried_tokens_total += len(prompt)
                self.prefix_cache_hit_tokens_total["device"] += len(hit) * self.block_size
                self.prefix_cache_hit_tokens_total.update(loaded.tokens_by_tier)
        except StreamCancelled:
            raise RequestAborted(request.request_id) from None
        finally:
            with self._lock:
                if stream is not None:  # failed or aborted mid-stream: dropped on both sides
                    self.kv.streamer.abandon(stream)
                self.pool.free(blocks)
                self._send_events()
        log.debug("prefill of %d tokens (%d cached) in %.1f ms", len(prompt), num_cached,
                  (time.perf_counter() - began) * 1e3, extra={"request_id": request.request_id})
        if tail_handle is not None:
            with self._abort_lock:  # an abort that came while this ran releases the tail now
                aborted = self._aborted.pop(request.request_id, False) is None
                if not aborted:
                    self._tails[request.request_id] = tail_handle
                    while len(self._tails) > MAX_TRACKED_ABORTS:
                        self._tails.popitem(last=False)
            if aborted:
                self._release_tail(tail_handle)
        pair_address, pair_tag = (None, 0) if layer_stream else self._push(request, data)
        return PrefillResult(request.request_id, first_token, self.kv_address, tuple(keys),
                             tail_handle, num_tail, num_cached, self.worker_id, self.pid,
                             first_logprob, self.kv.node_id, pair_address, pair_tag,
                             layer_stream, extra)

    def _allocate(self, request: PrefillRequest, keys: list[bytes], num_tokens: int
                  ) -> tuple[list[int], list[int]]:
        """(G1 hit blocks of the prompt's leading `keys`, all of the prompt's blocks: hits
        then new ones), referenced. Caller holds the lock. Raises RequestAborted,
        PrefillRejected (no free blocks)."""
        with self._abort_lock:
            aborted = self._aborted.pop(request.request_id, False) is None
        if aborted:
            raise RequestAborted(request.request_id)
        hit = self.kv_manager.get_computed_blocks(keys, num_tokens)  # referenced: not evictable
        blocks = list(hit)
        if not self.kv_manager.allocate_slots(blocks, num_tokens):
            self.pool.free(hit)
            num_new = self.kv_manager.blocks_for(num_tokens) - len(hit)
            raise PrefillRejected(f"prompt needs {num_new} new KV blocks, "
                                  f"{self.pool.num_free_blocks} free")
        return hit, blocks

    def _compute(self, prompt: list[int], chunks: list[tuple[int, int]], blocks: list[int],
                 stream: LayerStream | None) -> torch.Tensor:
        """The chunks through the model in order (each attends to the KV the earlier ones
        wrote); their steps are shared with concurrent prefills (StepBatcher), except a
        layer-streamed request's, whose forwards run alone (its hooks see one request).
        Returns the last chunk's last-token logits [1, vocab]."""
        if stream is not None:
            with self._model_lock:
                for start, end in chunks:
                    self.kv.streamer.next_chunk(stream)
                    logits = self.batcher.call(
                        self.runner.execute,
                        [SequenceChunk(tuple(prompt[start:end]), start, blocks)])
            return logits
        for start, end in chunks:
            logits = self.batcher.run(SequenceChunk(tuple(prompt[start:end]), start, blocks))
        return logits

    def cancel_layer_stream(self, request_id: str) -> None:
        """The decode peer gave the request up: as abort()."""
        self.abort(request_id)

    def _open_stream(self, request: PrefillRequest, blocks: list[int], num_cached: int,
                     chunks: list[tuple[int, int]]) -> LayerStream | None:
        """--kv-streaming layer: announce the request's stream to its decode peer (not for
        max_tokens 1: the decode finishes such a request at admission, fetching nothing)."""
        if self.kv.streamer is None or request.decode_peer is None \
                or request.sampling.max_tokens == 1:
            return None
        return self.kv.streamer.open(request.request_id, request.decode_peer,
                                     len(request.prompt_token_ids), blocks, num_cached, chunks)

    def _push(self, request: PrefillRequest, data: torch.Tensor) -> tuple[str | None, int]:
        """--kv-transfer torch: start pushing the prompt's blocks to the request's decode peer.
        Returns (pair address, tag), or (None, 0) when nothing is pushed: no pusher or peer,
        or max_tokens 1 (the decode finishes such a request at admission, fetching nothing)."""
        if self.kv.pusher is None or request.decode_peer is None \
                or request.sampling.max_tokens == 1:
            return None, 0
        return self.kv.pusher.push(request.decode_peer, data)

    def _publish(self, request: PrefillRequest, prompt: list[int], keys: list[bytes],
                 blocks: list[int]) -> tuple[str | None, int, torch.Tensor]:
        """Full blocks to the KV store by key (the store keeps one copy of a key), the tail by
        handle. Returns (tail handle or None, tokens in the tail, the prompt's blocks as one
        new contiguous [n_full (+1), *block_shape] tensor)."""
        data = self.runner.wire_kv.read_blocks(blocks)  # every KV head (TP: gathered)
        if keys:
            self.kv.publisher.publish(keys, data[: len(keys)])
        num_tail = len(prompt) - len(keys) * self.block_size
        if num_tail == 0:
            return None, 0, data
        handle = f"tail:{request.request_id}"
        self.kv_client.put_tail(handle, data[len(keys)], num_tail)
        return handle, num_tail, data

    def _chunks(self, num_tokens: int, start: int) -> list[tuple[int, int]]:
        """Token ranges [start, end) of the chunks of at most max_num_batched_tokens that
        compute positions start.. (vLLM's chunked prefill)."""
        budget = self.runner.engine_config.max_num_batched_tokens
        return [(s, min(num_tokens, s + budget)) for s in range(start, num_tokens, budget)]

    def reset_prefix_cache(self) -> bool:
        """Drop every G1 key (refused while a prefill holds blocks); the index hears of it."""
        with self._lock:
            ok = self.pool.reset_prefix_cache()
            self._send_events()
            return ok

    def _load_prefix(self, keys: list[bytes], dest_blocks: list[int]):
        """Cluster-pool part of the prefix (after the G1 hits) into dest_blocks."""
        if self.kv.loader is None or not keys or not self.pool.enable_caching:
            return LoadResult()
        result = self.kv.loader.load(keys, dest_blocks)
        for failure in result.failures:
            log.warning("prefix load cut short, recomputing the rest: %s", failure)
        return result

    def _send_events(self) -> None:
        events = self.pool.take_events()
        if self.kv.index is None:
            return
        location = Location(self.kv.node_id, "device", self.worker_id)
        try:
            if events:
                self.kv.index.apply_events(location, events)
            self._reannounce_if_lost(location)
        except Exception as exc:  # noqa: BLE001 — an index outage costs hits, not requests
            log.warning("G1 events not indexed: %s", exc)

    def _reannounce_if_lost(self, location: Location) -> None:
        """If the index lost this worker's G1 entries (Redis restarted empty, or events failed
        to reach it), announce every cached key again (index loss). Checked at most
        every INDEX_CHECK_S, by looking one cached key up."""
        now = time.monotonic()
        if now - self._index_checked_at < INDEX_CHECK_S:
            return
        self._index_checked_at = now
        keys = self.pool.cached_keys()
        if not keys or location in self.kv.index.lookup(keys[:1])[0]:
            return
        self.kv.index.apply_events(location, [BlockStored(tuple(keys))])
        self.g1_reannouncements_total += 1

    def stats(self) -> dict:
        return {"worker_id": self.worker_id, "pid": self.pid,
                **self.pool.stats(), **self.batcher.stats(),
                "num_prefill_tokens_total": self.num_prefill_tokens_total,
                "num_requests_total": self.num_requests_total,
                "g1_reannouncements_total": self.g1_reannouncements_total,
                "prefix_cache_queried_tokens_total": self.prefix_cache_queried_tokens_total,
                "prefix_cache_hit_tokens_total": dict(self.prefix_cache_hit_tokens_total),
                **(self.kv.pusher.stats() if self.kv.pusher is not None else {}),
                **(self.kv.streamer.stats() if self.kv.streamer is not None else {})}


class TorchKVPusher:
    """--kv-transfer torch, prefill side: one pair channel (rank 0) per decode peer, and one
    TorchKVSender per request (kvstore.transfer.torch_dist).

    Pair bootstrap: a peer's channel is opened — its own TCPStore bound on a free port of
    ``transfer.bind_host``, which is quick and never waits for the peer — on the peer's first
    request; its address reaches the decode in PrefillResult.pair_address over Ray, and the
    decode joins as rank 1 when it starts receiving that request; the group forms then (both
    within ``transfer.timeout_s``). A channel a failed send closed is kept (a posted send may
    still read its tensor; torch cannot cancel it) and replaced on the peer's next request by
    a new pair at a new address. Tags: a counter per channel.

    Args:
        transfer: bind_host, timeout_s (pair setup), token, max_chunk_bytes (per send).
        send_deadline_s: how long a request's blocks wait to be received: the decode posts its
            receive only once it has reserved cache blocks for the request.
        device: "cpu" (gloo) or "cuda" (NCCL): where the pushed blocks are.
    """

    def __init__(self, transfer: KVTransferConfig, send_deadline_s: float, device: str) -> None:
        self.transfer = transfer
        self.send_deadline_s = send_deadline_s
        self.device = device
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[TorchPairChannel, itertools.count]] = {}
        self._retired: list[TorchPairChannel] = []
        self.pairs_opened_total = 0
        self.pushes_total = 0

    def push(self, peer: str, blocks: torch.Tensor) -> tuple[str | None, int]:
        """Start sending ``blocks`` [n, *block_shape] (contiguous, kept until sent) to ``peer``.
        Returns (pair address, tag); (None, 0) if no pair store could be bound (logged: the
        decode then pulls from the KV store)."""
        with self._lock:
            entry = self._channels.get(peer)
            if entry is None or entry[0].closed:
                if entry is not None:
                    self._retired.append(entry[0])
                try:
                    channel = TorchPairChannel(
                        0, self.transfer.bind_host, 0, timeout_s=self.transfer.timeout_s,
                        device=self.device, token=self.transfer.token,
                        chunk_bytes=self.transfer.max_chunk_bytes)
                except KVTransferError as exc:
                    log.warning("no KV pair channel for %s, it pulls from the store: %s",
                                peer, exc)
                    return None, 0
                entry = self._channels[peer] = (channel, itertools.count())
                self.pairs_opened_total += 1
            channel, tags = entry
            tag = next(tags) % 2**31
            self.pushes_total += 1
        TorchKVSender(channel).start(blocks, tag, self.send_deadline_s)
        return channel.address, tag

    def stats(self) -> dict:
        return {"kv_pairs_opened_total": self.pairs_opened_total,
                "kv_pushes_total": self.pushes_total}

    def close(self) -> None:
        with self._lock:
            channels = [c for c, _ in self._channels.values()] + self._retired
            self._channels, self._retired = {}, []
        for channel in channels:
            channel.close()
