"""Runs one request through the disaggregated path: Conductor → prefill actor → decode actor,
and moves it elsewhere when a worker dies under it.

Yields TokenDelta items: the first carries the prefill's token (output token 0); the rest come
from the decode actor, through the gateway's output stream from it (router.decode_outputs).
If the consumer stops early (client disconnect, error), both workers get an idempotent abort
so no block stays held.

Migration (Llumnix, OSDI'24, moves live requests' KV between instances; here the KV pool
holds what moves). When a
call fails with RayActorError (the worker's process is gone), the instance is marked dead in
the registry (router.registry) and the request starts over elsewhere as a new attempt:

    attempt n+1 prompt  = original prompt + every token streamed so far
    attempt n+1 params  = max_tokens/min_tokens minus those tokens, output_offset = their count

so the next prefill loads what the prefix caches and the KV pool hold of that prompt (its
blocks are keyed by their tokens: the prompt's, and the output blocks a decode published with
`--kv-decode-publish-interval`) and recomputes only the rest, samples exactly the
token the dead worker would have sampled next (the sampler draws output token t from the
(seed, t) stream: engine.sampler), and the client stream goes on with no duplicate and no
missing token. A worker that reports an error for the request (a failed KV fetch, a store it
could not reach) gets the same treatment once, on another instance when one is live, except
a KV load that failed under `--kv-load-failure-policy fail`: that request ends with the error,
as the policy asks (a retry would recompute it elsewhere). When no
live instance turns up within `migration_deadline_s`, the request ends: GenerationError if
nothing was streamed yet (the gateway answers 503), else a TokenDelta with FinishReason.ERROR
(the gateway's error event). Each migrated attempt is recorded (Migration: what it loaded and
recomputed; /metrics `pdcluster_migration_tokens_total`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

from ray.exceptions import RayActorError, RayTaskError

from pdcluster.engine.protocol import (KV_LOAD_FAILED, DecodeRequest, FinishReason, FirstToken,
                                       PrefillRequest, PrefillResult, SamplingParams, TokenDelta)
from pdcluster.engine.sampler import draw_seed
from pdcluster.kvstore.errors import KVLoadError
from pdcluster.kvstore.handoff import PrefillHandoff
from pdcluster.router.conductor import (Conductor, Instance, NoInstanceError, RequestRejected,
                                        RouteRequest)
from pdcluster.router.decode_outputs import DecodeOutputs

log = logging.getLogger(__name__)

#: How long a request whose worker died may wait for a live instance to move to, seconds.
MIGRATION_DEADLINE_S = 60.0
#: Attempts of one request in all (the first, plus migrations).
MAX_ATTEMPTS = 8
#: Of those, attempts restarted because a live worker reported an error for the request.
MAX_WORKER_ERROR_RETRIES = 1
_WAIT_POLL_S = 0.1


@dataclass(frozen=True)
class MigrationStats:
    """Attempts moved to another worker, and of the tokens their new workers took over
    (prompt + output so far), those loaded and those recomputed."""

    migrations_total: int
    migration_loaded_tokens_total: int
    migration_recomputed_tokens_total: int


@dataclass(frozen=True)
class Migration:
    """A migrated attempt, as it started on its new worker. num_tokens: its prompt (the
    original prompt + the output so far); num_cached_tokens: of those, the tokens the worker
    loaded (its prefix cache, the KV pool: the blocks the dead worker published) instead of
    computing them."""

    request_id: str
    num_tokens: int
    num_cached_tokens: int

    @property
    def num_recomputed_tokens(self) -> int:
        return self.num_tokens - self.num_cached_tokens


class GenerationError(RuntimeError):
    """A request failed inside the cluster. status: the HTTP status the gateway answers with
    (400 for input the worker refused, 503 when no worker can serve it)."""

    def __init__(self, message: str, status: int = 503) -> None:
        super().__init__(message)
        self.status = status


class _Moved(Exception):
    """The attempt cannot go on where it runs. dead: the worker's process is gone (vs. it
    reported an error for this request)."""

    def __init__(self, instance: Instance, message: str, dead: bool) -> None:
        super().__init__(message)
        self.instance = instance
        self.dead = dead


def resumed_request(prompt: tuple[int, ...], sampling: SamplingParams,
                    generated: list[int]) -> tuple[tuple[int, ...], SamplingParams]:
    """The (prompt, params) that continue a request after `generated` output tokens.

    sampling: the request's original params (output_offset 0); generated: every token streamed
    so far, fewer than sampling.max_tokens. The resumed request's output token t is the
    original's token len(generated) + t, drawn from the same (seed, step) stream.
    """
    k = len(generated)
    if not k:
        return prompt, sampling
    # the prompt's logprobs went out with the first token
    return prompt + tuple(generated), replace(
        sampling, max_tokens=sampling.max_tokens - k,
        min_tokens=max(0, sampling.min_tokens - k), output_offset=k, prompt_logprobs=None)


@dataclass
class _Run:
    """One client request across its attempts."""

    request_id: str
    prompt: tuple[int, ...]
    sampling: SamplingParams
    cache_salt: str | None
    generated: list[int] = field(default_factory=list)
    attempts: int = 0
    worker_errors: int = 0
    failed: set[str] = field(default_factory=set)  # instances that failed this request

    @property
    def attempt_id(self) -> str:
        return self.request_id if self.attempts <= 1 else f"{self.request_id}.m{self.attempts - 1}"

    def resumed(self) -> tuple[tuple[int, ...], SamplingParams]:
        return resumed_request(self.prompt, self.sampling, self.generated)


def _worker_error(exc: Exception, instance: Instance) -> GenerationError:
    if isinstance(exc, RayTaskError) and isinstance(exc.cause, ValueError):
        return GenerationError(str(exc.cause), 400)
    if isinstance(exc, RayActorError) and not isinstance(exc, RayTaskError):
        return GenerationError(f"{instance.role} worker {instance.worker_id} is unavailable")
    cause = exc.cause if isinstance(exc, RayTaskError) else exc
    return GenerationError(f"{instance.role} worker {instance.worker_id} failed: {cause}")


def _moved(exc: Exception, instance: Instance) -> _Moved:
    """A failed call as a reason to move: the process died (RayActorError that is not a task
    error: Ray makes a task error an instance of its cause's class too), or the worker raised."""
    dead = isinstance(exc, RayActorError) and not isinstance(exc, RayTaskError)
    return _Moved(instance, str(_worker_error(exc, instance)), dead)


class Pipeline:
    """Disaggregated: the Conductor's prefill instance computes the prompt and token 0, the
    decode instance pulls the KV and generates the rest; or, where the Conductor's PD decider
    says so, the decode instance prefills the request itself (router.pd_decider)."""

    roles: tuple[str, ...] = ("prefill", "decode")

    def __init__(self, conductor: Conductor,
                 migration_deadline_s: float = MIGRATION_DEADLINE_S) -> None:
        self.conductor = conductor
        self.migration_deadline_s = migration_deadline_s
        self.migrations_total = 0
        self.migration_recomputed_tokens_total = 0
        self.migration_loaded_tokens_total = 0
        #: the latest migrated attempts, oldest first
        self.migrations: deque[Migration] = deque(maxlen=1024)
        self.outputs = DecodeOutputs()
        self._held: Counter[str] = Counter()  # worker id -> attempts routed to it, not ended

    def holds(self, worker_id: str) -> int:
        """Attempts of this gateway routed to `worker_id` and not ended (a drain waits for
        0: a request decided just before the drain still reaches it)."""
        return self._held[worker_id]

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       sampling: SamplingParams,
                       cache_salt: str | None = None) -> AsyncIterator[TokenDelta]:
        """Raises GenerationError before the first item if the request cannot start."""
        if sampling.seed is None:  # every attempt must draw from the same stream
            sampling = replace(sampling, seed=draw_seed())
        run = _Run(request_id, tuple(prompt_token_ids), sampling, cache_salt)
        while True:
            run.attempts += 1
            resumed_at = len(run.prompt) + len(run.generated) if run.attempts > 1 else None
            try:
                async with aclosing(self._attempt(run)) as deltas:
                    async for delta in deltas:
                        if resumed_at is not None:
                            self._migrated(run, resumed_at, delta.num_cached_tokens or 0)
                            resumed_at = None
                        run.generated.extend(delta.token_ids)
                        yield delta if run.attempts == 1 else replace(delta,
                                                                      request_id=request_id)
                        if delta.finish_reason is not None:
                            return
                return
            except _Moved as moved:
                error = await self._before_retry(run, moved)
            except GenerationError as exc:
                if not run.generated:
                    raise
                error = str(exc)
            if error is not None:
                if not run.generated:
                    raise GenerationError(error)
                yield TokenDelta(request_id, (), FinishReason.ERROR, error=error)
                return

    def migration_stats(self) -> MigrationStats:
        return MigrationStats(self.migrations_total, self.migration_loaded_tokens_total,
                              self.migration_recomputed_tokens_total)

    def _migrated(self, run: _Run, num_tokens: int, num_cached_tokens: int) -> None:
        migration = Migration(run.request_id, num_tokens, num_cached_tokens)
        self.migrations.append(migration)
        self.migration_recomputed_tokens_total += migration.num_recomputed_tokens
        self.migration_loaded_tokens_total += num_cached_tokens
        log.info("request %s resumed after %d tokens: %d loaded, %d recomputed",
                 run.request_id, num_tokens, num_cached_tokens, migration.num_recomputed_tokens)

    async def _before_retry(self, run: _Run, moved: _Moved) -> str | None:
        """Marks a dead instance, waits for somewhere to go. Returns None to retry, else the
        error that ends the request."""
        run.failed.add(moved.instance.worker_id)
        if moved.dead:
            self.conductor.registry.mark_dead(moved.instance.worker_id)
        else:
            run.worker_errors += 1
            if run.worker_errors > MAX_WORKER_ERROR_RETRIES:
                return str(moved)
        if run.attempts >= MAX_ATTEMPTS:
            return f"{moved} (gave up after {run.attempts} attempts)"
        log.warning("request %s: %s; migrating after %d tokens", run.request_id, moved,
                    len(run.generated))
        if not await self._wait_for_live(run):
            return (f"{moved}; no live instance to migrate to within "
                    f"{self.migration_deadline_s:g} s")
        self.migrations_total += 1
        return None

    async def _wait_for_live(self, run: _Run) -> bool:
        registry = self.conductor.registry
        deadline = time.monotonic() + self.migration_deadline_s
        while not all(registry.by_role(r) for r in self.roles):
            if time.monotonic() >= deadline or not all(registry.count(r) for r in self.roles):
                return False
            await asyncio.sleep(_WAIT_POLL_S)
        return True

    def _route_request(self, run: _Run, prompt: tuple[int, ...]) -> RouteRequest:
        return RouteRequest(run.attempt_id, prompt, run.cache_salt,
                            lora_name=run.sampling.lora_name)

    def _routing_error(self, run: _Run, exc: NoInstanceError) -> Exception:
        """First attempt: the request cannot start (503, or 429 on admission). Later ones:
        wait for an instance (a rejection is retried until the deadline too)."""
        if run.attempts == 1 and (isinstance(exc, RequestRejected)
                                  or not all(self.conductor.registry.count(r)
                                             for r in self.roles)):
            return GenerationError(str(exc))
        placeholder = Instance("(none)", self.roles[-1], None)
        return _Moved(placeholder, str(exc), dead=True)  # wait for an instance to come back

    async def _attempt(self, run: _Run) -> AsyncIterator[TokenDelta]:
        prompt, params = run.resumed()
        try:
            prefill, decode, kv_plan, local = self.conductor.route(
                self._route_request(run, prompt), run.failed)
        except NoInstanceError as exc:
            raise self._routing_error(run, exc) from exc
        held = (decode.worker_id,) if local else (prefill.worker_id, decode.worker_id)
        self._held.update(held)
        try:
            async with aclosing(self._routed(run, prompt, params, prefill, decode, kv_plan,
                                             local)) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            self._held.subtract(held)

    async def _routed(self, run: _Run, prompt: tuple[int, ...], params: SamplingParams,
                      prefill: Instance, decode: Instance, kv_plan, local: bool
                      ) -> AsyncIterator[TokenDelta]:
        if local:
            async with aclosing(_decode_only(run, decode, prompt, params,
                                             self.outputs)) as deltas:
                async for delta in deltas:
                    yield delta
            return
        attempt_id = run.attempt_id
        stream = prefill.handle.prefill.options(num_returns="streaming").remote(
            PrefillRequest(attempt_id, prompt, params, run.cache_salt,
                           PrefillHandoff(decode.worker_id, kv_plan).to_params()))
        prefill_done = False
        try:
            first: FirstToken = await _next_from(stream, prefill)
            prefill_done = True
        finally:
            # the measured prefill calibrates the Conductor's queue predictions
            self.conductor.prefill_done(attempt_id, ok=prefill_done)
            if not prefill_done:  # cancelled while waiting: the prefill may still be queued
                _abort(prefill, attempt_id)
        handed_to_decode = False
        try:
            yield TokenDelta(attempt_id, (first.token,), None,
                             logprobs=None if first.logprob is None else (first.logprob,),
                             extra={"prefill_worker_id": first.prefill_worker_id,
                                    "prefill_pid": first.prefill_pid},
                             num_cached_tokens=first.num_cached_tokens,
                             prompt_logprobs=first.prompt_logprobs)
            # the first token went out while the prefill published the KV the decode needs
            result: PrefillResult = await _next_from(stream, prefill)
            handed_to_decode = True  # from here the decode's abort releases what it holds
            request = DecodeRequest(attempt_id, prompt, params, result, run.cache_salt)
            async with aclosing(_stream_decode(decode, request, self.outputs)) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            if not handed_to_decode:  # closed before the decode took over: the prefill
                _abort(prefill, attempt_id)  # releases its tail


