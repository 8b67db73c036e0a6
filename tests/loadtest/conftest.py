"""A real HTTP stub of an OpenAI-compatible streaming server, run in-process on 127.0.0.1 (port
0) in its own thread and event loop.

It streams one SSE chunk per token, ends with a usage chunk when asked
(`stream_options.include_usage`), keeps vLLM-style prefix-cache counters over an infinite cache
of 16-token blocks of prompts (queries += prompt tokens; hits += leading cached full-block
tokens, capped so the last prompt token is computed), exposes them on /metrics and reports a
request's hits as its usage's `prompt_tokens_details.cached_tokens`. With `return_token_ids`
token i of a reply is id 3 + i % 100. `behavior(body)` picks what
happens to a request: "ok", "fail" (HTTP 500), "stall" (no reply), "stall_mid" (2 tokens,
then nothing), "error_mid" (2 tokens, then an error object).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections.abc import Callable

import pytest
from aiohttp import web

from tests.markers import starts

BLOCK = 16


class StubServer:
    def __init__(self) -> None:
        self.behavior: Callable[[dict], str] = lambda body: "ok"
        self.token_delay_s = 0.002
        self.max_model_len = 512
        self.queried = 0
        self.hits = {"device": 0, "host": 0}
        self.bodies: list[dict] = []
        self._seen: set[bytes] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self.url = ""

    # -- lifecycle
    def start(self) -> StubServer:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("stub server did not start")
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._completions)
        self._runner = web.AppRunner(app, shutdown_timeout=0.2)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self._ready.set()
        self._loop.run_forever()

    # -- handlers
    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": "stub-model", "object": "model", "max_model_len": self.max_model_len}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        lines = ["# HELP pdcluster_prefix_cache_queried_tokens_total prompt tokens looked up",
                 "# TYPE pdcluster_prefix_cache_queried_tokens_total counter",
                 f"pdcluster_prefix_cache_queried_tokens_total {float(self.queried)}",
                 "# HELP pdcluster_prefix_cache_hit_tokens_total prompt tokens from cache",
                 "# TYPE pdcluster_prefix_cache_hit_tokens_total counter"]
        lines += [f'pdcluster_prefix_cache_hit_tokens_total{{tier="{t}"}} {float(v)}'
                  for t, v in self.hits.items()]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    def _count_prefix(self, prompt: list[int]) -> int:
        keys, prev = [], b""
        for i in range(len(prompt) // BLOCK):
            block = json.dumps(prompt[i * BLOCK:(i + 1) * BLOCK]).encode()
            prev = hashlib.sha256(prev + block).digest()
            keys.append(prev)
        cached = 0
        while cached < len(keys) and keys[cached] in self._seen:
            cached += 1
        hit = min(cached * BLOCK, BLOCK * ((len(prompt) - 1) // BLOCK))
        self.queried += len(prompt)
        self.hits["device"] += min(hit, 2 * BLOCK)   # first two blocks "on device", rest "host"
        self.hits["host"] += max(hit - 2 * BLOCK, 0)
        self._seen.update(keys)
        return hit

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        mode = self.behavior(body)
        if mode == "fail":
            return web.json_response({"error": {"message": "injected failure",
                                                "type": "server_error"}}, status=500)
        if mode == "stall":
            await asyncio.sleep(30)
        cached = self._count_prefix(body["prompt"])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        n = int(body["max_tokens"])
        for i in range(n):
            if mode in ("stall_mid", "error_mid") and i == 2:
                if mode == "stall_mid":
                    await asyncio.sleep(30)
                await self._send(response, {"error": {"message": "injected mid-stream error",
                                                      "type": "server_error"}})
                return response
            choice = {"index": 0, "text": f" t{i}",
                      "finish_reason": "length" if i == n - 1 else None}
            if body.get("return_token_ids"):
                choice["token_ids"] = [3 + i % 100]
            await self._send(response, {"id": "x", "object": "text_completion",
                                        "choices": [choice]})
            await asyncio.sleep(self.token_delay_s)
        if (body.get("stream_options") or {}).get("include_usage"):
            await self._send(response, {"id": "x", "choices": [], "usage": {
                "prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                "total_tokens": len(body["prompt"]) + n,
                "prompt_tokens_details": {"cached_tokens": cached}}})
        await response.write(b"data: [DONE]\n\n")
        return response

    @staticmethod
    async def _send(response: web.StreamResponse, data: dict) -> None:
        await response.write(f"data: {json.dumps(data)}\n\n".encode())


@pytest.fixture
@starts("server")
def stub_server():
    server = StubServer().start()
    try:
        yield server
    finally:
        server.stop()
