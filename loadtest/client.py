"""Async streaming client for OpenAI-compatible /v1/completions, one record per request.

Timing follows `vllm bench serve`'s OpenAI completions client
(vllm/benchmarks/lib/endpoint_request_func.py): the clock starts just before the POST; every
SSE chunk that carries a non-empty `choices` list is a token event (its text may be empty);
TTFT is the time to the first token event, ITL gets one entry per later token event (the gap to
the previous one), and E2E latency is the time to the last token event. The output length is
`usage.completion_tokens` from the final usage chunk (`stream_options.include_usage`) when the
server sends one; otherwise the sum of `token_ids` lengths when the server returns them
(`return_token_ids`), else the number of chunks with non-empty text. With `return_token_ids`
the record keeps the output ids (a multi-turn conversation appends them to its next prompt),
and `cached_tokens` is the usage's `prompt_tokens_details.cached_tokens` when the server
reports it (OpenAI's field; pdcluster always, vLLM with --enable-prompt-tokens-details).

A request fails — recorded, never raised — on a non-200 status, an `error` object in the stream,
no token event before the stream ends, a connection error, or the client timeout (`timeout_s`
for the whole request, so a stalled server is cut off and counted).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field

import aiohttp

from pdcluster.loadtest.workload import BenchRequest


@dataclass(frozen=True)
class ClientConfig:
    """How to send requests.

    Attributes:
        api_url: full URL of the completions endpoint, e.g. http://127.0.0.1:8000/v1/completions.
        model: the `model` field.
        timeout_s: client timeout for a whole request (connect to last byte), seconds.
        ignore_eos: send `ignore_eos` so every request generates exactly `max_tokens`.
        stream_usage: send `stream_options: {"include_usage": true}`.
        return_token_ids: send vLLM's/pdcluster's `return_token_ids` (not standard OpenAI).
        temperature: sampling temperature (0 = greedy, as vLLM's benchmark sends).
        extra_body: more JSON fields merged into every request body.
        headers: extra HTTP headers.
    """

    api_url: str
    model: str
    timeout_s: float = 600.0
    ignore_eos: bool = True
    stream_usage: bool = True
    return_token_ids: bool = False
    temperature: float = 0.0
    extra_body: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)

    def body(self, request: BenchRequest) -> dict:
        body = {"model": self.model, "prompt": request.prompt, "max_tokens": request.output_len,
                "temperature": self.temperature, "stream": True}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.stream_usage:
            body["stream_options"] = {"include_usage": True}
        if self.return_token_ids:
            body["return_token_ids"] = True
        body.update(self.extra_body)
        return body


@dataclass
class RequestRecord:
    """What happened to one request. Times in seconds; `start_s` and `arrival_s` relative to
    the benchmark start. `itl_s` has one entry per token event after the first."""

    index: int
    prompt_len: int
    expected_output_len: int
    arrival_s: float
    start_s: float = 0.0
    success: bool = False
    error: str = ""
    http_status: int | None = None
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    e2el_s: float = 0.0
    output_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    cached_tokens: int | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> RequestRecord:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


async def send_request(session: aiohttp.ClientSession, config: ClientConfig,
                       request: BenchRequest, t0: float) -> RequestRecord:
    """Send `request`, stream the reply, and return its record (failures included).
    `t0` is the benchmark start on the `time.perf_counter()` clock."""
    record = RequestRecord(index=request.index, prompt_len=request.prompt_len,
                           expected_output_len=request.output_len, arrival_s=request.arrival_s)
    stream = _StreamState()
    st = time.perf_counter()
    record.start_s = st - t0
    try:
        async with asyncio.timeout(config.timeout_s):
            async with session.post(config.api_url, json=config.body(request),
                                    headers=config.headers or None) as response:
                record.http_status = response.status
                if response.status != 200:
                    text = (await response.text())[:300]
                    record.error = f"HTTP {response.status}: {text}"
                    return record
                async for raw in response.content:
                    if stream.feed(raw, time.perf_counter()):
                        break
    except TimeoutError:
        record.error = f"client timeout after {config.timeout_s:g} s"
        return record
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    return stream.finish(record, st)


class _StreamState:
    """Folds SSE lines into token-event times and counts."""

    def __init__(self) -> None:
        self.event_times: list[float] = []
        self.chunk_tokens = 0
        self.usage_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.token_ids: list[int] = []
        self.error = ""

    def feed(self, raw: bytes, now: float) -> bool:
        """Consume one SSE line; True when the stream is over ([DONE] or an error)."""
        line = raw.strip()
        if not line.startswith(b"data:"):
            return False
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return True
        data = json.loads(payload)
        if isinstance(data, dict) and data.get("error"):
            error = data["error"]
            self.error = error.get("message", str(error)) if isinstance(error, dict) else str(error)
            return True
        if choices := data.get("choices"):
            self.event_times.append(now)
            choice = choices[0]
            token_ids = choice.get("token_ids")
            if token_ids is not None:
                self.chunk_tokens += len(token_ids)
                self.token_ids.extend(int(t) for t in token_ids)
            elif choice.get("text"):
                self.chunk_tokens += 1
        elif (usage := data.get("usage")) and usage.get("completion_tokens") is not None:
            self.usage_tokens = int(usage["completion_tokens"])
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                self.cached_tokens = int(details["cached_tokens"])
        return False

    def finish(self, record: RequestRecord, st: float) -> RequestRecord:
        if self.error:
            record.error = f"stream error: {self.error}"
            return record
        if not self.event_times:
            record.error = "no token received before the stream ended"
            return record
        times = self.event_times
        record.ttft_s = times[0] - st
        record.itl_s = [b - a for a, b in zip(times, times[1:])]
        record.e2el_s = times[-1] - st
        record.output_tokens = (self.usage_tokens if self.usage_tokens is not None
                                else self.chunk_tokens)
        record.output_token_ids = self.token_ids
        record.cached_tokens = self.cached_tokens
        record.success = True
        return record


async def list_models(session: aiohttp.ClientSession, base_url: str) -> list[dict]:
    """The `data` list of `GET {base_url}/v1/models` (each has `id`; pdcluster and vLLM add
    `max_model_len`).

    Raises:
        RuntimeError: the endpoint is unreachable or lists no model.
    """
    try:
        async with session.get(f"{base_url}/v1/models") as response:
            response.raise_for_status()
            data = await response.json()
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        raise RuntimeError(f"cannot list models at {base_url}/v1/models: {exc}") from exc
    models = data.get("data") if isinstance(data, dict) else None
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return models