async def _next_from(stream, prefill: Instance):
    """The prefill stream's next item (PrefillWorker.prefill). Raises _Moved when the worker
    died or failed the request, GenerationError (via _worker_error) when it refused the
    input or its KV load failed under the fail policy."""
    try:
        return await (await stream.__anext__())
    except (RayTaskError, RayActorError) as exc:
        if isinstance(exc, RayTaskError) and isinstance(exc.cause, (ValueError, KVLoadError)):
            raise _worker_error(exc, prefill) from exc  # the input, or the policy: no retry
        raise _moved(exc, prefill) from exc


class ColocatedPipeline(Pipeline):
    """Colocated (`--colocated`): one decode instance prefills and decodes, no KV transfer."""

    roles = ("decode",)

    async def _attempt(self, run: _Run) -> AsyncIterator[TokenDelta]:
        prompt, params = run.resumed()
        try:
            decode = self.conductor.route_decode(self._route_request(run, prompt), run.failed)
        except NoInstanceError as exc:
            raise self._routing_error(run, exc) from exc
        async with aclosing(_decode_only(run, decode, prompt, params, self.outputs)) as deltas:
            async for delta in deltas:
                yield delta


async def _decode_only(run: _Run, decode: Instance, prompt: tuple[int, ...],
                       params: SamplingParams, outputs: DecodeOutputs
                       ) -> AsyncIterator[TokenDelta]:
    """The attempt on `decode` alone: it prefills the prompt (its own prefix cache serves what
    it holds) and generates, with no KV transfer."""
    request = DecodeRequest(run.attempt_id, prompt, params, cache_salt=run.cache_salt)
    async with aclosing(_stream_decode(decode, request, outputs)) as stream:
        async for delta in stream:
            yield delta


