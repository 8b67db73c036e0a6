"""Decode engine: continuous batching over KV blocks pulled from the prefill side.

Lifecycle of a request on a decode worker:

1. WAITING        — received after prefill, with the prefill's first token and KV handles
                    (a request that its first token already ends, or that could never fit in
                    this worker's cache, ends on arrival).
2. admission      — first come, first served (engine.core.scheduler): blocks for the prompt
                    and the first fed token are taken from this worker's paged cache through
                    its KV cache manager; more are added one at a time as the request grows.
3. WAITING_FOR_KV — the prompt's KV comes into the reserved blocks through the KV connector
                    (kvstore.connector.fetch): pushed by the prefill over a torch.distributed pair
                    (--kv-transfer torch), else pulled from the prefill node's KV store (arena
                    on the same node, gRPC otherwise); with --kv-streaming layer the blocks
                    were reserved when the prefill announced the request and its layers land
                    while the prefill computes (kv_streams.py), so this state may be short.
                    The engine loop polls the connector once per iteration, never blocks on
                    it. A fetch that fails after its one retry goes back to the scheduler with
                    num_computed_tokens at its cached blocks: the rest of its prompt is
                    computed here, into the same blocks, as a colocated prompt is.
4. RUNNING        — joins the batch at the next step; each step feeds the last token of every
                    running request (one forward token each), samples the next, streams it.
                    A request whose KV is behind catches up first (num_computed_tokens up to
                    all its tokens but the last): colocated (it skips WAITING_FOR_KV), after
                    a failed fetch, or resumed after preemption by recompute. It runs in
                    chunks of at most max_num_batched_tokens that share the steps' forwards
                    with the decoding requests (the scheduler's chunked prefill); a new
                    prompt's last chunk samples its output token 0.
   PREEMPTED      — when a growing request finds no free block, the newest running request
                    is preempted (its blocks freed, then caught up again, or swapped to host
                    memory: the scheduler's preemption policy, engine.core.preemption) and
                    waits at the head of the queue to resume, output intact.
5. FINISHED       — EOS / stop id / max_tokens / max_model_len, abort, or a failed fetch; every
                    block it held goes back to the pool in the same loop iteration (an abort
                    during a fetch: once the connector reports it settled, see KVFetch.abort).
                    Then, after its last token went out and before this thread allocates
                    again, a sequence that ended normally has the full blocks of its prompt
                    and output that no prefill published copied out for the KV pool (the
                    publish connector, kvstore.connector.publish): a conversation's next turn
                    reuses the reply. Aborted and failed sequences publish nothing more
                    (with a publish interval, the whole blocks a running sequence put
                    earlier stay).

Prefix cache (with EngineConfig.enable_prefix_caching, as on prefill): the full blocks of a
normally finished sequence (prompt and output) stay cached in this worker's pool, keyed as the
prefill keys them, and so do a prompt's blocks once its KV landed or was computed here. Running
sequences come first: a cached block is one whose sequence ended, on the free queue's LRU
order, and any allocation may evict it; nothing is set aside for the cache. A new request's
admission takes the cached blocks of its prompt's leading keys: a prompt computed here
(colocated) starts after them, and a prompt coming from a prefill fetches only the blocks after
them (incremental transfer) when it comes by the store path — a pushed transfer (torch pair,
Mooncake region, layer stream) brings the whole prompt, as the prefill sent it before this
worker was asked. The cache's events go to the global index as this worker's device tier, so
the Conductor sees which decode holds a conversation's previous turn.

The statuses are engine.core.request.RequestStatus. The engine runs on an engine loop
(engine.core.engine_loop: the thread that built the model; never the actor's event loop, which
a forward would block for every other call); requests and aborts reach it through its inbox, and tokens leave through
each request's `emit` callback.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from decode_worker.kv_streams import PendingStreams
from engine.core.block_pool import BlockPool
from engine.core.engine_loop import EngineInbox
from engine.core.hashing import block_keys, make_namespace
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_connector import KVConnector, KVLoadFailurePolicy, LoadOutcome
from engine.core.preemption import PREEMPTION_MODES
from engine.core.request import RequestStatus
from engine.core.scheduler import Scheduler
from engine.protocol import (KV_LOAD_FAILED, DecodeRequest, FinishReason, KVTransferParams,
                             TokenDelta, TokenLogprob)
from engine.runner import ModelRunner, SequenceChunk
from engine.sampler import SampleInput, draw_seed, sample
from kvstore.connector.fetch import FetchConnector, KVFetch
from kvstore.index import KVIndex, Location
from kvstore.index.device_feed import DeviceCacheFeed
from kvstore.transfer.layer_stream import LayerStreamAnnounce
from kvstore.transfer.peers import StreamPeers

log = logging.getLogger(__name__)


@dataclass(eq=False)  # a request is itself: queues compare by identity
class DecodeSequence:
    request: DecodeRequest
    emit: Callable[[TokenDelta], None]
    seed: int
    output_ids: list[int]
    status: RequestStatus = RequestStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_forward_tokens: int = 0
    aborted: bool = False
    arrival: int = 0
    swapped: torch.Tensor | None = None  # host copy of the KV of a request preempted by swap
    # the scheduler's prefix-cache and chunking fields: block_keys are the prompt's full-block
    # keys its admission looks up in this worker's cache (empty: nothing is looked up);
    # num_computed_tokens counts the hits, then the prompt's chunks computed or landed. When
    # the sequence ends normally, block_keys become the keys of all its full KV blocks
    block_keys: tuple[bytes, ...] = ()
    # the prompt's full-block keys, cached once its KV is all there (empty: no prefix cache)
    prompt_keys: tuple[bytes, ...] = ()
    num_computed_tokens: int = 0
    runs_alone: bool = False
    # prompt tokens admission found in this worker's cache (not fetched, not computed)
    num_cached_tokens: int = 0
    # leading full blocks handed to the publisher while running (a publish interval)
    num_published_blocks: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.output_ids)

    @property
    def max_tokens(self) -> int:
        return self.request.sampling.max_tokens

    @property
    def kv_transfer_params(self) -> KVTransferParams | None:
        """The prefill's hand-off (None: colocated, the prompt is computed here)."""
        prefill = self.request.prefill
        return prefill.kv_transfer_params if prefill is not None else None

    @property
    def token_ids(self) -> list[int]:
        """Prompt and output tokens so far."""
        return [*self.request.prompt_token_ids, *self.output_ids]

    def kv_token_ids(self) -> list[int]:
        """The tokens whose KV the request holds: all but the last output token (the next
        step feeds that one); before its first output token, the prompt's computed chunks."""
        if not self.output_ids:
            return list(self.request.prompt_token_ids[:self.num_computed_tokens])
        return list(self.request.prompt_token_ids) + self.output_ids[:-1]


