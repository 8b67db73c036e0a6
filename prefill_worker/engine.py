"""Prefill engine: compute a prompt's KV, sample the first token, publish the KV blocks.

Lifecycle of a request on a prefill worker (statuses: engine.core.request.RequestStatus):

1. WAITING        — checked (empty or too long prompt: PrefillRejected) and queued, first come,
                    first served (engine.core.scheduler);
2. admission      — the prompt's full blocks get chained sha256 keys; the longest prefix of
                    them cached in this worker's block pool (G1) is reused as is (at least one
                    prompt token is always computed: the first output token needs the last
                    position's logits), and blocks for the rest are allocated. A request
                    waits while too few blocks are free;
3. WAITING_FOR_KV — the next part of the prefix that G1 lacks is loaded by the KV connector
                    (kvstore.connector: the pool's, from this node's G2/G3 or another node's)
                    into its blocks, off the engine loop; other requests compute meanwhile;
4. RUNNING        — the uncached suffix runs through the model in chunks; each step packs
                    chunks of several requests under max_num_batched_tokens (chunked prefill,
                    Scheduler.schedule_chunks), and no further request once the step is
                    compute-bound (prefill_compute_bound_tokens). The connector sees every
                    layer's forward (save_kv_layer): with --kv-streaming layer a request runs
                    its chunks in steps of its own and each layer's KV goes to the decode
                    worker as soon as that layer ran;
5. FINISHED       — output token 0 is sampled and goes to the caller at once (FirstToken);
                    the connector takes the prompt's blocks (request_finished: copied out),
                    the full ones are cached in G1 (their events go to the global index) and
                    the request's blocks released. Off the loop and the first token's path,
                    the connector saves them: the full blocks to this node's G2 under their
                    keys and the partial tail block to the node's store under a per-request
                    handle (never keyed or indexed); with --kv-transfer torch they are also
                    pushed to the request's decode worker. Once the connector reports the
                    request's KV transfer params (get_finished), the caller gets its
                    PrefillResult, which the decode needs. An abort or a failure at any point
                    releases every block the request held (a prefix load in flight first
                    settles: it may still write into them).

The engine runs on an engine loop (engine.core.engine_loop); its public methods are
thread-safe and talk to the loop through its inbox.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.core.block_pool import BlockPool
from engine.core.engine_loop import EngineInbox
from engine.core.hashing import block_keys, make_namespace
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_connector import (KVConnector, KVLoadFailurePolicy, LoadOutcome, ScheduledChunk,
                                      StepCancelled)
from engine.core.request import RequestStatus
from engine.core.scheduler import Scheduler
from engine.protocol import FirstToken, KVTransferParams, PrefillRequest, PrefillResult
from engine.runner import ModelRunner, SequenceChunk
from engine.sampler import SampleInput, draw_seed, sample
from kvstore.errors import KVLoadError
from kvstore.index import KVIndex, Location
from kvstore.index.device_feed import DeviceCacheFeed

log = logging.getLogger(__name__)


MAX_TRACKED_ABORTS = 4096
#: Seconds between checks that the global index still lists this worker's G1 blocks.
IDLE_WAIT_S = 0.05  # engine loop sleep with nothing to run, unless woken


class PrefillRejected(ValueError):
    """The request cannot be prefilled here (empty prompt, or longer than max_model_len or
    than the whole cache)."""


class RequestAborted(RuntimeError):
    """The request was aborted before its prefill finished."""


@dataclass(eq=False)  # a request is itself: queues compare by identity
class PrefillSequence:
    """One request on the prefill engine (the scheduler's SchedulableRequest, and the
    connector's KVConnectorRequest)."""

    request: PrefillRequest
    first: Future  # of its FirstToken
    result: Future  # of its PrefillResult
    seed: int
    block_keys: list[bytes]
    runs_alone: bool  # its forwards must not share a step (a per-layer sender sees them)
    status: RequestStatus = RequestStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    arrival: int = 0
    num_computed_tokens: int = 0
    num_hit_blocks: int = 0  # G1 hits
    loaded: LoadOutcome = field(default_factory=LoadOutcome)
    aborted: bool = False
    began: float = field(default_factory=time.perf_counter)
    first_token: tuple[int, Any] | None = None  # (token, logprob) once sampled
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

    @property
    def max_tokens(self) -> int:
        return self.request.sampling.max_tokens

    @property
    def kv_transfer_params(self) -> KVTransferParams | None:
        return self.request.kv_transfer_params


class PrefillEngine:
    """One prefill worker's model runner, scheduler (over its block pool) and KV connector,
    driven by an engine loop (engine.core.engine_loop.EngineLoop).

    Args:
        runner: the model runner (its ``wire_kv`` is what the connector reads and writes).
        connector: moves the KV in (prefix loads) and out (kvstore.connector).
        worker_id / pid: who computed a result (PrefillResult.prefill_worker_id / _pid).
        index / node_id: where G1 cache events go, as (node_id, "device", worker_id)
            locations (index None: nowhere).
        kv_load_failure_policy: a prefix load cut short is recomputed from where it stopped
            ("recompute") or ends the request with KVLoadError ("fail"); both are counted in
            stats()["kv_load_failures_total"] by action (KVTransferConfig.load_failure_policy).
    """

    def __init__(self, runner: ModelRunner, connector: KVConnector, worker_id: str, pid: int,
                 index: KVIndex | None = None, node_id: str = "local-node",
                 kv_load_failure_policy: str = "recompute") -> None:
        self.kv_load_failures = KVLoadFailurePolicy(kv_load_failure_policy)
        self.runner = runner
        self.connector = connector
        self.index = index
        self.node_id = node_id
        self.worker_id = worker_id
        self.pid = pid
        cfg = runner.engine_config
        self.block_size = cfg.block_size
        self.token_budget = cfg.max_num_batched_tokens
        self.compute_bound_tokens = cfg.resolved_prefill_compute_bound_tokens()
        self.max_model_len = cfg.resolved_max_model_len(runner.model_config)
        self.model_id = runner.model_config.name
        self.eos_token_ids = frozenset(runner.model_config.eos_token_ids)
        self.pool = BlockPool(cfg.num_kv_blocks, enable_caching=cfg.enable_prefix_caching,
                              run_window=cfg.resolved_block_run_window())
        self.kv_manager = KVCacheManager(self.pool, self.block_size)
        # no preemption: a prefill takes every block it needs on admission
        self.scheduler: Scheduler[PrefillSequence] = Scheduler(
            self.kv_manager, None, num_lookahead_tokens=0)
        self.inbox = EngineInbox()
        connector.register_kv_caches(runner.wire_kv)
        connector.wakeup = lambda: self.inbox.post("wake")
        runner.layer_hooks = connector  # around each layer's attention, compiled or not
        # index events and results, on one thread of their own: a request's events reach the
        # index before its caller gets the result
        self._events = ThreadPoolExecutor(1, thread_name_prefix="prefill-events")
        self._alone: PrefillSequence | None = None  # its chunks run back to back, alone
        self._sending: dict[str, PrefillSequence] = {}  # finished, KV on its way out
        self._ready: list[tuple[PrefillSequence, Any]] = []  # params known at request_finished
        self._in_step: list[PrefillSequence] = []
        # ids aborted before they arrived; bounded, as aborts may name finished requests
        self._aborted: OrderedDict[str, None] = OrderedDict()
        self._abort_lock = threading.Lock()
        self._g1_feed = DeviceCacheFeed(self.pool, index,
                                        Location(node_id, "device", worker_id), self._events)
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
        PrefillResult (set once its KV is saved). Either raises PrefillRejected or
        RequestAborted instead, the result also KVStoreError (saving failed)."""
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
        self.connector.abort(request_id)  # at once: the loop may be in its forward
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
                "g1_reannouncements_total": self._g1_feed.reannouncements_total,
                "prefix_cache_queried_tokens_total": self.prefix_cache_queried_tokens_total,
                "prefix_cache_hit_tokens_total": dict(self.prefix_cache_hit_tokens_total),
                "kv_load_failures_total": dict(self.kv_load_failures.failures_total),
                **self.connector.stats()}

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
        # "wake": the connector settled something; the step polls it

    def step(self) -> bool:
        for seq in self.scheduler.admit():
            self._plan_load(seq)
        self.connector.start_load_kv()
        self._take_finished()
        chunks = self._schedule()
        if not chunks:
            return False
        self._in_step = [seq for seq, _ in chunks]
        try:
            logits = self._execute(chunks)
        except StepCancelled:
            self._end(self._alone, RequestAborted(self._alone.request_id))
            self._in_step = []
            return True
        for row, (seq, _) in enumerate(chunks):
            if seq.num_computed_tokens == seq.num_prompt_tokens:
                self._finish(seq, logits[row:row + 1])
        self._in_step = []
        self._send_events()
        self._take_finished()
        return True

    def idle_wait_s(self) -> float:
        return IDLE_WAIT_S  # the connector posts a wake-up when something settles

    def fail_step(self, exc: Exception) -> None:
        for seq in self._in_step:
            if seq.status is not RequestStatus.FINISHED:  # finished ones are saving
                self._end(seq, exc)
        self._in_step = []
        self._send_events()

    def close(self) -> None:
        for seq in (list(self.scheduler.waiting) + list(self.scheduler.active.values())
                    + list(self._sending.values())):
            _fail(seq, RequestAborted(f"{seq.request_id}: engine stopped"))
        self._events.shutdown(wait=False)
        self.connector.close()

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
        seq = PrefillSequence(request, first, result, seed, keys, False)
        seq.runs_alone = self.connector.runs_alone(seq)
        self.scheduler.add(seq)

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
        if seq is None:  # not arrived yet (refused when it comes), or finished and saving
            self.connector.abort(request_id)
            with self._abort_lock:
                self._aborted[request_id] = None
                while len(self._aborted) > MAX_TRACKED_ABORTS:
                    self._aborted.popitem(last=False)
        elif seq.status is RequestStatus.WAITING_FOR_KV:
            seq.aborted = True  # ended once the load settles: it may write its blocks
        else:
            self._end(seq, RequestAborted(request_id))

    def _plan_load(self, seq: PrefillSequence) -> None:
        """An admitted request: the connector loads what it can of the prefix after its G1
        hits, off the loop (the request waits for KV), or it runs at once."""
        seq.num_hit_blocks = seq.num_computed_tokens // self.block_size
        n = 0
        if self.pool.enable_caching:
            n, is_async = self.connector.get_num_new_matched_tokens(seq,
                                                                    seq.num_computed_tokens)
            self.connector.update_state_after_alloc(seq, seq.block_table, n)
            if n and not is_async:
                seq.num_computed_tokens += n
                n = 0
        seq.status = RequestStatus.WAITING_FOR_KV if n else RequestStatus.RUNNING

    def _take_finished(self) -> None:
        """What the connector settled: loads (the request runs; a cut-short load is
        recomputed) and sends (the caller's result)."""
        sent, loaded = self.connector.get_finished()
        for request_id, outcome in loaded.items():
            seq = self.scheduler.active.get(request_id)
            if seq is None:
                continue
            if seq.aborted:
                self._end(seq, RequestAborted(request_id))
                continue
            seq.loaded = outcome
            if outcome.failures:
                if self.kv_load_failures.record():
                    log.warning("prefix load cut short, ending the request "
                                "(--kv-load-failure-policy fail): %s", outcome.failures[0],
                                extra={"request_id": request_id})
                    self._end(seq, KVLoadError(f"KV load failed: {outcome.failures[0]}"))
                    continue
            for failure in outcome.failures:
                log.warning("prefix load cut short, recomputing the rest: %s", failure,
                            extra={"request_id": request_id})
            seq.num_computed_tokens += outcome.num_tokens
            seq.status = RequestStatus.RUNNING
        ready, self._ready = self._ready, []
        ready += [(self._sending.pop(rid), params) for rid, params in sent.items()
                  if rid in self._sending]
        for seq, params in ready:
            self._events.submit(self._deliver, seq, params)

    def _schedule(self) -> list[tuple[PrefillSequence, int]]:
        """This step's chunks; a request that runs alone, once begun, runs alone to its end."""
        seq = self._alone
        if seq is not None:
            return [(seq, min(seq.num_prompt_tokens - seq.num_computed_tokens,
                              self.token_budget))]
        chunks = self.scheduler.schedule_chunks(self.token_budget, self.compute_bound_tokens)
        if len(chunks) == 1 and chunks[0][0].runs_alone:
            self._alone = chunks[0][0]
        return chunks

    def _execute(self, chunks: list[tuple[PrefillSequence, int]]) -> torch.Tensor:
        """The step's forward; advances each request's computed tokens. Returns the logits
        [len(chunks), vocab] of each chunk's last token."""
        batch = []
        for seq, n in chunks:
            start = seq.num_computed_tokens
            batch.append(SequenceChunk(seq.prompt[start:start + n], start, seq.block_table))
        self.connector.bind_connector_metadata(self.connector.build_connector_meta(
            [ScheduledChunk(seq, seq.num_computed_tokens, n) for seq, n in chunks]))
        logits = self.runner.execute(batch)
        self.connector.wait_for_save()
        for seq, n in chunks:
            seq.num_computed_tokens += n
            self.num_prefill_tokens_total += n
        self.num_steps_total += 1
        self.num_chunks_total += len(chunks)
        self.max_chunks_per_step = max(self.max_chunks_per_step, len(chunks))
        return logits

    def _finish(self, seq: PrefillSequence, logits: torch.Tensor) -> None:
        """The prompt is computed: sample output token 0, hand the blocks to the connector,
        cache the full ones in G1 and release the request's blocks."""
        seq.extra["compute_end_s"] = time.time()
        if self._alone is seq:
            self._alone = None
        [(token, logprob)] = sample(
            logits, [SampleInput(seq.request.sampling, seq.seed, list(seq.prompt), ())],
            self.eos_token_ids)
        seq.first_token = (token, logprob)
        seq.first.set_result(FirstToken(seq.request_id, token, logprob, self.worker_id,
                                        self.pid, self._num_cached_tokens(seq)))
        self._sending[seq.request_id] = seq
        try:
            _, params = self.connector.request_finished(seq, seq.block_table)
        except Exception as exc:  # noqa: BLE001 — the caller's error
            params = exc
        if params is not None:  # delivered after this step's index events
            self._ready.append((self._sending.pop(seq.request_id), params))
        hit, keys = seq.num_hit_blocks, seq.block_keys
        self.pool.cache_full_blocks(seq.block_table[hit:len(keys)], keys[hit:],
                                    keys[hit - 1] if hit else None)
        self.num_requests_total += 1
        self.prefix_cache_queried_tokens_total += seq.num_prompt_tokens
        self.prefix_cache_hit_tokens_total["device"] += hit * self.block_size
        self.prefix_cache_hit_tokens_total.update(seq.loaded.tokens_by_tier)
        self.scheduler.finish(seq)
        log.debug("prefill of %d tokens (%d cached) in %.1f ms", seq.num_prompt_tokens,
                  self._num_cached_tokens(seq),
                  (time.perf_counter() - seq.began) * 1e3, extra={"request_id": seq.request_id})

    def _num_cached_tokens(self, seq: PrefillSequence) -> int:
        """Prompt tokens the prefix cache served: device hits plus tokens loaded from a tier."""
        return seq.num_hit_blocks * self.block_size + seq.loaded.num_tokens

    def _end(self, seq: PrefillSequence, error: BaseException) -> None:
        """The request ends without a result: what the connector moves for it dropped, its
        blocks released."""
        if self._alone is seq:
            self._alone = None
        self.connector.abort(seq.request_id)
        self.scheduler.finish(seq)
        _fail(seq, error)

    def _send_events(self) -> None:
        """The pool's G1 events to the index, in order with results (a request's events reach
        the index before its caller gets the result)."""
        self._g1_feed.send()

    # ---- off the loop --------------------------------------------------------------------
    def _deliver(self, seq: PrefillSequence, params: KVTransferParams | BaseException) -> None:
        """The caller's PrefillResult from the connector's KV transfer params."""
        if isinstance(params, BaseException):
            seq.result.set_exception(params)
            return
        params = dict(params)
        seq.extra.update(params.pop("extra", {}))
        token, logprob = seq.first_token
        seq.result.set_result(PrefillResult(
            seq.request_id, token, self._num_cached_tokens(seq), self.worker_id, self.pid,
            logprob, kv_transfer_params=params, extra=seq.extra))

def _fail(seq: PrefillSequence, error: BaseException) -> None:
    for future in (seq.first, seq.result):
        if not future.done():
            future.set_exception(error)
