"""The FastAPI gateway: the OpenAI HTTP API in front of the Conductor and the workers.

Endpoints: POST /v1/completions and /v1/chat/completions (SSE streaming and not),
GET /v1/models and /v1/models/{id}, GET /health, GET /metrics (Prometheus, the whole cluster).
Errors use OpenAI's error body: 400 for bad input (never FastAPI's 422; a field vLLM or OpenAI
defines that this server lacks is named, router/unsupported_fields.py), including more
sequences than one request may run (reason too_many_sequences), 404 for an unknown model, 413
for a body over the limit, 429 with Retry-After when admission control refuses a request
(counted by reason: ttft_slo, tbt_slo, decode_kv_full), 500 for a bug (the message names the
request id its log record carries), 503 when the cluster cannot serve, and 503 with
Retry-After when the fair queue in front of the in-flight gate is full (reason overloaded) or
the gateway is draining (reason draining; /health answers 503 {"status": "draining"} then, so
load balancers stop sending). A client that disconnects aborts its request, streamed or not.

Each request's id is set in engine.logs' context variable, so every log record about it (here,
in the pipeline, in the Conductor) carries `request_id`.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdcluster.engine.logs import request_id_var
from pdcluster.engine.tokenizer import Tokenizer
from pdcluster.router.api_common import (APIError, ServingContext, until_disconnected,
                                         validation_error)
from pdcluster.router.chat import create_chat_completion
from pdcluster.router.chat_template import ChatTemplate
from pdcluster.router.completions import create_completion
from pdcluster.router.inflight import InflightGate
from pdcluster.router.metrics import ClusterStatsCollector, GatewayMetrics, exposition
from pdcluster.router.pipeline import Pipeline
from pdcluster.router.schemas import ChatCompletionRequest, CompletionRequest
from pdcluster.router.reasoning import ReasoningParser
from pdcluster.router.responses import ResponsesRequest, create_response
from pdcluster.router.serving import GenerationService
from pdcluster.router.structured_outputs import GrammarCheck
from pdcluster.router.tool_calls import ToolCalling
from pdcluster.router.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 << 20
_REJECT_REASONS = {400: "invalid_request", 404: "unknown_model", 413: "body_too_large",
                   500: "internal_error", 503: "unavailable"}


def build_app(pipeline: Pipeline, tokenizer: Tokenizer, served_model_name: str,
              max_model_len: int, chat_template: ChatTemplate,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              gate: InflightGate | None = None,
              max_seqs_per_request: int | None = None,
              tool_calling: ToolCalling = ToolCalling(),
              worker_health: Callable[[], dict] | None = None,
              eos_token_ids: frozenset[int] | None = None,
              reasoning: ReasoningParser | None = None,
              priority_scheduling: bool = False,
              lora_modules: dict[str, str] | None = None) -> FastAPI:
    """The gateway app. max_model_len bounds prompt + max_tokens; max_body_bytes bounds a
    request body (larger ones get 413 before they are read whole); gate bounds and queues the
    sequences in flight (default: unbounded); max_seqs_per_request caps prompts × n of one
    request (400 over it; default: no cap); tool_calling: --tool-call-parser and
    --enable-auto-tool-choice; worker_health: what /health says of the workers (dead and
    hung ones; a worker marked dead makes the status "degraded", still 200: the gateway
    serves, and a liveness probe must not restart it for a worker); eos_token_ids: the
    model's (default: the tokenizer's); reasoning: --reasoning-parser; priority_scheduling:
    the workers run --scheduling-policy priority (else a request's `priority` other than 0
    gets 400); lora_modules: the workers' LoRA adapters (name -> directory), served as models
    of their own (vLLM's model cards: `parent` the base model, `root` the directory).
    `app.state.service`
    (a GenerationService, with its gate) is what a drain (deploy/serve.py) acts on."""
    metrics = GatewayMetrics()
    service = GenerationService(pipeline, tokenizer, metrics, gate, eos_token_ids)
    cluster_stats = ClusterStatsCollector(pipeline.conductor.registry, service.gate,
                                          lambda: pipeline.conductor.pd_decisions,
                                          pipeline.migration_stats)
    ctx = ServingContext(service, tokenizer, served_model_name, max_model_len,
                         max_seqs_per_request, GrammarCheck(tokenizer), tool_calling, reasoning,
                         priority_scheduling, tuple(lora_modules or ()))
    app = FastAPI(title="pdcluster", docs_url=None, redoc_url=None)
    app.state.service = service
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        reason = exc.reason or _REJECT_REASONS.get(exc.status, str(exc.status))
        metrics.rejected.labels(reason=reason).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        error = validation_error(exc.errors())
        metrics.rejected.labels(reason="invalid_request").inc()
        return JSONResponse(error.body(), status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        # a bug must still answer with OpenAI's body; the log record carries the trace and,
        # through engine.logs' context variable, the request id the message names
        request_id = request_id_var.get()
        log.error("unhandled error on %s %s (request %s)", request.method, request.url.path,
                  request_id, exc_info=exc)
        where = f" (request {request_id})" if request_id else ""
        return JSONResponse(APIError(500, f"internal server error{where}; the server log has "
                                          "the details").body(), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(),
                            status_code=exc.status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        if service.gate.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        workers = worker_health() if worker_health is not None else {}
        status = "degraded" if workers.get("dead_workers") else "ok"
        return JSONResponse({"status": status, **{k: v for k, v in workers.items() if v}})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body = exposition(metrics, await cluster_stats.scrape())
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    created = int(time.time())
    cards = {served_model_name: {"id": served_model_name, "object": "model", "created": created,
                                 "owned_by": "pdcluster", "max_model_len": max_model_len}}
    for name, path in (lora_modules or {}).items():
        cards[name] = {"id": name, "object": "model", "created": created, "owned_by": "pdcluster",
                       "root": path, "parent": served_model_name, "max_model_len": max_model_len}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": list(cards.values())}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        ctx.check_model(model_id)
        return cards[model_id]

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await until_disconnected(request, create_completion(body, ctx))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await until_disconnected(request, create_chat_completion(body, ctx,
                                                                        chat_template))

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return await until_disconnected(request, create_response(body, ctx, chat_template))

    @app.post("/tokenize")
    async def tokenize_endpoint(body: TokenizeRequest) -> dict:
        return tokenize(body, ctx, chat_template)

    @app.post("/detokenize")
    async def detokenize_endpoint(body: DetokenizeRequest) -> dict:
        return detokenize(body, ctx)

    return app


class BodySizeLimit:
    """ASGI middleware: answers 413 when a body exceeds max_bytes, by Content-Length up front
    or by counting a chunked body as it arrives."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._reject(send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # FastAPI re-raises HTTPException from the body
                    raise StarletteHTTPException(413, self._message())
            return message

        await self.app(scope, limited_receive, send)

    def _message(self) -> str:
        return f"request body exceeds {self.max_bytes} bytes"

    async def _reject(self, send: Send) -> None:
        response = JSONResponse(APIError(413, self._message()).body(), status_code=413)
        await response({"type": "http"}, _empty_receive, send)


async def _empty_receive() -> Message:
    return {"type": "http.disconnect"}
