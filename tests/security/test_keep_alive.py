"""The gateway's keep-alive: a connection idle between requests is closed after
`keep_alive_timeout_s`, and at `max_connections` a new connection takes the place of the
longest idle one (as nginx reuses idle keep-alive connections), a 503 only when none is idle.

A real uvicorn server with the gateway's protocol (tests/background_server.py) serves a trivial
FastAPI app; clients are raw TCP sockets.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from fastapi import FastAPI

from tests.background_server import BackgroundServer
from tests.markers import starts
from tests.raw_sockets import connect, read_response, read_until_closed

pytestmark = pytest.mark.timeout(60)

KEEP_ALIVE_S = 1.0
#: how long after its timeout a connection may still be open on a loaded machine
CLOSE_SLACK_S = 15.0
HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
PARTIAL_HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\n"


def _app(held: threading.Semaphore | None = None,
         release: threading.Event | None = None) -> FastAPI:
    """/health, and /hold: answers once `release` is set, after signalling `held`."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/hold")
    async def hold() -> dict:
        held.release()
        while not release.is_set():
            await asyncio.sleep(0.01)
        return {"status": "released"}

    return app


def _served(sock) -> bool:
    sock.sendall(HEAD)
    return read_response(sock).startswith(b"HTTP/1.1 200 ")


@starts("server")
def test_idle_connection_closes_after_the_keep_alive_timeout():
    with BackgroundServer(_app(), keep_alive_timeout_s=KEEP_ALIVE_S) as server, \
            connect(server.url) as s:
        assert _served(s)
        idle_from = time.monotonic()
        assert read_until_closed(s, idle_from + KEEP_ALIVE_S + CLOSE_SLACK_S) == b""
        assert time.monotonic() - idle_from >= KEEP_ALIVE_S * 0.9


@starts("server")
def test_default_keep_alive_outlives_a_client_pool_of_five_seconds():
    """httpx's pool (and uvicorn's own default) keep 5 s: the gateway must still answer there."""
    with BackgroundServer(_app()) as server, connect(server.url) as s:
        assert _served(s)
        time.sleep(5.5)
        assert _served(s)


@starts("server")
def test_at_the_cap_a_new_connection_replaces_the_longest_idle_one():
    held, release = threading.Semaphore(0), threading.Event()
    with BackgroundServer(_app(held, release), max_connections=3) as server:
        url = server.url
        with connect(url) as oldest, connect(url) as newer, connect(url) as busy:
            assert _served(oldest)
            assert _served(newer)
            busy.sendall(PARTIAL_HEAD)  # never answered, so never idle
            with connect(url) as fresh:
                assert _served(fresh)
                assert read_until_closed(oldest, time.monotonic() + CLOSE_SLACK_S) == b""
                assert _served(newer)  # kept: only one place was needed
                # newer and fresh wait on a handler: then nothing is idle
                for sock in (newer, fresh):
                    sock.sendall(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
                    assert held.acquire(timeout=CLOSE_SLACK_S)
                with connect(url) as over:
                    refused = read_until_closed(over, time.monotonic() + CLOSE_SLACK_S)
                assert refused.startswith(b"HTTP/1.1 503 "), refused
                release.set()
                assert read_response(newer).endswith(b'{"status":"released"}')