async def _stream_decode(decode: Instance, request: DecodeRequest,
                         outputs: DecodeOutputs) -> AsyncIterator[TokenDelta]:
    """The request's deltas from the decode instance (submitted under the gateway's output
    stream, router.decode_outputs), up to the one that finishes it; an explicit abort if the
    consumer stops early (the engine runs on otherwise). Raises _Moved when the worker dies or
    ends the request with an error."""
    finished = False
    subscriber, queue = outputs.register(decode, request.request_id)
    try:
        await decode.handle.submit.remote(request, subscriber)
        while not finished:
            delta = await queue.get()
            if isinstance(delta, BaseException):
                # the instance's output stream failed; a worker still alive gets the abort
                if isinstance(delta, (RayTaskError, RayActorError)):
                    raise _moved(delta, decode) from delta
                raise _Moved(decode, f"decode worker {decode.worker_id}: {delta}",
                             dead=True) from delta
            finished = delta.finish_reason is not None
            if delta.finish_reason is FinishReason.ERROR:
                message = f"decode worker {decode.worker_id} failed: {delta.error}"
                if delta.error_code == KV_LOAD_FAILED:
                    raise GenerationError(message)
                raise _Moved(decode, message, dead=False)
            yield delta
    except (RayTaskError, RayActorError) as exc:
        finished = True
        raise _moved(exc, decode) from exc
    finally:
        outputs.release(decode, request.request_id)
        if not finished:
            _abort(decode, request.request_id)


def _abort(instance: Instance, request_id: str) -> None:
    try:
        instance.handle.abort.remote(request_id)
    except RayActorError:
        log.warning("abort of %s on dead %s worker", request_id, instance.role)