STEP_LOG_SIZE = 4096
IDLE_WAIT_S = 0.02  # engine loop sleep with nothing to run, unless woken
INDEX_BATCH_S = 0.1  # the prefix cache's events go to the index at most this often
FETCH_POLL_S = 0.002  # ... while a KV fetch is in flight (fetches are polled, not awaited)


class DecodeEngine:
    """One decode worker's model runner and scheduler (over its block pool), driven by an
    engine loop (engine.core.engine_loop.EngineLoop); its public methods are thread-safe.

    step_log: the request ids of each of the last STEP_LOG_SIZE decode steps, as
    (step number, ids) — which requests shared a batch, and when each joined and left.
    kv_timings: per request (the last STEP_LOG_SIZE fetched ones): when its fetch started and
    when it was admitted to run (time.time()), the paths tried, a layer stream's per-piece
    arrivals, whether the prompt was recomputed, and the PrefillResult's extra.
    peers: how to tell a prefill its layer stream is no longer wanted (None: nobody).
    kv_load_failure_policy: a fetch that failed for good is recomputed here ("recompute") or
        ends the request with error_code KV_LOAD_FAILED ("fail"); both are counted in
        stats()["kv_load_failures_total"] by action (KVTransferConfig.load_failure_policy).
    publisher: the connector a normally ended sequence's blocks go out through
        (kvstore.connector.publish.PublishConnector); None: nothing is published.
    publish_interval: with a publisher, a running sequence's blocks also go out every this
        many full blocks (KVTransferConfig.decode_publish_interval; 0: at the end only).
    index / node_id: where the prefix cache's events go, as (node_id, "device", worker_id);
        None: the cache works unindexed.
    incremental_transfer: a prompt from a prefill starts after the blocks cached here
        (KVTransferConfig.incremental_transfer); off, it comes whole.
    prefix_loader: loads the cached prefix of a prompt computed here (colocated, or kept
        local by the PD decider) from the KV pool after this worker's own hits, as a prefill
        loads its prompts' (kvstore.connector.pool.PoolLoadConnector); None: only this
        worker's cache is looked up.
    """

    def __init__(self, runner: ModelRunner, worker_id: str, pid: int,
                 connector: FetchConnector, peers: StreamPeers | None = None,
                 kv_load_failure_policy: str = "recompute",
                 publisher: KVConnector | None = None, index: KVIndex | None = None,
                 node_id: str = "local-node", incremental_transfer: bool = True,
                 publish_interval: int = 0, prefix_loader: KVConnector | None = None) -> None:
        self.kv_load_failures = KVLoadFailurePolicy(kv_load_failure_policy)
        self.runner = runner
        self.worker_id = worker_id
        self.pid = pid
        cfg = runner.engine_config
        self.block_size = cfg.block_size
        self.max_model_len = cfg.resolved_max_model_len(runner.model_config)
        self.max_num_batched_tokens = cfg.max_num_batched_tokens
        self.eos_token_ids = frozenset(runner.model_config.eos_token_ids)
        self.pool = BlockPool(cfg.num_kv_blocks, enable_caching=cfg.enable_prefix_caching,
                              run_window=cfg.resolved_block_run_window())
        self.incremental_transfer = incremental_transfer
        self.kv = KVCacheManager(self.pool, self.block_size)
        self._index_events = ThreadPoolExecutor(1, thread_name_prefix="decode-events")
        self._g1_feed = DeviceCacheFeed(self.pool, index, Location(node_id, "device", worker_id),
                                        self._index_events, min_interval_s=INDEX_BATCH_S)
        # prompts computed here: tokens looked up, and found, in this worker's cache
        self.prefix_cache_queried_tokens_total = 0
        self.prefix_cache_hit_tokens_total: Counter[str] = Counter({"device": 0})
        # prompts from a prefill: blocks found here, so not fetched
        self.kv_blocks_reused_total = 0
        self.scheduler: Scheduler[DecodeSequence] = Scheduler(
            self.kv, PREEMPTION_MODES[cfg.preemption_mode](self.kv, runner.wire_kv))
        self.num_fetch_recomputes_total = 0
        self._num_fetch_recomputed_tokens = 0
        self.connector = connector
        connector.register_kv_caches(runner.wire_kv)
        self.publisher = publisher
        self.publish_interval = publish_interval if publisher is not None else 0
        if publisher is not None:
            publisher.register_kv_caches(runner.wire_kv)
        self.model_id = runner.model_config.name
        self.inbox = EngineInbox()
        self.prefix_loader = prefix_loader
        if prefix_loader is not None:
            prefix_loader.register_kv_caches(runner.wire_kv)
            prefix_loader.wakeup = lambda: self.inbox.post("wake")
        self.num_forward_tokens_total = 0
        self.num_steps_total = 0
        self.step_log: deque[tuple[int, tuple[str, ...]]] = deque(maxlen=STEP_LOG_SIZE)
        self.kv_timings: OrderedDict[str, dict] = OrderedDict()
        self.streams = PendingStreams(self.scheduler, connector, self._start_waiting_for_kv,
                                      peers, orphan_s=connector.transfer.timeout_s)
        self.num_fetch_retries_total = 0

    # ---- called from other threads -------------------------------------------------------
    def add_request(self, request: DecodeRequest, emit: Callable[[TokenDelta], None]) -> None:
        seed = request.sampling.seed if request.sampling.seed is not None else draw_seed()
        first = [request.prefill.first_token] if request.prefill is not None else []
        self.inbox.post("add", DecodeSequence(request, emit, seed, first))

    def abort(self, request_id: str) -> None:
        """Idempotent: an unknown or finished request id is ignored."""
        self.inbox.post("abort", request_id)

    def expect_layer_stream(self, announce: LayerStreamAnnounce) -> None:
        """A prefill is about to stream this request's layers here (kv_streams.py)."""
        self.inbox.post("expect", announce)

    def cancel_layer_stream(self, request_id: str) -> None:
        """The prefill gave up an announced stream: drop it unless its request came."""
        self.inbox.post("cancel", request_id)

    @property
    def num_recomputed_tokens_total(self) -> int:
        """Tokens run through the model again here: preempted requests resumed by recompute
        and prompts recomputed after a failed fetch."""
        return (self.scheduler.preemption.num_recomputed_tokens_total
                + self._num_fetch_recomputed_tokens)

    def stats(self) -> dict:
        return {
            "worker_id": self.worker_id,
            "pid": self.pid,
            "num_waiting": len(self.scheduler.waiting),
            "num_active": len(self.scheduler.active),
            **self.pool.stats(),
            "num_forward_tokens_total": self.num_forward_tokens_total,
            "num_steps_total": self.num_steps_total,
            "num_preemptions_total": self.scheduler.num_preemptions_total,
            "num_recomputed_tokens_total": self.num_recomputed_tokens_total,
            **self.connector.stats(),
            **(self.publisher.stats() if self.publisher is not None else {}),
            **(self.prefix_loader.stats() if self.prefix_loader is not None else {}),
            "num_pending_layer_streams": len(self.streams),
            "num_fetch_retries_total": self.num_fetch_retries_total,
            "num_fetch_recomputes_total": self.num_fetch_recomputes_total,
            "kv_load_failures_total": dict(self.kv_load_failures.failures_total),
            "prefix_cache_queried_tokens_total": self.prefix_cache_queried_tokens_total,
            "prefix_cache_hit_tokens_total": dict(self.prefix_cache_hit_tokens_total),
            "kv_blocks_reused_total": self.kv_blocks_reused_total,
            "g1_reannouncements_total": self._g1_feed.reannouncements_total,
        }

    # ---- the engine loop's (engine.core.engine_loop) -----------------------------------------
    def close(self) -> None:
        self._index_events.shutdown(wait=False)
        self.connector.close()
        for connector in (self.publisher, self.prefix_loader):
            if connector is not None:
                connector.close()

    def handle(self, kind: str, item) -> None:
        if kind == "add":
            self._arrive(item)
        elif kind == "expect":
            self.streams.expect(item)
        elif kind == "cancel":
            if self.scheduler.find_waiting(item) is None:
                self.streams.drop(item)
        elif kind == "abort":
            self._abort_now(item)
        # "wake": a connector settled something; the step polls it

    def step(self) -> bool:
        self.streams.poll()
        self.streams.attach_waiting()
        self._admit_waiting()
        self._poll_fetches()
        self._poll_prefix_loads()
        running = self.scheduler.grow()
        if not running:
            self._g1_feed.send()  # what a batch interval held back
            return False
        # caught up but for its last output token, which this step feeds
        decoding = [s for s in running
                    if s.output_ids and s.num_computed_tokens == s.num_tokens - 1]
        self._step(decoding, self.scheduler.schedule_chunks(self.max_num_batched_tokens))
        self._g1_feed.send()
        return True

    def idle_wait_s(self) -> float:
        # KV on its way is polled, not awaited (a prefix load from the pool wakes the loop)
        fetching = len(self.streams) or any(
            s.status is RequestStatus.WAITING_FOR_KV for s in self.scheduler.active.values())
        return FETCH_POLL_S if fetching else IDLE_WAIT_S

    def fail_step(self, exc: Exception) -> None:
        for seq in list(self.scheduler.active.values()):
            if seq.status is RequestStatus.RUNNING:
                self._finish(seq, FinishReason.ERROR, "internal error in decode step")

    def _arrive(self, seq: DecodeSequence) -> None:
        """Queue a new request, unless it ends here and now: its first token (from the
        prefill) already stops it, or it could never fit in this worker's cache."""
        finish, error = (self._check_stop(seq) if seq.output_ids else None), None
        most = min(seq.num_prompt_tokens + seq.request.sampling.max_tokens, self.max_model_len)
        if finish is None and not self.kv.fits_ever(most):
            finish = FinishReason.ERROR
            error = (f"request needs up to {self.kv.blocks_for(most)} KV blocks, worker has "
                     f"{self.kv.num_blocks}")
        if finish is None:
            if self.pool.enable_caching:
                namespace = make_namespace(self.model_id, seq.request.cache_salt)
                seq.prompt_keys = tuple(block_keys(seq.request.prompt_token_ids,
                                                   self.block_size, namespace))
            seq.block_keys = seq.prompt_keys if self._looks_up_prefix(seq) else ()
            self.scheduler.add(seq)
            return
        self.streams.drop(seq.request_id)  # a stream announced for it is not needed
        self.connector.request_finished(seq, ())  # it never fetched: its tail, pushed KV go
        seq.status = RequestStatus.FINISHED
        seq.emit(self._delta(seq, (), finish, error))

    def _looks_up_prefix(self, seq: DecodeSequence) -> bool:
        """Whether admission takes the prompt's blocks cached here: always for a prompt this
        worker computes; for one from a prefill, with incremental transfer on and unless the
        connector writes the whole prompt anyway (it sent it before this worker was asked)."""
        if seq.request.prefill is None:
            return True
        return self.incremental_transfer and self.connector.allows_local_prefix(seq)

    def _cache_prompt(self, seq: DecodeSequence) -> None:
        """The prompt's full blocks, whose KV is now all there, become prefix-cache entries
        (those that were hits already are)."""
        self._cache(seq, seq.prompt_keys)

    def _cache(self, seq: DecodeSequence, keys: Sequence[bytes]) -> None:
        """The first len(keys) blocks of seq's table become prefix-cache entries under `keys`;
        a refusal (a block holding another key: a bug) costs hits, never the request."""
        if not (self.pool.enable_caching and keys):
            return
        try:
            self.pool.cache_full_blocks(seq.block_table[:len(keys)], keys)
        except ValueError:
            log.exception("caching the blocks of %s failed", seq.request_id,
                          extra={"request_id": seq.request_id})

    def _abort_now(self, request_id: str) -> None:
        self.streams.drop(request_id, tell_prefill=True)
        seq = self.scheduler.find_waiting(request_id)
        if seq is not None:
            if seq.status is not RequestStatus.PREEMPTED:  # it never fetched
                self.connector.request_finished(seq, ())
            self._finish(seq, FinishReason.ABORT)
            return
        seq = self.scheduler.active.get(request_id)
        if seq is None:
            return
        if seq.status is RequestStatus.WAITING_FOR_KV:
            seq.aborted = True  # ended once the connector reports its fetch settled
            self.connector.abort(request_id)
        else:
            self._finish(seq, FinishReason.ABORT)

    def _start_waiting_for_kv(self, seq: DecodeSequence, fetch: KVFetch | None = None) -> None:
        """The request's KV is on its way (a stream announced before it came: ``fetch``)."""
        self.streams.seen(seq.request_id)
        if fetch is not None:
            self.connector.adopt(seq, fetch)
        started = fetch.started_s if fetch is not None else time.time()
        self.kv_timings[seq.request_id] = {"fetch_start_s": started,
                                           "prefill_extra": dict(seq.request.prefill.extra)}
        while len(self.kv_timings) > STEP_LOG_SIZE:
            self.kv_timings.popitem(last=False)

    def _admit_waiting(self) -> None:
        """New requests the scheduler admits start their KV: computed here when colocated,
        else fetched from the prefill side (or taken from its layer stream)."""
        for seq in self.scheduler.admit():
            seq.num_cached_tokens = seq.num_computed_tokens  # the scheduler's prefix hits
            n, _ = self.connector.get_num_new_matched_tokens(seq, seq.num_computed_tokens)
            if not n:  # computed here: after what the pool holds, in the next steps' chunks
                self.prefix_cache_queried_tokens_total += seq.num_prompt_tokens
                self.prefix_cache_hit_tokens_total["device"] += seq.num_cached_tokens
                seq.status = self._plan_prefix_load(seq)
                continue
            self.kv_blocks_reused_total += seq.num_cached_tokens // self.block_size
            self.connector.update_state_after_alloc(seq, seq.block_table, n)
            self._start_waiting_for_kv(seq)
        self.connector.start_load_kv()
        if self.prefix_loader is not None:
            self.prefix_loader.start_load_kv()

    def _plan_prefix_load(self, seq: DecodeSequence) -> RequestStatus:
        """A prompt computed here waits for the part of its prefix the pool holds after this
        worker's hits (RequestStatus.WAITING_FOR_KV), or runs at once."""
        if self.prefix_loader is None or not self.pool.enable_caching:
            return RequestStatus.RUNNING
        n, is_async = self.prefix_loader.get_num_new_matched_tokens(seq,
                                                                     seq.num_computed_tokens)
        self.prefix_loader.update_state_after_alloc(seq, seq.block_table, n)
        if n and not is_async:
            seq.num_computed_tokens += n
            seq.num_cached_tokens += n
            n = 0
        return RequestStatus.WAITING_FOR_KV if n else RequestStatus.RUNNING

    def _poll_prefix_loads(self) -> None:
        """Prefixes that landed from the pool: the request runs from what landed (a load cut
        short leaves the rest to compute here)."""
        if self.prefix_loader is None:
            return
        for seq, outcome in self._settled(self.prefix_loader.get_finished()[1]):
            if self._load_ended(seq, outcome):
                continue
            for failure in outcome.failures:
                log.warning("prefix load cut short, computing the rest here: %s", failure,
                            extra={"request_id": seq.request_id})
            seq.num_computed_tokens += outcome.num_tokens
            seq.num_cached_tokens += outcome.num_tokens
            self.prefix_cache_hit_tokens_total.update(outcome.tokens_by_tier)
            seq.status = RequestStatus.RUNNING

    def _settled(self, loaded: dict[str, LoadOutcome]):
        """(request, outcome) of each settled load whose request is still here."""
        for request_id, outcome in loaded.items():
            seq = self.scheduler.active.get(request_id)
            if seq is not None:
                yield seq, outcome

    def _load_ended(self, seq: DecodeSequence, outcome: LoadOutcome) -> bool:
        """Whether the request ends with its settled load: aborted meanwhile, or the load
        failed under --kv-load-failure-policy fail (error_code KV_LOAD_FAILED); a failure
        is counted either way, and under "recompute" what did not land is computed here."""
        if seq.aborted:
            self._finish(seq, FinishReason.ABORT)
            return True
        if not outcome.failures or not self.kv_load_failures.record():
            return False
        failure = outcome.failures[0]
        log.warning("KV load of %s failed, ending the request (--kv-load-failure-policy fail): "
                    "%s", seq.request_id, failure, extra={"request_id": seq.request_id})
        self._finish(seq, FinishReason.ERROR, f"KV load failed: {failure}",
                     error_code=KV_LOAD_FAILED)
        return True

    def _poll_fetches(self) -> None:
        for seq, outcome in self._settled(self.connector.get_finished()[1]):
            self.num_fetch_retries_total += len(outcome.detail["paths"]) - 1
            timings = self.kv_timings.get(seq.request_id, {})
            timings.update(outcome.detail)
            if self._load_ended(seq, outcome):
                continue
            if outcome.failures:
                log.warning("KV fetch of %s failed, recomputing the prompt here: %s",
                            seq.request_id, outcome.failures[0],
                            extra={"request_id": seq.request_id})
                self._reschedule_prompt(seq)
                timings["recomputed"] = True
            else:
                seq.num_computed_tokens = seq.num_prompt_tokens
                self._cache_prompt(seq)
            seq.status = RequestStatus.RUNNING
            timings["admitted_s"] = time.time()

    def _reschedule_prompt(self, seq: DecodeSequence) -> None:
        """A KV fetch failed for good (after its retry): the prompt after the blocks admission
        found cached here (their KV is there, and they may be shared) is computed here instead,
        in chunks under the token budget beside the running batch, into the same blocks; its
        output so far is kept (output token 0 came from the prefill)."""
        seq.num_computed_tokens = seq.num_cached_tokens
        self.num_fetch_recomputes_total += 1
        self._num_fetch_recomputed_tokens += seq.num_prompt_tokens - seq.num_cached_tokens

    def _step(self, decoding: list[DecodeSequence],
              prefills: list[tuple[DecodeSequence, int]]) -> None:
        """One forward: the last token of every decoding request, and this step's chunks of
        the requests catching up (a colocated prompt, a prompt whose fetch failed, a request
        resumed after preemption by recompute). A new prompt's last chunk samples its output
        token 0."""
        chunks = [SequenceChunk((s.output_ids[-1],), s.num_tokens - 1, s.block_table)
                  for s in decoding]
        for seq, n in prefills:
            start = seq.num_computed_tokens
            chunks.append(SequenceChunk(tuple(seq.token_ids[start:start + n]), start,
                                        seq.block_table))
        logits = self.runner.execute(chunks)
        for seq in decoding:
            seq.num_computed_tokens += 1
        for seq, n in prefills:
            before = seq.num_computed_tokens
            seq.num_computed_tokens += n
            if before < seq.num_prompt_tokens <= seq.num_computed_tokens:
                self._cache_prompt(seq)
        # every decoding request, then the new prompts this step completed, in chunk order
        done = [(row, seq) for row, (seq, _) in enumerate(prefills, len(decoding))
                if seq.num_computed_tokens == seq.num_tokens]
        rows = [*range(len(decoding)), *(row for row, _ in done)]
        sampling = decoding + [seq for _, seq in done]
        inputs = [SampleInput(s.request.sampling, s.seed, s.request.prompt_token_ids,
                              s.output_ids) for s in sampling]
        sampled = sample(logits[rows], inputs, self.eos_token_ids) if sampling else []
        if decoding:
            self.num_steps_total += 1
            self.num_forward_tokens_total += len(decoding)
            self.step_log.append((self.num_steps_total, tuple(s.request_id for s in decoding)))
            log.debug("decode step %d: batch of %d", self.num_steps_total, len(decoding))
        for seq in decoding:
            seq.num_forward_tokens += 1
        for seq, (token, logprob) in zip(sampling, sampled):
            seq.output_ids.append(token)
            finish = self._check_stop(seq)
            if finish is None:
                seq.emit(self._delta(seq, (token,), None, logprob=logprob))
                if self.publish_interval:
                    self._publish_progress(seq)
            else:
                self._finish(seq, finish, new_tokens=(token,), logprob=logprob)

    def _check_stop(self, seq: DecodeSequence) -> FinishReason | None:
        params = seq.request.sampling
        last = seq.output_ids[-1]
        if (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids:
            return FinishReason.STOP
        if len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: DecodeSequence, reason: FinishReason, error: str | None = None,
                new_tokens: tuple[int, ...] = (), logprob: TokenLogprob | None = None,
                error_code: str | None = None) -> None:
        normal = (seq.status is RequestStatus.RUNNING
                  and reason in (FinishReason.STOP, FinishReason.LENGTH))
        publish = normal and self.publisher is not None
        if normal and (publish or self.pool.enable_caching):
            namespace = make_namespace(self.model_id, seq.request.cache_salt)
            seq.block_keys = tuple(block_keys(seq.kv_token_ids(), self.block_size, namespace))
            self._cache(seq, seq.block_keys)  # before finish frees them: cached, evictable
        table = list(seq.block_table) if publish else []  # finish empties the request's own
        if self.publisher is not None and not publish:
            self.publisher.abort(seq.request_id)  # what it put while running stays
        self.scheduler.finish(seq)
        seq.swapped = None
        seq.emit(self._delta(seq, new_tokens, reason, error, logprob, error_code))
        if publish:
            # the freed blocks keep their bytes until this thread allocates again
            self._publish(seq, table)

    def _publish_progress(self, seq: DecodeSequence) -> None:
        """Every publish_interval more full blocks of a running sequence's KV, those blocks
        go to the publisher (after the token went out; blocks a prefill published count as
        out already)."""
        tokens = seq.kv_token_ids()
        full = len(tokens) // self.block_size
        # a prefill published the prompt's full blocks
        by_prefill = seq.num_prompt_tokens // self.block_size if seq.request.prefill else 0
        out = max(seq.num_published_blocks, by_prefill)
        if full < out + self.publish_interval:
            return
        namespace = make_namespace(self.model_id, seq.request.cache_salt)
        keys = block_keys(tokens, self.block_size, namespace)
        try:
            self.publisher.save_progress(seq, keys, seq.block_table[:len(keys)])
        except Exception:  # noqa: BLE001 — a lost publish costs a later recompute
            log.exception("publishing the blocks of %s failed", seq.request_id,
                          extra={"request_id": seq.request_id})
        seq.num_published_blocks = len(keys)

    def _publish(self, seq: DecodeSequence, block_table: list[int]) -> None:
        """Hand the full blocks of the sequence's KV (keys: seq.block_keys), in `block_table`,
        to the publisher, which copies what no prefill published. A failure costs later turns
        a recompute, never this request."""
        try:
            self.publisher.request_finished(seq, block_table[:len(seq.block_keys)])
        except Exception:  # noqa: BLE001 — the request already ended well
            log.exception("publishing the blocks of %s failed", seq.request_id,
                          extra={"request_id": seq.request_id})

    def _delta(self, seq: DecodeSequence, tokens: tuple[int, ...], reason: FinishReason | None,
               error: str | None = None, logprob: TokenLogprob | None = None,
               error_code: str | None = None) -> TokenDelta:
        # a colocated request's first delta says what its prompt found cached; after a
        # prefill, the prefill's first token said it
        first = seq.request.prefill is None and len(tokens) == len(seq.output_ids) > 0
        return TokenDelta(seq.request_id, tuple(tokens), reason, seq.num_forward_tokens,
                          self.worker_id, self.pid, error,
                          logprobs=None if logprob is None else (logprob,), error_code=error_code,
                          num_cached_tokens=seq.num_cached_tokens if first else None)
