"""The engine every worker runs (vLLM v1's ``EngineCore``): one scheduler over one block pool,
one KV connector, one step: ``schedule`` (a SchedulerOutput: which tokens of which requests,
one budget) → ``execute_model`` (engine.core.model_executor: the forward, the grammar masks
and the sampler) → ``update_from_output`` (tokens computed, stops, finishing).

Prefill, decode and colocated instances are this engine with other requests and connectors
(engine.core.request.Request):

* prefill: requests end after their first token (``prefill_only``); the connector loads cached
  prefixes from the pool and saves each computed prompt, and the caller gets the connector's
  KV transfer params once they settle;
* decode: requests arrive with the prefill's first token and KV transfer params and wait for
  their prompt's KV (WAITING_FOR_KV) while the connector fetches it;
* colocated, or kept local by the PD decider: nothing remote; the connector loads the cached
  prefix from the pool as a prefill's would, and the rest is computed here.

Each step feeds the last token of every running request that is caught up (a decode row) and
catches up the others in chunks under the token budget (chunked prefill): new prompts, requests
resumed after preemption by recompute, and those whose KV load failed, which go back to
computing from what their blocks hold. A prompt's last chunk samples output token 0.

    add ──▶ WAITING ──admit──▶ WAITING_FOR_KV ──landed──▶ RUNNING ──▶ FINISHED
                              (nothing to load: RUNNING)    │ decode rows, prompt chunks
                                                            └─ stop / length / abort / error

A request that ends normally has the full blocks of its KV (prompt, and output but the last
token) cached in this worker's prefix cache and handed to the connector
(``request_finished``), which saves what it saves; every request's blocks go back to the pool
in the same loop iteration (an abort during a load: once the connector reports it settled).
The pool's cache events go to the global index through ``kv_events``.

The engine runs on an engine loop (engine.core.engine_loop): its public methods are
thread-safe and talk to the loop through its inbox; every other method runs on the loop.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, Protocol

from pdcluster.engine.core.block_pool import BlockPool
from pdcluster.engine.core.engine_loop import EngineInbox
from pdcluster.engine.core.hashing import block_keys, make_namespace
from pdcluster.engine.core.kv_cache_manager import NULL_BLOCK, KVCacheManager, has_released
from pdcluster.engine.core.messages import (AbortRequest, AddRequest, CallSoon, EngineMessage,
                                            ResetPrefixCache, Wake)
from pdcluster.engine.core.kv_connector import (KVConnector, KVLoadFailurePolicy, LoadOutcome,
                                                ScheduledChunk, StepCancelled)
from pdcluster.engine.core.preemption import PREEMPTION_MODES
from pdcluster.engine.core.request import (Request, RequestAborted, RequestFailed, RequestRejected,
                                           RequestStatus)
from pdcluster.engine.core.model_executor import ModelExecutor
from pdcluster.engine.core.outputs import ModelRunnerOutput, SchedulerOutput
from pdcluster.engine.core.scheduler import Scheduler, check_stop
from pdcluster.engine.core.stats import SchedulerStats
from pdcluster.engine.core.structured_output import GrammarError, StructuredOutputManager
from pdcluster.engine.protocol import KV_LOAD_FAILED, FinishReason, TokenDelta, TokenLogprob
from pdcluster.engine.parallel import TPError
from pdcluster.engine.runner import ModelRunner
from pdcluster.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MAX_TRACKED_ABORTS = 4096
IDLE_WAIT_S = 0.02  # engine loop sleep with nothing to run, unless woken
POLL_S = 0.002  # ... while a load that must be polled is in flight


class KVEventFeed(Protocol):
    """Sends the block pool's cache events to the global index (kvstore.index.device_feed)."""

    reannouncements_total: int

    def send(self) -> None: ...


#: Builds the feed from the engine's block pool and the executor its events go out on (the one
#: that also delivers KV transfer params, so a request's events come first).
KVEventFeedFactory = Callable[[BlockPool, Executor], KVEventFeed]


