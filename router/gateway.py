"""The FastAPI gateway: the OpenAI HTTP API in front of the Conductor and the workers.

Endpoints: POST /v1/completions (SSE streaming and not), GET /v1/models, GET /health.
Errors use OpenAI's error body with 400 for bad input (not FastAPI's 422), 404 for an unknown
model, 503 when the cluster cannot serve.
"""

from __future__ import annotations

import json
import logging
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.protocol import FinishReason, SamplingParams
from engine.sampler import draw_seed
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from router.pipeline import GenerationError, Pipeline
from router.schemas import (CompletionChoice, CompletionRequest, CompletionResponse,
                            ErrorDetail, ErrorResponse, ModelCard, ModelList, Usage,
                            new_request_id)

log = logging.getLogger(__name__)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorDetail(message=message, param=param, code=code,
                                           type=_ERROR_TYPES.get(status, "api_error")))
    return JSONResponse(body.model_dump(), status_code=status)


def build_app(pipeline: Pipeline, tokenizer: Tokenizer, served_model_name: str,
              max_model_len: int) -> FastAPI:
    """The gateway app. pipeline runs requests; max_model_len bounds prompt + max_tokens."""
    app = FastAPI(title="pdcluster", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        return error_response(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}",
                              param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=served_model_name, max_model_len=max_model_len)])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        if body.model != served_model_name:
            raise APIError(404, f"The model `{body.model}` does not exist.", "model",
                           "model_not_found")
        prompt_ids = _prompt_ids(body, tokenizer)
        excess = len(prompt_ids) + body.max_tokens - max_model_len
        if excess > 0:
            raise APIError(400, f"This model's maximum context length is {max_model_len} "
                           f"tokens. However, you requested {len(prompt_ids) + body.max_tokens} "
                           f"tokens ({len(prompt_ids)} in the prompt, {body.max_tokens} for the "
                           f"completion), {excess} over the limit.", "max_tokens")
        sampling = SamplingParams(
            max_tokens=body.max_tokens, temperature=body.temperature,
            seed=body.seed if body.seed is not None else draw_seed(),
            stop_token_ids=tuple(body.stop_token_ids), ignore_eos=body.ignore_eos)
        request_id = new_request_id()
        deltas = pipeline.generate(request_id, prompt_ids, sampling, body.cache_salt)
        try:
            first = await anext(deltas)
        except GenerationError as exc:
            raise APIError(exc.status, str(exc)) from exc
        detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        if body.stream:
            return StreamingResponse(
                _sse(request_id, body, first, deltas, detok),
                media_type="text/event-stream")
        return await _collect(request_id, body, first, deltas, detok, prompt_ids)

    return app


def _prompt_ids(body: CompletionRequest, tokenizer: Tokenizer) -> list[int]:
    if isinstance(body.prompt, str):
        ids = tokenizer.encode(body.prompt)
    else:
        ids = list(body.prompt)
        bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise APIError(400, f"prompt token ids out of range [0, {tokenizer.vocab_size}): "
                           f"{bad[:5]}", "prompt")
    if not ids:
        raise APIError(400, "prompt is empty", "prompt")
    return ids


async def _collect(request_id, body, first, deltas, detok, prompt_ids) -> JSONResponse:
    token_ids: list[int] = list(first.token_ids)
    finish = first.finish_reason
    async for delta in deltas:
        token_ids.extend(delta.token_ids)
        finish = delta.finish_reason or finish
        if delta.finish_reason is FinishReason.ERROR:
            raise APIError(503, delta.error or "generation failed")
    detok.add(token_ids, final=True)
    choice = CompletionChoice(text=detok.text, finish_reason=_finish_text(finish),
                              token_ids=token_ids)
    response = CompletionResponse(
        id=request_id, model=body.model, choices=[choice], prompt_token_ids=prompt_ids,
        usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(token_ids),
                    total_tokens=len(prompt_ids) + len(token_ids)))
    return JSONResponse(_completion_json(response, body.return_token_ids))


async def _sse(request_id, body, first, deltas, detok) -> AsyncIterator[str]:
    try:
        async for chunk in _sse_chunks(request_id, body, first, deltas, detok):
            yield chunk
    finally:
        await deltas.aclose()  # on client disconnect: the pipeline aborts the request


async def _sse_chunks(request_id, body, first, deltas, detok) -> AsyncIterator[str]:
    async def items():
        yield first
        async for delta in deltas:
            yield delta

    async for delta in items():
        if delta.finish_reason is FinishReason.ERROR:
            payload = ErrorResponse(error=ErrorDetail(message=delta.error or "generation failed",
                                                      type="service_unavailable"))
            yield f"data: {payload.model_dump_json()}\n\n"
            break
        text = detok.add(delta.token_ids, final=delta.finish_reason is not None)
        choice = CompletionChoice(text=text, finish_reason=_finish_text(delta.finish_reason),
                                  token_ids=list(delta.token_ids))
        chunk = CompletionResponse(id=request_id, model=body.model, choices=[choice])
        data = _completion_json(chunk, body.return_token_ids)
        del data["usage"]
        yield f"data: {json.dumps(data)}\n\n"
    yield "data: [DONE]\n\n"


def _completion_json(response: CompletionResponse, return_token_ids: bool) -> dict:
    """The OpenAI body; vLLM's token-id fields only when the request asked for them."""
    data = response.model_dump()
    if not return_token_ids:
        del data["prompt_token_ids"]
        for choice in data["choices"]:
            del choice["token_ids"]
    return data


def _finish_text(reason: FinishReason | None) -> str | None:
    if reason is None:
        return None
    return reason.value if reason in (FinishReason.STOP, FinishReason.LENGTH) else "abort"

