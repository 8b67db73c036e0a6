"""What the OpenAI endpoints share: errors, context-length checks, choice specs, SSE framing,
usage accounting and logprob token strings."""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from engine.sampler import draw_seed
from engine.tokenizer import Tokenizer
from router.conductor import RequestRejected
from router.inflight import Overloaded
from router.pipeline import GenerationError
from router.schemas import SamplingFields
from router.serving import ChoiceDelta, ChoiceSpec, GenerationService

log = logging.getLogger(__name__)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error",
                500: "internal_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error answered with OpenAI's error body and `status`. headers: extra response
    headers (Retry-After on 429); reason: the `pdcluster_requests_rejected_total` label
    (default: by status)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None,
                 reason: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers, self.reason = headers, reason

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _ERROR_TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ServingContext:
    service: GenerationService
    tokenizer: Tokenizer
    served_model_name: str
    max_model_len: int

    def check_model(self, model: str) -> None:
        if model != self.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    def max_tokens_for(self, prompt_ids: list[int], requested: int | None, param: str) -> int:
        """The request's max_tokens, or the rest of the context if None.

        Raises APIError(400) when prompt + max_tokens exceeds max_model_len, saying by how much.
        """
        n_prompt = len(prompt_ids)
        total = n_prompt + (requested if requested is not None else 1)
        if total > self.max_model_len:
            asked = f"{requested} for the completion" if requested is not None else \
                "at least 1 for the completion"
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} "
                           f"tokens. However, you requested {total} tokens ({n_prompt} in the "
                           f"prompt, {asked}), {total - self.max_model_len} over the limit.",
                           param)
        return requested if requested is not None else self.max_model_len - n_prompt


def build_specs(body: SamplingFields, prompts: list[list[int]], max_tokens: list[int],
                logprobs: int | None) -> list[ChoiceSpec]:
    """n choices per prompt, index = prompt × n + i. With a seed, choice k uses seed + k, so
    choice 0 of n equals the single choice of the same request with n = 1."""
    specs = []
    for p, prompt in enumerate(prompts):
        for i in range(body.n):
            index = p * body.n + i
            seed = (body.seed + index) % 2**63 if body.seed is not None else draw_seed()
            try:
                params = body.sampling_params(max_tokens[p], logprobs, seed)
            except ValueError as exc:
                raise APIError(400, str(exc)) from exc
            specs.append(ChoiceSpec(index, prompt, params, body.stop_strings()))
    return specs


async def start_stream(ctx: ServingContext, request_id: str, specs: list[ChoiceSpec],
                       cache_salt: str | None) -> tuple[ChoiceDelta, AsyncIterator[ChoiceDelta]]:
    """Starts generation and waits for the first delta, so a request that cannot start gets
    an HTTP error instead of a 200 stream: 503 + Retry-After when the in-flight gate refuses
    it (overloaded or draining). Returns (first delta, the rest)."""
    stream = ctx.service.stream(request_id, specs, cache_salt)
    try:
        first = await anext(stream)
    except Overloaded as exc:
        await stream.aclose()
        raise APIError(503, str(exc), code=exc.reason, reason=exc.reason,
                       headers={"Retry-After": _retry_after(exc.retry_after_s)}) from exc
    except GenerationError as exc:
        await stream.aclose()
        raise _start_error(exc) from exc
    return first, stream


def _retry_after(seconds: float) -> str:
    """Retry-After in whole seconds (RFC 9110 §10.2.3), at least 1."""
    return str(max(1, math.ceil(seconds)))


def _start_error(exc: GenerationError) -> APIError:
    """A rejection by admission control (the Conductor's RequestRejected, wrapped by the
    pipeline) is 429 with Retry-After, counted under its reason; anything else keeps its
    status."""
    cause = exc.__cause__
    if isinstance(cause, RequestRejected):
        rejection = cause.rejection
        return APIError(429, str(cause), code=rejection.reason,
                        headers={"Retry-After": _retry_after(rejection.retry_after_s)},
                        reason=rejection.reason)
    return APIError(exc.status, str(exc))


async def collect(first: ChoiceDelta, rest: AsyncIterator[ChoiceDelta],
                  num_choices: int) -> list[ChoiceDelta]:
    """Folds all deltas into one ChoiceDelta per choice, in index order."""
    out = [ChoiceDelta(i, "", []) for i in range(num_choices)]
    try:
        async for delta in _chain(first, rest):
            acc = out[delta.index]
            acc.text += delta.text
            acc.token_ids += delta.token_ids
            acc.logprobs += delta.logprobs
            acc.finish_reason = delta.finish_reason or acc.finish_reason
    except GenerationError as exc:
        log.warning("request failed: %s", exc)
        raise APIError(exc.status, str(exc)) from exc
    return out


async def sse(first: ChoiceDelta, rest: AsyncIterator[ChoiceDelta],
              chunk: Callable[[ChoiceDelta], dict],
              usage_chunk: Callable[[int], dict] | None) -> AsyncIterator[str]:
    """SSE frames of `chunk(delta)` per delta, then the usage chunk (given the completion
    token count) when asked for, then `[DONE]`. A mid-stream failure becomes an error event."""
    completion_tokens = 0
    try:
        async for delta in _chain(first, rest):
            completion_tokens += len(delta.token_ids)
            yield f"data: {json.dumps(chunk(delta))}\n\n"
        if usage_chunk is not None:
            yield f"data: {json.dumps(usage_chunk(completion_tokens))}\n\n"
    except GenerationError as exc:
        log.warning("stream ended by an error: %s", exc)
        yield f"data: {json.dumps(APIError(exc.status, str(exc)).body())}\n\n"
    finally:
        await rest.aclose()  # on client disconnect: aborts the requests on the workers
    yield "data: [DONE]\n\n"


async def _chain(first: ChoiceDelta, rest: AsyncIterator[ChoiceDelta]) -> AsyncIterator[ChoiceDelta]:
    yield first
    async for delta in rest:
        yield delta


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(request_id: str, obj: str, model: str, created: int | None = None) -> dict:
    return {"id": request_id, "object": obj, "created": created or int(time.time()),
            "model": model}