class PreArrivalKV(Protocol):
    """KV that starts landing, in blocks reserved for it, before its request reaches the
    engine (SGLang's decode prealloc queue); installed by the worker whose connector can
    send ahead of the request, called on the loop."""

    def __len__(self) -> int: ...

    def arrived(self, request_id: str) -> None:
        """The request reached the engine: a later announce of it is ignored."""

    def attach_waiting(self) -> None:
        """Waiting requests whose KV is already on its way take it (out of turn)."""

    def poll(self) -> None:
        """Drop what waited too long for its request."""

    def drop(self, request_id: str, tell_prefill: bool = False) -> bool:
        """Stop it and free its blocks."""


class EngineCore:
    """One worker's model runner, scheduler (over its block pool) and KV connector, driven by
    an engine loop (engine.core.engine_loop.EngineLoop).

    Args:
        runner: the model runner (its ``wire_kv`` is what the connector reads and writes).
        connector: moves KV in and out (engine.core.kv_connector; several as one
            MultiConnector). Its layer hooks run inside the forward only when it declares
            ``uses_layer_hooks``, so the other forwards keep their fast paths.
        worker_id / pid: who ran a request (TokenDelta.decode_worker_id / decode_pid).
        kv_events: builds the feed of the prefix cache's events to the global index (None:
            the cache works unindexed).
        kv_load_failure_policy: a load that failed for good is recomputed here from what
            landed ("recompute") or ends the request with error_code KV_LOAD_FAILED ("fail");
            both are counted in stats().kv_load_failures_total by action
            (KVTransferConfig.load_failure_policy).
        publish_interval: a running request's full blocks also go to the connector every this
            many (``save_progress``; 0: at its end only), so another request sharing the prefix
            need not wait for the end (KVTransferConfig.decode_publish_interval).
        num_lookahead_tokens: slots admission reserves beyond the prompt: 1 where requests go
            on to decode (their first fed token), 0 on a prefill instance.
        compute_bound_tokens: a step holding this many prompt tokens takes no further prompt
            (Scheduler.schedule_chunks; a prefill instance's, where every step is prompts);
            None: only the token budget bounds a step.

    Attributes:
        pre_arrival: KV landing before its request comes (set by the worker; None: none).
    """

    def __init__(self, runner: ModelRunner, connector: KVConnector, worker_id: str, pid: int,
                 kv_events: KVEventFeedFactory | None = None,
                 kv_load_failure_policy: str = "recompute", publish_interval: int = 0,
                 num_lookahead_tokens: int = 1, compute_bound_tokens: int | None = None
                 ) -> None:
        self.kv_load_failures = KVLoadFailurePolicy(kv_load_failure_policy)
        self.runner, self.connector = runner, connector
        self.worker_id, self.pid = worker_id, pid
        cfg = runner.engine_config
        self.block_size = cfg.block_size
        self.token_budget = cfg.max_num_batched_tokens
        self.compute_bound_tokens = compute_bound_tokens
        self.max_model_len = cfg.resolved_max_model_len(runner.model_config)
        self.model_id = runner.model_config.name
        self.eos_token_ids = frozenset(runner.model_config.eos_token_ids)
        self.pool = BlockPool(cfg.num_kv_blocks, enable_caching=cfg.enable_prefix_caching,
                              run_window=cfg.resolved_block_run_window())
        self.kv = KVCacheManager(self.pool, self.block_size, runner.model_config.kv_window())
        self.scheduler: Scheduler[Request] = Scheduler(
            self.kv, PREEMPTION_MODES[cfg.preemption_mode](self.kv, runner.wire_kv),
            num_lookahead_tokens, cfg.scheduling_policy, cfg.max_num_seqs)
        self.publish_interval = publish_interval
        self.inbox = EngineInbox()
        connector.register_kv_caches(runner.wire_kv)
        connector.wakeup = lambda: self.inbox.post(Wake())
        if connector.uses_layer_hooks:  # around each layer's attention, compiled or not
            runner.layer_hooks = connector
        self.pre_arrival: PreArrivalKV | None = None
        # cache events and KV transfer params, on one thread of their own: a request's events
        # reach the index before its caller gets its params
        self._events = ThreadPoolExecutor(1, thread_name_prefix="engine-events")
        self._feed = kv_events(self.pool, self._events) if kv_events is not None else None
        self._alone: Request | None = None  # its chunks run back to back, alone
        self._sending: dict[str, Request] = {}  # finished, KV params to come from the connector
        self._ready: list[tuple[Request, Any]] = []  # params known at request_finished
        self._in_step: list[Request] = []
        self._structured: StructuredOutputManager | None = None  # made by the first grammar
        self.executor = ModelExecutor(runner, connector, self.eos_token_ids,
                                      lambda: self._structured)
        # requests whose grammar compiles off the loop, by id, with its future matcher
        self._compiling: dict[str, tuple[Request, Future]] = {}
        # ids aborted before they arrived (loop thread only); bounded, as aborts may name
        # finished requests
        self._aborted: OrderedDict[str, None] = OrderedDict()
        self.num_steps_total = 0  # steps with decode rows
        self.num_forward_tokens_total = 0  # decode rows
        self.num_prefill_steps_total = 0  # steps with prompt chunks
        self.num_prefill_chunks_total = 0
        self.max_prefill_chunks_per_step = 0
        self.num_prefill_tokens_total = 0  # chunk tokens run through the model
        self.num_requests_total = 0  # prompts computed here
        self.busy_s_total = 0.0  # wall seconds in steps that ran the model (utilization)
        self.prefix_cache_queried_tokens_total = 0  # prompt tokens looked up (vLLM's "queries")
        self.prefix_cache_hit_tokens_total: Counter[str] = Counter({"device": 0})
        self.kv_blocks_reused_total = 0  # prompts from a prefill: blocks found here, not loaded
        self.num_fetch_recomputes_total = 0  # prompts from a prefill computed here: load failed
        self._num_load_recomputed_tokens = 0

    # ---- called from other threads -------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.inbox.post(AddRequest(request))

    def abort(self, request_id: str) -> None:
        """Idempotent: a request waiting or running ends with finish_reason ABORT and releases
        its blocks (one whose forward a layer hook watches stops at its next layer); one that finished
        has what the connector still holds for it dropped; one not arrived yet is refused when
        it comes."""
        alone = self._alone
        if alone is not None and alone.request_id == request_id:
            self.connector.abort(request_id)  # at once: its forward may be running
        self.inbox.post(AbortRequest(request_id))

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the engine loop before its next step."""
        self.inbox.post(CallSoon(fn))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached key (refused while a request holds blocks); the index hears of
        it."""
        done: Future = Future()
        self.inbox.post(ResetPrefixCache(done))
        return done.result()

    @property
    def num_recomputed_tokens_total(self) -> int:
        """Tokens computed here again: preempted requests resumed by recompute, and prompts
        from a prefill whose load failed."""
        return (self.scheduler.preemption.num_recomputed_tokens_total
                + self._num_load_recomputed_tokens)

    def stats(self) -> SchedulerStats:
        active = list(self.scheduler.active.values())
        return SchedulerStats(
            worker_id=self.worker_id, pid=self.pid,
            num_waiting=len(self.scheduler.waiting) + len(self._compiling),
            num_active=len(active),
            num_running=sum(r.status is RequestStatus.RUNNING for r in active),
            num_pending_prompt_tokens=sum(
                max(0, r.num_prompt_tokens - r.num_computed_tokens)
                for r in [*self.scheduler.waiting, *active]),
            **self.pool.stats(),
            num_steps_total=self.num_steps_total,
            num_forward_tokens_total=self.num_forward_tokens_total,
            num_prefill_steps_total=self.num_prefill_steps_total,
            num_prefill_chunks_total=self.num_prefill_chunks_total,
            max_prefill_chunks_per_step=self.max_prefill_chunks_per_step,
            num_prefill_tokens_total=self.num_prefill_tokens_total,
            num_requests_total=self.num_requests_total,
            busy_s_total=self.busy_s_total,
            num_sending=len(self._sending),
            num_preemptions_total=self.scheduler.num_preemptions_total,
            num_recomputed_tokens_total=self.num_recomputed_tokens_total,
            num_prealloc_requests=len(self.pre_arrival or ()),
            kv_load_failures_total=dict(self.kv_load_failures.failures_total),
            prefix_cache_queried_tokens_total=self.prefix_cache_queried_tokens_total,
            prefix_cache_hit_tokens_total=dict(self.prefix_cache_hit_tokens_total),
            kv_blocks_reused_total=self.kv_blocks_reused_total,
            num_fetch_recomputes_total=self.num_fetch_recomputes_total,
            g1_reannouncements_total=(
                self._feed.reannouncements_total if self._feed is not None else 0),
            kv_connector_stats=self.connector.stats())

    # ---- the engine loop's (engine.core.engine_loop) -------------------------------------
    def handle(self, message: EngineMessage) -> None:
        match message:
            case AddRequest(request):
                self._arrive(request)
            case AbortRequest(request_id):
                self._abort_now(request_id)
            case CallSoon(fn):
                fn()
            case ResetPrefixCache(done):
                ok = self.pool.reset_prefix_cache()
                self._send_events()
                done.set_result(ok)
            case Wake():
                pass  # what settled is polled by the step

    def step(self) -> bool:
        """vLLM v1's step: schedule → execute_model → update_from_output. False: nothing
        ran."""
        output = self.schedule()
        if output is None:
            return False
        self._in_step = output.requests
        began = time.perf_counter()
        try:
            self.update_from_output(output, self.executor.execute_model(output))
        except StepCancelled:
            self._finish(self._alone, FinishReason.ABORT, RequestAborted(self._alone.request_id))
        finally:
            self.busy_s_total += time.perf_counter() - began
        self._in_step = []
        self._send_events()
        self._take_finished()
        return True

    def schedule(self) -> SchedulerOutput | None:
        """What runs this step: admitted requests start their KV, settled loads run, and one
        budget (``max_num_batched_tokens``) takes the decode rows first (oldest first; a row
        past the budget waits a step), then prompt chunks in what is left. None: nothing to
        run."""
        if self._compiling:
            self._take_compiled()
        if self.pre_arrival is not None:
            self.pre_arrival.poll()
            self.pre_arrival.attach_waiting()
        for request in self.scheduler.admit():
            self._start_kv(request)
        self.connector.start_load_kv()
        self._take_finished()
        running = self.scheduler.grow()
        if not running:
            self._send_events()  # what a batch interval held back
            return None
        decoding = [r for r in running if r.output_ids and not r.prefill_only
                    and r.num_computed_tokens == r.num_tokens - 1][:self.token_budget]
        chunks = self._schedule_chunks(self.token_budget - len(decoding))
        if not (decoding or chunks):
            return None
        return SchedulerOutput(decoding, chunks, self.connector.build_connector_meta(
            [ScheduledChunk(r, r.num_computed_tokens, n) for r, n in chunks]))

    def idle_wait_s(self) -> float:
        # a load the connector does not wake the loop for is polled
        polled = len(self.pre_arrival or ()) or (self.connector.polled and any(
            r.status is RequestStatus.WAITING_FOR_KV for r in self.scheduler.active.values()))
        return POLL_S if polled else IDLE_WAIT_S

    def fail_step(self, exc: Exception) -> None:
        ran = self._in_step or [r for r in self.scheduler.active.values()
                                if r.status is RequestStatus.RUNNING]
        for request in ran:
            if request.status is not RequestStatus.FINISHED:
                self._finish(request, FinishReason.ERROR,
                             RequestFailed(f"internal error in engine step: {exc}"))
        self._in_step = []
        self._send_events()

    def close(self) -> None:
        for request in (*self.scheduler.waiting, *self.scheduler.active.values(),
                        *self._sending.values(), *(r for r, _ in self._compiling.values())):
            self._notify_error(request, RequestAborted(f"{request.request_id}: engine stopped"))
        self._events.shutdown(wait=False)
        if self._structured is not None:
            self._structured.close()
        self.connector.close()
        try:
            self.runner.close()
        except TPError:
            pass  # the group broke already: its other ranks go with it

    # ---- arrival and admission -----------------------------------------------------------
    def _arrive(self, request: Request) -> None:
        """Queue a new request once its grammar (if any) compiled, unless it ends here and
        now: refused, aborted before it came, or stopped already by the first token it came
        with."""
        if self.pre_arrival is not None:
            self.pre_arrival.arrived(request.request_id)
        error = self._refusal(request)
        if error is not None:
            self._finish(request, FinishReason.ABORT if isinstance(error, RequestAborted)
                         else FinishReason.ERROR, error)
            return
        spec = request.sampling.structured_output
        if spec is not None:
            future = self._structured_output().compile(spec)
            self._compiling[request.request_id] = (request, future)
            future.add_done_callback(lambda _: self.inbox.post(Wake()))
            return
        self._queue(request)

    def _structured_output(self) -> StructuredOutputManager:
        if self._structured is None:
            tokenizer = Tokenizer.from_pretrained(self.runner.engine_config.model)
            self._structured = StructuredOutputManager(
                tokenizer, self.runner.model_config.vocab_size,
                self.runner.model_config.eos_token_ids)
        return self._structured

    def _take_compiled(self) -> None:
        """Requests whose grammar compiled are queued, their matcher advanced over the output
        they came with (the prefill's token 0, the output before a migration)."""
        for request_id, (request, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            try:
                matcher = future.result()
            except GrammarError as exc:
                self._finish(request, FinishReason.ERROR, RequestRejected(str(exc)))
                continue
            start = request.grammar_start()
            if start is not None and not matcher.consume_tokens(request.full_output()[start:]):
                self._finish(request, FinishReason.ERROR, RequestFailed(
                    f"the output so far does not match the grammar: {matcher.get_error()}"))
                continue
            request.grammar, request.grammar_on = matcher, start is not None
            self._queue(request)

    def _queue(self, request: Request) -> None:
        if request.output_ids:
            finish = check_stop(request, self.eos_token_ids, self.max_model_len)
            if finish is not None:
                self._finish(request, finish)
                return
        request.prompt_keys = tuple(block_keys(request.prompt_token_ids, self.block_size,
                                               self._namespace(request)))
        # prompt logprobs need the logits of every prompt position: nothing cached is reused
        request.block_keys = (request.prompt_keys if self.connector.allows_local_prefix(request)
                              and not request.wants_prompt_logprobs else ())
        request.runs_alone = self.connector.runs_alone(request)
        self.scheduler.add(request)

    def _refusal(self, request: Request) -> Exception | None:
        if self._aborted.pop(request.request_id, False) is None:
            return RequestAborted(request.request_id)
        n = request.num_prompt_tokens
        if n == 0:
            return RequestRejected("prompt is empty")
        if n > self.max_model_len:
            return RequestRejected(f"prompt has {n} tokens, max_model_len is "
                                   f"{self.max_model_len}")
        try:
            self.runner.lora_slot(request.sampling.lora_name)
        except ValueError as exc:
            return RequestRejected(str(exc))
        most = n if request.prefill_only else min(n + request.max_tokens, self.max_model_len)
        if not self.kv.fits_ever(most):
            return RequestRejected(f"request needs up to {self.kv.blocks_for(most)} KV blocks, "
                                   f"worker has {self.kv.num_blocks}")
        return None

    def _start_kv(self, request: Request) -> None:
        """An admitted request (holding the blocks of its prompt, the first of them its prefix
        hits here): the connector loads what it can of the rest, off the loop (the request
        waits for KV), or it runs at once and computes the rest."""
        request.num_cached_tokens = request.num_computed_tokens
        if request.remote_prefill:
            self.kv_blocks_reused_total += request.num_cached_tokens // self.block_size
        else:
            self.prefix_cache_queried_tokens_total += request.num_prompt_tokens
            self.prefix_cache_hit_tokens_total["device"] += request.num_cached_tokens
        n = 0
        if request.remote_prefill or (self.pool.enable_caching
                                      and not request.wants_prompt_logprobs):
            n, is_async = self.connector.get_num_new_matched_tokens(
                request, request.num_computed_tokens)
            self.connector.update_state_after_alloc(request, request.block_table, n)
            if n and not is_async:
                request.num_computed_tokens += n
                request.num_cached_tokens += n
                n = 0
        request.status = RequestStatus.WAITING_FOR_KV if n else RequestStatus.RUNNING

    def _take_finished(self) -> None:
        """What the connector settled: loads (the request runs from what landed) and sends
        (a prefill-only request's KV transfer params)."""
        sent, loaded = self.connector.get_finished()
        for request_id, outcome in loaded.items():
            request = self.scheduler.active.get(request_id)
            if request is not None:
                self._load_settled(request, outcome)
        ready, self._ready = self._ready, []
        ready += [(self._sending.pop(rid), params) for rid, params in sent.items()
                  if rid in self._sending]
        for request, params in ready:
            self._events.submit(request.on_kv_transfer_params, params)

    def _load_settled(self, request: Request, outcome: LoadOutcome) -> None:
        """The request runs from the KV that landed (the rest is computed here), unless it was
        aborted meanwhile or its load failed under --kv-load-failure-policy fail."""
        if request.aborted:
            self._finish(request, FinishReason.ABORT, RequestAborted(request.request_id))
            return
        if outcome.failures:
            failure = outcome.failures[0]
            if self.kv_load_failures.record():
                log.warning("KV load of %s failed, ending the request "
                            "(--kv-load-failure-policy fail): %s", request.request_id, failure,
                            extra={"request_id": request.request_id})
                self._finish(request, FinishReason.ERROR,
                             RequestFailed(f"KV load failed: {failure}", KV_LOAD_FAILED))
                return
            log.warning("KV load of %s cut short, computing the rest here: %s",
                        request.request_id, failure, extra={"request_id": request.request_id})
            if request.remote_prefill:
                self.num_fetch_recomputes_total += 1
                self._num_load_recomputed_tokens += (request.num_prompt_tokens - outcome.num_tokens
                                                     - request.num_computed_tokens)
        request.num_computed_tokens += outcome.num_tokens
        if not request.remote_prefill:
            request.num_cached_tokens += outcome.num_tokens
            self.prefix_cache_hit_tokens_total.update(outcome.tokens_by_tier)
        if request.num_computed_tokens >= request.num_prompt_tokens:
            self._cache(request, request.prompt_keys)
        request.status = RequestStatus.RUNNING

    def _abort_now(self, request_id: str) -> None:
        if self.pre_arrival is not None:
            self.pre_arrival.drop(request_id, tell_prefill=True)
        compiling = self._compiling.pop(request_id, None)
        request = (compiling[0] if compiling else self.scheduler.find_waiting(request_id)
                   or self.scheduler.active.get(request_id))
        if request is None:  # not arrived yet (refused when it comes), or finished
            self.connector.abort(request_id)
            self._aborted[request_id] = None
            while len(self._aborted) > MAX_TRACKED_ABORTS:
                self._aborted.popitem(last=False)
        elif request.status is RequestStatus.WAITING_FOR_KV:
            request.aborted = True  # ended once its load settles: it may write its blocks
            self.connector.abort(request_id)
        else:
            self._finish(request, FinishReason.ABORT, RequestAborted(request_id))

    # ---- the step ------------------------------------------------------------------------
    def _schedule_chunks(self, token_budget: int) -> list[tuple[Request, int]]:
        """This step's chunks in ``token_budget`` tokens; a request that runs alone, once
        begun, runs alone to its end, in chunks of the whole budget (its connector plans its
        per-layer sends so; such a request is a prefill instance's, which has no decode
        rows)."""
        request = self._alone
        if request is not None:
            return [(request, min(request.num_prompt_tokens - request.num_computed_tokens,
                                  self.token_budget))]
        chunks = self.scheduler.schedule_chunks(token_budget, self.compute_bound_tokens)
        if len(chunks) == 1 and chunks[0][0].runs_alone:
            self._alone = chunks[0][0]
        return chunks

    def update_from_output(self, output: SchedulerOutput,
                           model_output: ModelRunnerOutput) -> None:
        """The step ran: every scheduled request counts its tokens computed (a prompt just
        completed is cached), and each sampled token is appended, checked against the grammar
        and the stop conditions (engine.core.scheduler.check_stop), and sent out, or ends its
        request."""
        decoding, chunks = output.decoding, output.chunks
        for request in decoding:
            request.num_computed_tokens += 1
            request.num_forward_tokens += 1
        for request, n in chunks:
            before = request.num_computed_tokens
            request.num_computed_tokens += n
            if before < request.num_prompt_tokens <= request.num_computed_tokens:
                self.num_requests_total += 1
                self._cache(request, request.prompt_keys)
                log.debug("prefill of %d tokens (%d cached)", request.num_prompt_tokens,
                          request.num_cached_tokens, extra={"request_id": request.request_id})
        self._count(decoding, chunks)
        if self.kv.sliding_window is not None:
            for request in output.requests:
                if not request.prefill_only:  # a prefill's whole prompt goes to the connector
                    self.kv.release_outside_window(request.block_table,
                                                   request.num_computed_tokens)
        for request, token, logprob in model_output.sampled:
            if request is self._alone:
                self._alone = None
            request.output_ids.append(token)
            grammar = request.grammar
            if grammar is not None and request.grammar_on and not grammar.consume_token(token):
                self._finish(request, FinishReason.ERROR, RequestFailed(
                    f"sampled token {token} outside the grammar: {grammar.get_error()}"),
                    new_tokens=(token,), logprob=logprob)
                continue
            if grammar is not None and not request.grammar_on:  # the reasoning may end here
                end = request.sampling.reasoning_end_token_ids
                request.grammar_on = tuple(request.full_output()[-len(end):]) == end
            finish = check_stop(request, self.eos_token_ids, self.max_model_len)
            if finish is not None:
                self._finish(request, finish, new_tokens=(token,), logprob=logprob)
                continue
            request.emit(self._delta(request, (token,), None, logprob=logprob))
            if self.publish_interval:
                self._save_progress(request)

    def _count(self, decoding: list[Request], chunks: list[tuple[Request, int]]) -> None:
        if decoding:
            self.num_steps_total += 1
            self.num_forward_tokens_total += len(decoding)
        if chunks:
            self.num_prefill_steps_total += 1
            self.num_prefill_chunks_total += len(chunks)
            self.max_prefill_chunks_per_step = max(self.max_prefill_chunks_per_step, len(chunks))
            self.num_prefill_tokens_total += sum(n for _, n in chunks)

    # ---- the end of a request ------------------------------------------------------------
    def _finish(self, request: Request, reason: FinishReason, error: Exception | None = None,
                new_tokens: tuple[int, ...] = (), logprob: TokenLogprob | None = None) -> None:
        """The request leaves: its last delta goes out; when it ended normally its KV's full
        blocks are cached here and handed to the connector (which may save them off the loop),
        else the connector drops what it moves for it; its blocks go back to the pool."""
        if self._alone is request:
            self._alone = None
        if self.pre_arrival is not None:
            self.pre_arrival.drop(request.request_id)  # KV landing that it never took
        normal = error is None and request.num_computed_tokens >= request.num_prompt_tokens
        if normal:
            request.block_keys = tuple(block_keys(request.kv_token_ids(), self.block_size,
                                                  self._namespace(request)))
            self._cache(request, request.block_keys)
        else:
            self.connector.abort(request.request_id)
        request.emit(self._delta(request, new_tokens, reason, error, logprob))
        if error is not None:
            self._notify_error(request, error)
        try:
            # the blocks keep their bytes until this thread allocates again; a table with
            # released blocks (sliding window) no longer holds its prefix, so nothing is saved
            whole = normal and not has_released(request.block_table)
            _, params = self.connector.request_finished(
                request, request.block_table if whole else ())
        except Exception as exc:  # noqa: BLE001 — a prefill's caller gets it; a decode's
            log.exception("the connector failed to take the blocks of %s", request.request_id,
                          extra={"request_id": request.request_id})  # ended well already
            params = exc
        if normal and request.on_kv_transfer_params is not None:
            if params is None:
                self._sending[request.request_id] = request
            else:  # delivered after this step's cache events
                self._ready.append((request, params))
        self.scheduler.finish(request)
        request.swapped = None

    def _notify_error(self, request: Request, error: BaseException) -> None:
        self._sending.pop(request.request_id, None)
        if request.on_kv_transfer_params is not None:
            request.on_kv_transfer_params(error)
            request.on_kv_transfer_params = None  # once

    def _namespace(self, request: Request) -> bytes:
        """What the request's block keys are keyed under: the model, its LoRA adapter and its
        cache salt."""
        return make_namespace(self.model_id, request.cache_salt, request.sampling.lora_name)

    def _cache(self, request: Request, keys: Sequence[bytes]) -> None:
        """The first len(keys) blocks of the request's table become prefix-cache entries under
        ``keys``; a refusal (a block holding another key: a bug) costs hits, never the
        request."""
        if not (self.pool.enable_caching and keys):
            return
        blocks = request.block_table[:len(keys)]
        # released blocks (sliding window) are a prefix of the table: cache the held rest
        held = next((i for i, b in enumerate(blocks) if b != NULL_BLOCK), len(blocks))
        try:
            self.pool.cache_full_blocks(blocks[held:], keys[held:],
                                        keys[held - 1] if held else None)
        except ValueError:
            log.exception("caching the blocks of %s failed", request.request_id,
                          extra={"request_id": request.request_id})

    def _save_progress(self, request: Request) -> None:
        """Every publish_interval more full blocks of a running request's KV, those blocks go
        to the connector (after the token went out; blocks a prefill saved count as out)."""
        tokens = request.kv_token_ids()
        full = len(tokens) // self.block_size
        by_prefill = request.num_prompt_tokens // self.block_size if request.remote_prefill else 0
        if (full < max(request.num_published_blocks, by_prefill) + self.publish_interval
                or has_released(request.block_table)):  # no longer a prefix
            return
        keys = block_keys(tokens, self.block_size, self._namespace(request))
        try:
            self.connector.save_progress(request, keys, request.block_table[:len(keys)])
        except Exception:  # noqa: BLE001 — a lost save costs a later recompute
            log.exception("saving the blocks of %s failed", request.request_id,
                          extra={"request_id": request.request_id})
        request.num_published_blocks = len(keys)

    def _send_events(self) -> None:
        """The pool's cache events to the index, in order with KV transfer params."""
        if self._feed is not None:
            self._feed.send()
        else:
            self.pool.take_events()  # nobody reads them: they must not pile up

    def _delta(self, request: Request, tokens: tuple[int, ...], reason: FinishReason | None,
               error: Exception | None = None, logprob: TokenLogprob | None = None
               ) -> TokenDelta:
        # a prompt computed here says on its first delta what the prefix cache served; after
        # a prefill, the prefill's first token said it
        first = not request.remote_prefill and len(tokens) == len(request.output_ids) > 0
        return TokenDelta(request.request_id, tuple(tokens), reason, request.num_forward_tokens,
                          self.worker_id, self.pid, None if error is None else str(error),
                          logprobs=None if logprob is None else (logprob,),
                          error_code=getattr(error, "error_code", None),
                          num_cached_tokens=request.num_cached_tokens if first else None,
                          prompt_logprobs=tuple(request.prompt_logprobs)
                          if first and request.wants_prompt_logprobs else None)
