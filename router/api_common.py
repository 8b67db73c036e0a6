"""What the OpenAI endpoints share: errors, context-length checks, choice specs, the response
(streamed as SSE or whole), usage accounting and logprob token strings."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import time
from dataclasses import dataclass, replace
from typing import AsyncIterator, Awaitable, Callable, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdcluster.engine.core.structured_output import GrammarError
from pdcluster.engine.protocol import StructuredOutputSpec
from pdcluster.engine.sampler import draw_seed
from pdcluster.engine.tokenizer import Tokenizer, TokenizerError
from pdcluster.router.conductor import RequestRejected
from pdcluster.router.inflight import Overloaded
from pdcluster.router.pipeline import GenerationError
from pdcluster.router.reasoning import THINK_END, THINK_START, TOOL_CALL, ReasoningParser
from pdcluster.router.schemas import MAX_BAD_WORDS_TOKENS, SamplingFields, StreamOptions
from pdcluster.router.serving import ChoiceDelta, ChoiceSpec, GenerationService
from pdcluster.router.structured_outputs import GrammarCheck
from pdcluster.router.tool_calls import ToolCalling

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
    """What every endpoint needs. max_seqs_per_request: prompts × n one request may run
    (None: no cap of its own; the gate still bounds it); priority_scheduling: the workers
    run --scheduling-policy priority, so a request's `priority` is served; lora_names: the
    LoRA adapters a request may name as its `model` (engine.lora)."""

    service: GenerationService
    tokenizer: Tokenizer
    served_model_name: str
    max_model_len: int
    max_seqs_per_request: int | None = None
    grammars: GrammarCheck | None = None  # None: compiled only by the workers
    tool_calling: ToolCalling = ToolCalling()
    reasoning: ReasoningParser | None = None  # --reasoning-parser
    priority_scheduling: bool = False
    lora_names: tuple[str, ...] = ()  # --lora-modules: served under these model ids

    def structured_output(self, body: SamplingFields) -> StructuredOutputSpec | None:
        """The request's grammar, compiled once here. Raises APIError(400) naming what is
        wrong with it."""
        param = "response_format" if body.response_format is not None else "structured_outputs"
        try:
            spec = body.structured_output()
        except ValueError as exc:
            raise APIError(400, str(exc), param) from exc
        if spec is not None:
            self.check_grammar(spec, param)
        return spec

    def check_grammar(self, spec: StructuredOutputSpec, param: str) -> None:
        """Raises APIError(400) naming `param` when `spec` does not compile."""
        try:
            if self.grammars is not None:
                self.grammars.check(spec)
        except GrammarError as exc:
            raise APIError(400, f"{param}: {exc}", param) from exc

    def bad_words_token_ids(self, body: SamplingFields) -> tuple[tuple[int, ...], ...]:
        """body.bad_words as token-id sequences, as vLLM's SamplingParams.update_from_tokenizer
        makes them: each word with its leading spaces stripped, then also with one space
        before it when that gives another first token and as many tokens (a word mid-text).
        Also checks the ids of logit_bias and allowed_token_ids. Raises APIError(400) naming
        the field for an id outside the vocabulary, a word with no tokens, or more than
        MAX_BAD_WORDS_TOKENS tokens in all (vLLM's limit)."""
        vocab = self.tokenizer.vocab_size
        for param, ids in (("logit_bias", body.logit_bias or {}),
                           ("allowed_token_ids", body.allowed_token_ids or ())):
            outside = sorted(t for t in ids if t >= vocab)
            if outside:
                raise APIError(400, f"{param}: token id {outside[0]} is outside the vocabulary "
                               f"[0, {vocab})", param)
        words: list[tuple[int, ...]] = []
        for i, word in enumerate(body.bad_words or ()):
            plain = tuple(self.encode(word.lstrip(), "bad_words", add_special_tokens=False))
            if not plain:
                raise APIError(400, f"bad_words[{i}] {word!r} has no tokens", "bad_words")
            spaced = tuple(self.encode(" " + word.lstrip(), "bad_words",
                                       add_special_tokens=False))
            words.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                words.append(spaced)
        if sum(map(len, words)) > MAX_BAD_WORDS_TOKENS:
            raise APIError(400, f"bad_words make {sum(map(len, words))} tokens; the limit is "
                           f"{MAX_BAD_WORDS_TOKENS}", "bad_words")
        return tuple(words)

    def check_model(self, model: str) -> None:
        """Raises APIError(404) unless `model` is the served model or one of its adapters."""
        if model != self.served_model_name and model not in self.lora_names:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    def lora_name(self, model: str) -> str | None:
        """The LoRA adapter a request's `model` names, None for the base model."""
        return model if model in self.lora_names else None

    def check_num_sequences(self, num_prompts: int, n: int) -> None:
        """Raises APIError(400, reason too_many_sequences) when num_prompts × n is over the
        per-request cap: one request must not hold the gate on its own."""
        cap = self.max_seqs_per_request
        if cap is not None and num_prompts * n > cap:
            raise APIError(400, f"This request asks for {num_prompts} prompt(s) × n={n} = "
                           f"{num_prompts * n} sequences; the limit is {cap} per request "
                           "(--max-seqs-per-request). Split it into smaller requests.",
                           "n" if num_prompts == 1 else "prompt", "too_many_sequences",
                           reason="too_many_sequences")

    @functools.cached_property
    def reasoning_markers(self) -> dict[str, tuple[int, ...]]:
        """The tokenizer's ids of the reasoning markers (router.reasoning), encoded once."""
        return {m: tuple(self.tokenizer.encode(m, add_special_tokens=False))
                for m in (THINK_START, THINK_END, TOOL_CALL)}

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """The tokenizer's ids of `text`. Raises APIError(400) for text it cannot take (a lone
        surrogate, which JSON's \\uD800 escapes can carry)."""
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except TokenizerError as exc:
            raise APIError(400, f"{param}: {exc}", param) from exc

    def truncated(self, prompt_ids: list[int], body: SamplingFields) -> list[int]:
        """prompt_ids cut to body.truncate_prompt_tokens (vLLM's: -1 means max_model_len − 1,
        leaving a token for the output; the last tokens are kept unless truncation_side is
        "right"). Raises APIError(400) for 0 or a size over max_model_len, as vLLM does."""
        size = body.truncate_prompt_tokens
        if size is None:
            return prompt_ids
        size = self.max_model_len - 1 if size == -1 else size
        if not 0 < size <= self.max_model_len:
            raise APIError(400, f"truncate_prompt_tokens must be -1 or in [1, max_model_len "
                           f"{self.max_model_len}], got {body.truncate_prompt_tokens}",
                           "truncate_prompt_tokens")
        return prompt_ids[:size] if body.truncation_side == "right" else prompt_ids[-size:]

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


def build_specs(ctx: ServingContext, body: SamplingFields, prompts: list[list[int]],
                max_tokens: list[int], logprobs: int | None,
                structured_output: StructuredOutputSpec | None = None,
                per_prompt: int | None = None,
                reasoning_end: tuple[int, ...] = ()) -> list[ChoiceSpec]:
    """`per_prompt` (default n) choices per prompt, index = prompt × per_prompt + i. With a
    seed, choice k uses seed + k, so choice 0 of n equals the single choice of the same request
    with n = 1. reasoning_end: SamplingParams.reasoning_end_token_ids."""
    if body.priority and not ctx.priority_scheduling:  # vLLM refuses it so too
        raise APIError(400, f"priority {body.priority} needs --scheduling-policy priority; "
                       "this server schedules first come, first served", "priority")
    specs = []
    per_prompt = per_prompt or body.n
    bad_words = ctx.bad_words_token_ids(body)
    for p, prompt in enumerate(prompts):
        for i in range(per_prompt):
            index = p * per_prompt + i
            seed = (body.seed + index) % 2**63 if body.seed is not None else draw_seed()
            try:
                # max_tokens 0 (prompt only) runs one token, which the choice drops
                params = replace(body.sampling_params(max(1, max_tokens[p]), logprobs, seed,
                                                      structured_output, bad_words,
                                                      reasoning_end),
                                 lora_name=ctx.lora_name(body.model))
            except ValueError as exc:
                raise APIError(400, str(exc)) from exc
            specs.append(ChoiceSpec(index, prompt, params, body.stop_strings(),
                                    prompt_only=max_tokens[p] == 0,
                                    include_stop_str_in_output=body.include_stop_str_in_output,
                                    skip_special_tokens=body.skip_special_tokens))
    return specs


async def respond(ctx: ServingContext, body: SamplingFields, request_id: str,
                  prompts: list[list[int]], specs: list[ChoiceSpec], obj: str, chunk_obj: str,
                  choice: Callable[[ChoiceDelta], dict],
                  whole: Callable[[list[ChoiceDelta]], dict] | None = None,
                  select: Callable[[list[ChoiceDelta]], list[ChoiceDelta]] | None = None,
                  reasoning_tokens: Callable[[ChoiceDelta], int] | None = None) -> Response:
    """Runs `specs` and answers: with body.stream, SSE chunks of object `chunk_obj`, each with
    the one choice `choice(delta)` (see sse); else one `obj` with `choice(folded delta)` per
    choice in index order, the usage and, with return_token_ids, the prompt's ids (a list of
    them for several prompts), and the fields `whole(choices)` adds; `select` picks the
    choices shown from all that ran (unstreamed only; usage counts all). With
    `reasoning_tokens` (fed each delta, it returns the request's reasoning tokens so far) the
    usage has `completion_tokens_details.reasoning_tokens`. Raises APIError as start_stream
    does and, unstreamed, as collect does."""
    first, rest = await start_stream(ctx, request_id, specs, body.cache_salt)
    head = envelope(request_id, chunk_obj if body.stream else obj, body.model)
    num_prompt_tokens = sum(len(p) for p in prompts)
    if body.stream:
        return StreamingResponse(sse(first, rest, choice, head, num_prompt_tokens,
                                     body.stream_options, body.n, reasoning_tokens),
                                 media_type="text/event-stream")
    choices = await collect(first, rest, len(specs))
    cached = {c.index: c.num_cached_tokens for c in choices}
    shown = select(choices) if select is not None else choices
    reasoning = None
    if reasoning_tokens is not None:
        for c in choices:
            reasoning = reasoning_tokens(c)
    response = {**head, "choices": [choice(c) for c in shown],
                "usage": usage(num_prompt_tokens, sum(len(c.token_ids) for c in choices),
                               cached_tokens(cached, len(choices) // len(prompts)), reasoning)}
    if body.return_token_ids:
        response["prompt_token_ids"] = prompts if len(prompts) > 1 else prompts[0]
    if whole is not None:
        response.update(whole(choices))
    return JSONResponse(response)


async def start_stream(ctx: ServingContext, request_id: str, specs: list[ChoiceSpec],
                       cache_salt: str | None) -> tuple[ChoiceDelta, AsyncIterator[ChoiceDelta]]:
    """Starts generation and waits for the first delta, so a request that cannot start gets
    an HTTP error instead of a 200 stream: 503 + Retry-After when the in-flight gate refuses
    it (overloaded or draining). Returns (first delta, the rest)."""
    stream = ctx.service.stream(request_id, specs, cache_salt)
    try:
        first = await anext(stream)
    except asyncio.CancelledError:  # the client went away while the request was starting
        await stream.aclose()
        raise
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
            if delta.stop_reason is not None:
                acc.stop_reason = delta.stop_reason
            if acc.num_cached_tokens is None:
                acc.num_cached_tokens = delta.num_cached_tokens
            if acc.prompt_logprobs is None:
                acc.prompt_logprobs = delta.prompt_logprobs
    except GenerationError as exc:
        log.warning("request failed: %s", exc)
        raise APIError(exc.status, str(exc)) from exc
    finally:
        await rest.aclose()  # cancelled (client gone): aborts the requests on the workers
    return out


async def sse(first: ChoiceDelta, rest: AsyncIterator[ChoiceDelta],
              choice: Callable[[ChoiceDelta], dict], head: dict, prompt_tokens: int,
              stream_options: StreamOptions | None, choices_per_prompt: int = 1,
              reasoning_tokens: Callable[[ChoiceDelta], int] | None = None
              ) -> AsyncIterator[str]:
    """SSE frames, one per delta: `head` with the one choice `choice(delta)`; then `[DONE]`.
    With stream_options include_usage, a last chunk (`head` with no choices) carries the
    request's usage; with continuous_usage_stats (vLLM's extension), every chunk also carries
    the usage so far (with reasoning_tokens as respond's). A mid-stream failure becomes an
    error event."""
    completion_tokens, reasoning = 0, None
    cached: dict[int, int | None] = {}
    include_usage = bool(stream_options and stream_options.include_usage)
    continuous = include_usage and stream_options.continuous_usage_stats
    try:
        async for delta in _chain(first, rest):
            completion_tokens += len(delta.token_ids)
            if cached.get(delta.index) is None:
                cached[delta.index] = delta.num_cached_tokens
            if reasoning_tokens is not None:
                reasoning = reasoning_tokens(delta)
            frame = {**head, "choices": [choice(delta)]}
            if continuous:
                frame["usage"] = usage(prompt_tokens, completion_tokens,
                                       cached_tokens(cached, choices_per_prompt), reasoning)
            yield f"data: {json.dumps(frame)}\n\n"
        if include_usage:
            last = {**head, "choices": [], "usage": usage(
                prompt_tokens, completion_tokens, cached_tokens(cached, choices_per_prompt),
                reasoning)}
            yield f"data: {json.dumps(last)}\n\n"
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


def usage(prompt_tokens: int, completion_tokens: int, cached: int | None = None,
          reasoning: int | None = None) -> dict:
    """OpenAI's usage object; with `cached`, `prompt_tokens_details.cached_tokens` too, and
    with `reasoning`, `completion_tokens_details.reasoning_tokens`."""
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
    if cached is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached}
    if reasoning is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return body


def cached_tokens(by_choice: dict[int, int | None], choices_per_prompt: int) -> int | None:
    """A request's cached prompt tokens: as `prompt_tokens` counts each prompt once, the sum
    over prompts of what the first choice of each (index p·n) found cached. None until one of
    them has reported."""
    firsts = [n for index, n in by_choice.items()
              if index % choices_per_prompt == 0 and n is not None]
    return sum(firsts) if firsts else None


def envelope(request_id: str, obj: str, model: str, created: int | None = None) -> dict:
    return {"id": request_id, "object": obj, "created": created or int(time.time()),
            "model": model}


async def until_disconnected(request: Request, handler: Awaitable[Response]) -> Response:
    """Runs an endpoint's `handler`, cancelled when the client disconnects first.

    Cancelling closes the request's generation stream, which aborts every sequence on its
    workers (streamed responses are already cancelled that way by Starlette; this covers the
    time before a stream starts and every non-streamed request). The body has been read, so
    the next ASGI message is the disconnect. The handler runs in the calling task, so what it
    binds in context variables (the request id of the access log) stays visible after it.
    """
    task = asyncio.current_task()
    state = {"finished": False, "disconnected": False}

    async def watch() -> None:
        await _disconnected(request)
        if not state["finished"]:
            state["disconnected"] = True
            task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await handler
    except asyncio.CancelledError:
        if not state["disconnected"]:
            raise
        task.uncancel()
        log.info("client disconnected; request aborted")
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        state["finished"] = True  # no await between the handler's end and this line
        watcher.cancel()


#: nginx's status for a request whose client went away; no one receives it.
CLIENT_CLOSED_REQUEST = 499


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


_UNION_TYPE_NAMES = {"str": "a string", "int": "an integer", "float": "a number",
                     "bool": "a boolean", "list[str]": "a list of strings",
                     "list[int]": "a list of integers", "list[TextPart]":
                     "a list of content parts", "dict": "an object"}


def validation_error(errors: Sequence[dict]) -> APIError:
    """The 400 for pydantic's errors about a request body, naming the field and what it
    expected: a feature this server does not support is named as such; the alternatives of a
    union field (e.g. `stop`: a string or a list of strings) are listed together instead of
    reporting the first failed one; invalid JSON says so."""
    unsupported = [e for e in errors if e.get("type") == "unsupported_feature"]
    if unsupported:
        first = unsupported[0]
        loc = _field_path(first.get("loc", ()))
        field = first.get("ctx", {}).get("field")
        param = loc or field
        return APIError(400, first["msg"], param, "unsupported_feature")
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(400, "request body is not valid JSON: "
                        f"{first.get('ctx', {}).get('error', '')}".strip())
    loc = [p for p in first.get("loc", ()) if p != "body"]
    tag_at = next((i for i, p in enumerate(loc) if isinstance(p, str) and _is_union_tag(p)),
                  None)
    param = _field_path(loc) or None
    if tag_at is not None:
        head = loc[:tag_at]
        # an alternative of the input's own type that failed inside (17 stop strings where
        # 16 are accepted, a number among strings) says more than the list of types
        for e in errors:
            other = [p for p in e.get("loc", ()) if p != "body"]
            if other[:tag_at] == head and len(other) > tag_at and (
                    len(other) > tag_at + 1 or not str(e.get("type", "")).endswith("_type")):
                where = _field_path(head + other[tag_at + 1:])
                ctx = e.get("ctx") or {}
                message = (f"at most {ctx['max_length']} items are accepted "
                           f"(got {ctx['actual_length']})" if e.get("type") == "too_long"
                           and "actual_length" in ctx else e.get("msg", "invalid value"))
                return APIError(400, f"{where}: {message}", _field_path(head))
        alternatives = []
        for e in errors:
            other = [p for p in e.get("loc", ()) if p != "body"]
            if other[:tag_at] == head and len(other) > tag_at:
                name = _UNION_TYPE_NAMES.get(str(other[tag_at]), str(other[tag_at]))
                if name not in alternatives:
                    alternatives.append(name)
        param = _field_path(head)
        got = type(first.get("input")).__name__
        return APIError(400, f"{param}: expected {' or '.join(alternatives)} "
                        f"(got {_JSON_TYPE_NAMES.get(got, got)})", param)
    if first.get("type") in ("max_tokens_zero", "best_of"):
        return APIError(400, first["msg"], "max_tokens" if first["type"] == "max_tokens_zero"
                        else "best_of")
    if first.get("type") == "prompt_invalid":
        return APIError(400, first["msg"], param)
    return APIError(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}", param)


_JSON_TYPE_NAMES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean",
                    "dict": "object", "list": "array", "NoneType": "null"}


def _is_union_tag(part: str) -> bool:
    # pydantic names a union member in `loc` by its type ("str", "list[str]", "TextPart")
    return part in _UNION_TYPE_NAMES or "[" in part or part[:1].isupper()


def _field_path(loc: Sequence) -> str:
    return ".".join(str(p) for p in loc if p != "body" and not
                    (isinstance(p, str) and _is_union_tag(p)))
