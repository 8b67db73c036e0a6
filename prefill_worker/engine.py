"""Prefill engine: compute a prompt's KV, sample the first token, publish the KV blocks.

Lifecycle of a request on a prefill worker (statuses: engine.core.request.RequestStatus):

1. WAITING        — checked (empty or too long prompt: PrefillRejected) and queued, first come,
                    first served (engine.core.scheduler);
2. admission      — the prompt's full blocks get chained sha256 keys; the longest prefix of
                    them cached in this worker's block pool (G1) is reused as is (at least one
                    prompt token is always computed: the first output token needs the last
                    position's logits), and blocks for the rest are allocated. A request
                    waits while too few blocks are free;
3. WAITING_FOR_KV — the next part of the prefix that G1 lacks is loaded from the cluster pool
                    (this node's G2/G3, or another node's; PrefixLoader) into its blocks, off
                    the engine loop; other requests compute meanwhile;
4. RUNNING        — the uncached suffix runs through the model in chunks; each step packs
                    chunks of several requests under max_num_batched_tokens (chunked prefill,
                    Scheduler.schedule_chunks). With --kv-streaming layer a request runs its
                    chunks in steps of its own and each layer's KV goes to the decode worker as
                    soon as that layer ran (prefill_worker/layer_streamer.py);
5. FINISHED       — output token 0 is sampled and goes to the caller at once (FirstToken);
                    the prompt's blocks are copied out, the full ones cached in G1 (their
                    events go to the global index) and the request's blocks released; off the
                    loop and the first token's path, the full blocks are published to
                    this node's G2 under their keys and the partial tail block to the node's
                    store under a per-request handle (never keyed or indexed); with
                    --kv-transfer torch, all of them are also pushed to the request's decode
                    worker over their pair channel (TorchKVPusher), in the background. Then
                    the caller gets its PrefillResult, which the decode needs. An abort or a
                    failure at any point releases every block the request held (a prefix load
                    in flight first settles: it may still write into them).

The engine runs on an engine loop (engine.core.engine_loop); its public methods are
thread-safe and talk to the loop through its inbox.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from engine.core.engine_loop import EngineInbox
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import RequestStatus
from engine.core.scheduler import Scheduler
from engine.protocol import FirstToken, PrefillRequest, PrefillResult
from engine.runner import ModelRunner, SequenceChunk
from engine.sampler import SampleInput, draw_seed, sample
from kvstore.block_pool import BlockPool
from kvstore.blocks import num_full_blocks
from kvstore.client import KVStoreClient
from kvstore.events import BlockStored
from kvstore.hashing import block_keys, make_namespace
from kvstore.index import KVIndex, Location
from kvstore.publish import BlockPublisher
from prefill_worker.kv_pusher import TorchKVPusher
from prefill_worker.layer_streamer import LayerStream, LayerStreamer, StreamCancelled
from prefill_worker.prefix_loader import LoadResult, PrefixLoader

log = logging.getLogger(__name__)


MAX_TRACKED_ABORTS = 4096
#: Seconds between checks that the global index still lists this worker's G1 blocks.
INDEX_CHECK_S = 2.0
IDLE_WAIT_S = 0.05  # engine loop sleep with nothing to run, unless woken


class PrefillRejected(ValueError):
    """The request cannot be prefilled here (empty prompt, or longer than max_model_len or
    than the whole cache)."""


class RequestAborted(RuntimeError):
    """The request was aborted before its prefill finished."""


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


@dataclass(eq=False)  # a request is itself: queues compare by identity
class PrefillSequence:
    """One request on the prefill engine (the scheduler's SchedulableRequest)."""

    request: PrefillRequest
    first: Future  # of its FirstToken
    result: Future  # of its PrefillResult
    seed: int
    block_keys: list[bytes]
    runs_alone: bool  # layer-streamed: its forward hooks must see it alone
    status: RequestStatus = RequestStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    arrival: int = 0
    num_computed_tokens: int = 0
    num_hit_blocks: int = 0  # G1 hits
    loaded: LoadResult = field(default_factory=LoadResult)
    load: Future | None = None
    stream: LayerStream | None = None
    aborted: bool = False
    began: float = field(default_factory=time.perf_counter)
    extra: dict = field(default_factory=dict)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    num_tokens = num_prompt_tokens


@dataclass
class _Finished:
    """What the publish thread needs of a request the loop has finished."""

    seq: PrefillSequence
    first_token: int
    first_logprob: Any
    data: torch.Tensor  # the prompt's blocks, copied out: [n_full (+1), *block_shape]
    num_cached: int


class PrefillEngine:
    """One prefill worker's model runner, scheduler (over its block pool) and KV publishing,
    driven by an engine loop (engine.core.engine_loop.EngineLoop)."""

    def __init__(self, runner: ModelRunner, kv: PrefillKV, worker_id: str, pid: int) -> None:
        self.runner = runner
        self.kv = kv
        self.kv_client = kv.tail_client
        self.kv_address = kv.address
        self.worker_id = worker_id
        self.pid = pid
        cfg = runner.engine_config
        self.block_size = cfg.block_size
        self.token_budget = cfg.max_num_batched_tokens
        self.max_model_len = cfg.resolved_max_model_len(runner.model_config)
        self.model_id = runner.model_config.name
        self.eos_token_ids = frozenset(runner.model_config.eos_token_ids)
        self.pool = BlockPool(cfg.num_kv_blocks, enable_caching=cfg.enable_prefix_caching)
        self.kv_manager = KVCacheManager(self.pool, self.block_size)
        # no preemption: a prefill takes every block it needs on admission
        self.scheduler: Scheduler[PrefillSequence] = Scheduler(
            self.kv_manager, None, num_lookahead_tokens=0)
        self.inbox = EngineInbox()
        # prefix loads, and publishing (index events included), each on one thread of their
        # own: in order, off the loop
        self._loads = ThreadPoolExecutor(1, thread_name_prefix="prefill-load")
        self._publishes = ThreadPoolExecutor(1, thread_name_prefix="prefill-publish")
        self._streaming: PrefillSequence | None = None  # its chunks run back to back, alone
        self._in_step: list[PrefillSequence] = []
        # ids aborted before they arrived; bounded, as aborts may name finished requests
        self._aborted: OrderedDict[str, None] = OrderedDict()
        # tails of finished prefills, by request id (bounded), so an abort can release one
        self._tails: OrderedDict[str, str] = OrderedDict()
        self._abort_lock = threading.Lock()  # _aborted and _tails: the loop and the publisher
        self._index_checked_at = 0.0
        self.g1_reannouncements_total = 0
        self.num_prefill_tokens_total = 0  # tokens run through the model
        self.num_requests_total = 0
        self.prefix_cache_queried_tokens_total = 0  # prompt tokens looked up (vLLM's "queries")
        self.prefix_cache_hit_tokens_total: Counter[str] = Counter()  # of those, by tier
        self.num_steps_total = 0
        self.num_chunks_total = 0
        self.max_chunks_per_step = 0

    # ---- called from other threads -------------------------------------------------------
    def add_request(self, request: PrefillRequest) -> tuple[Future, Future]:
        """Queue a prefill. Returns futures of its FirstToken (set once sampled) and of its
        PrefillResult (set once its KV is published). Either raises PrefillRejected or
        RequestAborted instead, the result also KVStoreError (publishing failed)."""
        first: Future = Future()
        result: Future = Future()
        self.inbox.post("add", (request, first, result))
        return first, result

    def prefill(self, request: PrefillRequest, timeout_s: float | None = None) -> PrefillResult:
        """add_request and wait for its PrefillResult (raising what it raises)."""
        return self.add_request(request)[1].result(timeout=timeout_s)

    def abort(self, request_id: str) -> None:
        """Idempotent: a request waiting or computing ends with RequestAborted and releases
        its blocks (a layer-streamed one stops at its next layer); one already prefilled, whose
        decode never took its tail (the client left at the first token), has its tail dropped
        from the node's store now rather than at the store's TTL; one not arrived yet is
        refused when it comes."""
        if self.kv.streamer is not None:
            self.kv.streamer.cancel(request_id)  # at once: the loop may be in its forward
        self.inbox.post("abort", request_id)

    def cancel_layer_stream(self, request_id: str) -> None:
        """The decode peer gave the request up: as abort()."""
        self.abort(request_id)

    def reset_prefix_cache(self) -> bool:
        """Drop every G1 key (refused while a prefill holds blocks); the index hears of it."""
        done: Future = Future()
        self.inbox.post("reset", done)
        return done.result()

    def stats(self) -> dict:
        return {"worker_id": self.worker_id, "pid": self.pid,
                **self.pool.stats(),
                "num_prefill_steps_total": self.num_steps_total,
                "num_prefill_chunks_total": self.num_chunks_total,
                "max_prefill_chunks_per_step": self.max_chunks_per_step,
                "num_prefill_tokens_total": self.num_prefill_tokens_total,
                "num_requests_total": self.num_requests_total,
                "g1_reannouncements_total": self.g1_reannouncements_total,
                "prefix_cache_queried_tokens_total": self.prefix_cache_queried_tokens_total,
                "prefix_cache_hit_tokens_total": dict(self.prefix_cache_hit_tokens_total),
                **(self.kv.pusher.stats() if self.kv.pusher is not None else {}),
                **(self.kv.streamer.stats() if self.kv.streamer is not None else {})}

    # ---- the engine loop's (engine.core.engine_loop) -------------------------------------
    def handle(self, kind: str, item) -> None:
        if kind == "add":
            self._arrive(*item)
        elif kind == "abort":
            self._abort_now(item)
        elif kind == "reset":
            ok = self.pool.reset_prefix_cache()
            self._send_events()
            item.set_result(ok)
        # "wake": a prefix load settled; the step polls it

    def step(self) -> bool:
        for seq in self.scheduler.admit():
            self._start_load(seq)
        self._poll_loads()
        chunks = self._schedule()
        if not chunks:
            return False
        self._in_step = [seq for seq, _ in chunks]
        try:
            logits = self._execute(chunks)
        except StreamCancelled:
            self._end(self._streaming, RequestAborted(self._streaming.request_id))
            self._in_step = []
            return True
        for row, (seq, _) in enumerate(chunks):
            if seq.num_computed_tokens == seq.num_prompt_tokens:
                self._finish(seq, logits[row:row + 1])
        self._in_step = []
        self._send_events()
        return True

    def idle_wait_s(self) -> float:
        return IDLE_WAIT_S  # a settling load posts a wake-up

    def fail_step(self, exc: Exception) -> None:
        for seq in self._in_step:
            if seq.status is not RequestStatus.FINISHED:  # finished ones are publishing
                self._end(seq, exc)
        self._in_step = []
        self._send_events()

    def close(self) -> None:
        for seq in list(self.scheduler.waiting) + list(self.scheduler.active.values()):
            _fail(seq, RequestAborted(f"{seq.request_id}: engine stopped"))
        for executor in (self._loads, self._publishes):
            executor.shutdown(wait=False)
        if self.kv.pusher is not None:
            self.kv.pusher.close()

    # ---- on the loop ---------------------------------------------------------------------
    def _arrive(self, request: PrefillRequest, first: Future, result: Future) -> None:
        error = self._refusal(request)
        if error is not None:
            for future in (first, result):
                future.set_exception(error)
            return
        seed = request.sampling.seed if request.sampling.seed is not None else draw_seed()
        keys = block_keys(request.prompt_token_ids, self.block_size,
                          make_namespace(self.model_id, request.cache_salt))
        if request.kv_plan is not None and list(request.kv_plan.block_keys) != keys:
            log.warning("the Conductor's block keys differ from this worker's (model name or "
                        "block size?); loading the prefix without its plan",
                        extra={"request_id": request.request_id})
            request = replace(request, kv_plan=None)
        streamed = (self.kv.streamer is not None and request.decode_peer is not None
                    and request.sampling.max_tokens != 1)  # max_tokens 1: no decode fetch
        self.scheduler.add(PrefillSequence(request, first, result, seed, keys, streamed))

    def _refusal(self, request: PrefillRequest) -> Exception | None:
        with self._abort_lock:
            if self._aborted.pop(request.request_id, False) is None:
                return RequestAborted(request.request_id)
        n = len(request.prompt_token_ids)
        if n == 0:
            return PrefillRejected("prompt is empty")
        if n > self.max_model_len:
            return PrefillRejected(f"prompt has {n} tokens, max_model_len is "
                                   f"{self.max_model_len}")
        if not self.kv_manager.fits_ever(n):
            return PrefillRejected(f"prompt needs {self.kv_manager.blocks_for(n)} KV blocks, "
                                   f"worker has {self.kv_manager.num_blocks}")
        return None

    def _abort_now(self, request_id: str) -> None:
        seq = self.scheduler.find_waiting(request_id) or self.scheduler.active.get(request_id)
        if seq is not None:
            if seq.load is not None:
                seq.aborted = True  # ended once the load settles: it may write its blocks
            else:
                self._end(seq, RequestAborted(request_id))
            return
        with self._abort_lock:
            tail_handle = self._tails.pop(request_id, None)
            if tail_handle is None:  # not arrived yet, or still publishing: refused then
                self._aborted[request_id] = None
                while len(self._aborted) > MAX_TRACKED_ABORTS:
                    self._aborted.popitem(last=False)
        if tail_handle is not None:
            self._publishes.submit(self._release_tail, tail_handle)

    def _start_load(self, seq: PrefillSequence) -> None:
        """An admitted request: load the cluster pool's part of its prefix (after its G1 hits),
        off the loop, or run at once. With the Conductor's plan, as far as the plan reuses
        and from where it says; without one, as far as the global index knows."""
        hit = seq.num_hit_blocks = seq.num_computed_tokens // self.block_size
        end = num_full_blocks(seq.num_prompt_tokens - 1, self.block_size)
        plan = seq.request.kv_plan
        locations = None
        if plan is not None:
            end = min(end, plan.num_load_blocks, len(plan.locations))
            locations = plan.locations[hit:end]
        keys = seq.block_keys[hit:end]
        if self.kv.loader is None or not keys or not self.pool.enable_caching:
            seq.status = RequestStatus.RUNNING
            return
        seq.load = self._loads.submit(self.kv.loader.load, keys, seq.block_table[hit:],
                                      locations)
        seq.load.add_done_callback(lambda _: self.inbox.post("wake"))

    def _poll_loads(self) -> None:
        for seq in list(self.scheduler.active.values()):
            if seq.load is None or not seq.load.done():
                continue
            load, seq.load = seq.load, None
            if seq.aborted:
                self._end(seq, RequestAborted(seq.request_id))
                continue
            try:
                seq.loaded = load.result()
            except Exception as exc:  # noqa: BLE001 — a failed load costs compute only
                seq.loaded = LoadResult(failures=[f"load: {exc}"])
            for failure in seq.loaded.failures:
                log.warning("prefix load cut short, recomputing the rest: %s", failure,
                            extra={"request_id": seq.request_id})
            seq.num_computed_tokens += seq.loaded.num_blocks * self.block_size
            seq.status = RequestStatus.RUNNING

    def _schedule(self) -> list[tuple[PrefillSequence, int]]:
        """This step's chunks; a layer stream that has begun runs alone to its end."""
        seq = self._streaming
        if seq is not None:
            return [(seq, min(seq.num_prompt_tokens - seq.num_computed_tokens,
                              self.token_budget))]
        chunks = self.scheduler.schedule_chunks(self.token_budget)
        if len(chunks) == 1 and chunks[0][0].runs_alone:
            self._open_stream(chunks[0][0])
        return chunks

    def _open_stream(self, seq: PrefillSequence) -> None:
        """--kv-streaming layer: announce the request's stream to its decode peer, its chunks
        planned as the steps of their own will cut them; unreachable peer: no stream."""
        start, n = seq.num_computed_tokens, seq.num_prompt_tokens
        chunks = [(s, min(n, s + self.token_budget)) for s in range(start, n, self.token_budget)]
        seq.stream = self.kv.streamer.open(seq.request_id, seq.request.decode_peer, n,
                                           seq.block_table, start, chunks)
        self._streaming = seq if seq.stream is not None else None

    def _execute(self, chunks: list[tuple[PrefillSequence, int]]) -> torch.Tensor:
        """The step's forward; advances each request's computed tokens. Returns the logits
        [len(chunks), vocab] of each chunk's last token."""
        batch = []
        for seq, n in chunks:
            start = seq.num_computed_tokens
            batch.append(SequenceChunk(seq.prompt[start:start + n], start, seq.block_table))
        if self._streaming is not None:
            self.kv.streamer.next_chunk(self._streaming.stream)
        logits = self.runner.execute(batch)
        for seq, n in chunks:
            seq.num_computed_tokens += n
            self.num_prefill_tokens_total += n
        self.num_steps_total += 1
        self.num_chunks_total += len(chunks)
        self.max_chunks_per_step = max(self.max_chunks_per_step, len(chunks))
        return logits

    def _finish(self, seq: PrefillSequence, logits: torch.Tensor) -> None:
        """The prompt is computed: sample output token 0, copy the blocks out, cache the full
        ones in G1 and release the request's blocks; publishing goes on off the loop."""
        seq.extra["compute_end_s"] = time.time()
        if self._streaming is seq:
            self.kv.streamer.end_compute(seq.stream)
            self._streaming = None
        [(token, logprob)] = sample(
            logits, [SampleInput(seq.request.sampling, seq.seed, list(seq.prompt), ())],
            self.eos_token_ids)
        seq.first.set_result(FirstToken(seq.request_id, token, logprob, self.worker_id,
                                        self.pid))
        data = self.runner.wire_kv.read_blocks(seq.block_table)  # every KV head (TP: gathered)
        hit, keys = seq.num_hit_blocks, seq.block_keys
        self.pool.cache_full_blocks(seq.block_table[hit:len(keys)], keys[hit:],
                                    keys[hit - 1] if hit else None)
        num_cached = hit * self.block_size + seq.loaded.num_blocks * self.block_size
        self.num_requests_total += 1
        self.prefix_cache_queried_tokens_total += seq.num_prompt_tokens
        self.prefix_cache_hit_tokens_total["device"] += hit * self.block_size
        self.prefix_cache_hit_tokens_total.update(seq.loaded.tokens_by_tier)
        self.scheduler.finish(seq)
        self._send_events()
        log.debug("prefill of %d tokens (%d cached) in %.1f ms", seq.num_prompt_tokens,
                  num_cached, (time.perf_counter() - seq.began) * 1e3,
                  extra={"request_id": seq.request_id})
        self._publishes.submit(self._publish, _Finished(seq, token, logprob, data, num_cached))

    def _end(self, seq: PrefillSequence, error: BaseException) -> None:
        """The request ends without a result: its stream dropped on both sides, its blocks
        released."""
        if seq.stream is not None:
            if self._streaming is seq:
                self._streaming = None
            self.kv.streamer.abandon(seq.stream)
        self.scheduler.finish(seq)
        _fail(seq, error)

    def _send_events(self) -> None:
        """The pool's G1 events to the index, off the loop, in order with publishing (a
        request's events reach the index before its caller gets the result); every
        INDEX_CHECK_S, a check that the index still lists this worker's G1 blocks."""
        if self.kv.index is None:
            self.pool.take_events()
            return
        events = self.pool.take_events()
        now = time.monotonic()
        check = now - self._index_checked_at >= INDEX_CHECK_S
        if check:
            self._index_checked_at = now
        if events or check:
            self._publishes.submit(self._apply_events, events,
                                       self.pool.cached_keys() if check else None)

    # ---- off the loop --------------------------------------------------------------------
    def _publish(self, done: _Finished) -> None:
        """Full blocks to the node's G2 by key (the store keeps one copy of a key), the tail
        by handle, the layer stream's end, the torch push; then the caller's result."""
        seq, data = done.seq, done.data
        keys = seq.block_keys
        layer_stream = None
        try:
            if keys:
                self.kv.publisher.publish(keys, data[: len(keys)])
            num_tail = seq.num_prompt_tokens - len(keys) * self.block_size
            handle = f"tail:{seq.request_id}" if num_tail else None
            if handle is not None:
                self.kv_client.put_tail(handle, data[len(keys)], num_tail)
            if seq.stream is not None:
                seq.extra.update(self.kv.streamer.timings(seq.stream))
                layer_stream = self.kv.streamer.finish(seq.stream)
        except BaseException as exc:  # noqa: BLE001 — the caller's error
            if seq.stream is not None:
                self.kv.streamer.abandon(seq.stream)
            seq.result.set_exception(exc)
            return
        if handle is not None:
            with self._abort_lock:  # an abort that came while this ran releases the tail now
                aborted = self._aborted.pop(seq.request_id, False) is None
                if not aborted:
                    self._tails[seq.request_id] = handle
                    while len(self._tails) > MAX_TRACKED_ABORTS:
                        self._tails.popitem(last=False)
            if aborted:
                self._release_tail(handle)
        pair_address, pair_tag = (None, 0) if layer_stream else self._push(seq.request, data)
        seq.result.set_result(PrefillResult(
            seq.request_id, done.first_token, self.kv_address, tuple(keys), handle, num_tail,
            done.num_cached, self.worker_id, self.pid, done.first_logprob, self.kv.node_id,
            pair_address, pair_tag, layer_stream, seq.extra))

    def _push(self, request: PrefillRequest, data: torch.Tensor) -> tuple[str | None, int]:
        """--kv-transfer torch: start pushing the prompt's blocks to the request's decode peer.
        Returns (pair address, tag), or (None, 0) when nothing is pushed: no pusher or peer,
        or max_tokens 1 (the decode finishes such a request at admission, fetching nothing)."""
        if self.kv.pusher is None or request.decode_peer is None \
                or request.sampling.max_tokens == 1:
            return None, 0
        return self.kv.pusher.push(request.decode_peer, data)

    def _release_tail(self, handle: str) -> None:
        try:
            self.kv_client.release_tail(handle)
        except Exception as exc:  # noqa: BLE001 — the store's TTL drops it anyway
            log.warning("tail %s not released: %s", handle, exc)

    def _apply_events(self, events: list, cached_keys: list[bytes] | None) -> None:
        location = Location(self.kv.node_id, "device", self.worker_id)
        try:
            if events:
                self.kv.index.apply_events(location, events)
            if cached_keys:
                self._reannounce_if_lost(location, cached_keys)
        except Exception as exc:  # noqa: BLE001 — an index outage costs hits, not requests
            log.warning("G1 events not indexed: %s", exc)

    def _reannounce_if_lost(self, location: Location, cached_keys: list[bytes]) -> None:
        """If the index lost this worker's G1 entries (Redis restarted empty, or events failed
        to reach it), announce every cached key again (index loss), found by looking one
        cached key up."""
        if location in self.kv.index.lookup(cached_keys[:1])[0]:
            return
        self.kv.index.apply_events(location, [BlockStored(tuple(cached_keys))])
        self.g1_reannouncements_total += 1


def _fail(seq: PrefillSequence, error: BaseException) -> None:
    for future in (seq.first, seq.result):
        if not future.done():
            future.set_exception(error)
