"""Runs one request through the disaggregated path: Conductor → prefill actor → decode actor.

Yields TokenDelta items: the first carries the prefill's token (output token 0); the rest come
from the decode actor's streaming generator. If the consumer stops early (client disconnect,
error), both workers get an idempotent abort so no block stays held.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator

import ray
from ray.exceptions import RayActorError, RayTaskError

from engine.protocol import (DecodeRequest, FinishReason, PrefillRequest, SamplingParams,
                             TokenDelta)
from router.conductor import Conductor, Instance, NoInstanceError, RouteRequest

log = logging.getLogger(__name__)


class GenerationError(RuntimeError):
    """A request failed inside the cluster. status: the HTTP status the gateway answers with
    (400 for input the worker refused, 503 when no worker can serve it)."""

    def __init__(self, message: str, status: int = 503) -> None:
        super().__init__(message)
        self.status = status


def _worker_error(exc: Exception, instance: Instance) -> GenerationError:
    if isinstance(exc, RayTaskError) and isinstance(exc.cause, ValueError):
        return GenerationError(str(exc.cause), 400)
    if isinstance(exc, RayActorError):
        return GenerationError(f"{instance.role} worker {instance.worker_id} is unavailable")
    cause = exc.cause if isinstance(exc, RayTaskError) else exc
    return GenerationError(f"{instance.role} worker {instance.worker_id} failed: {cause}")


class Pipeline:
    """Disaggregated: the Conductor's prefill instance computes the prompt and token 0, the
    decode instance pulls the KV and generates the rest."""

    def __init__(self, conductor: Conductor) -> None:
        self.conductor = conductor

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       sampling: SamplingParams,
                       cache_salt: str | None = None) -> AsyncIterator[TokenDelta]:
        """Raises GenerationError before the first item if the request cannot start."""
        prompt = tuple(prompt_token_ids)
        try:
            prefill, decode = self.conductor.route(RouteRequest(request_id, prompt, cache_salt))
        except NoInstanceError as exc:
            raise GenerationError(str(exc)) from exc
        prefill_done = False
        try:
            result = await prefill.handle.prefill.remote(
                PrefillRequest(request_id, prompt, sampling, cache_salt, decode.worker_id))
            prefill_done = True
        except (RayTaskError, RayActorError) as exc:
            raise _worker_error(exc, prefill) from exc
        finally:
            # the measured prefill calibrates the Conductor's queue predictions
            self.conductor.prefill_done(request_id, ok=prefill_done)
            if not prefill_done:  # cancelled while waiting: the prefill may still be queued
                _abort(prefill, request_id)
        first_logprobs = None if result.first_logprob is None else (result.first_logprob,)
        yield TokenDelta(request_id, (result.first_token,), None, logprobs=first_logprobs,
                         extra={"prefill_worker_id": result.prefill_worker_id,
                                "prefill_pid": result.prefill_pid})
        async for delta in _stream_decode(decode, DecodeRequest(request_id, prompt, sampling,
                                                                result)):
            yield delta


class ColocatedPipeline(Pipeline):
    """Colocated (`--colocated`): one decode instance prefills and decodes, no KV transfer."""

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       sampling: SamplingParams,
                       cache_salt: str | None = None) -> AsyncIterator[TokenDelta]:
        prompt = tuple(prompt_token_ids)
        try:
            decode = self.conductor.route_decode(RouteRequest(request_id, prompt, cache_salt))
        except NoInstanceError as exc:
            raise GenerationError(str(exc)) from exc
        async for delta in _stream_decode(decode, DecodeRequest(request_id, prompt, sampling)):
            yield delta


async def _stream_decode(decode: Instance, request: DecodeRequest) -> AsyncIterator[TokenDelta]:
    """The decode instance's stream; an explicit abort if the consumer stops early (a Ray
    streaming generator runs on when dropped)."""
    finished = False
    stream = decode.handle.generate.options(num_returns="streaming").remote(request)
    try:
        async for ref in stream:
            delta: TokenDelta = await ref
            finished = delta.finish_reason is not None
            yield delta
    except (RayTaskError, RayActorError) as exc:
        finished = True
        yield TokenDelta(request.request_id, (), FinishReason.ERROR,
                         error=str(_worker_error(exc, decode)))
    finally:
        if not finished:
            _abort(decode, request.request_id)


def _abort(instance: Instance, request_id: str) -> None:
    try:
        instance.handle.abort.remote(request_id)
    except RayActorError:
        log.warning("abort of %s on dead %s worker", request_id, instance.role)
