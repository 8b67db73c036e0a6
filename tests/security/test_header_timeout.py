"""The gateway closes connections that send no complete request head in time (slowloris).

A real uvicorn server (tests/background_server.py's BackgroundServer, so the protocol of
deploy/http_protocol.py) serves a trivial FastAPI app with a 1 s header timeout; raw TCP sockets
send partial heads and must be closed by the server within a bound, while complete requests,
slow handlers and heads that finish in time are served as before.
"""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest
from fastapi import FastAPI

from tests.background_server import BackgroundServer
from tests.markers import starts
from tests.raw_sockets import connect, read_response, read_until_closed

pytestmark = pytest.mark.timeout(60)

HEADER_TIMEOUT_S = 1.0
#: How long after its timeout a connection may still be open: generous, as a loaded machine
#: needs (the bound is against a connection left open, which nothing else here would close;
#: that the head timer closed it, not something sooner, is the lower bound of
#: _assert_partial_head_closed)
CLOSE_SLACK_S = 15.0
SLOW_HANDLER_S = 2.0
PARTIAL_HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\n"
FULL_HEAD = PARTIAL_HEAD + b"\r\n"


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/slow")
    async def slow() -> dict:
        await asyncio.sleep(SLOW_HANDLER_S)
        return {"status": "slow"}

    return app


@pytest.fixture(scope="module")
@starts("server")
def url():
    with BackgroundServer(_app(), header_timeout_s=HEADER_TIMEOUT_S) as server:
        yield server.url


def _assert_timed_out(received: bytes) -> None:
    """Closing silently and answering 408 first are both a correct close."""
    assert received == b"" or received.startswith(b"HTTP/1.1 408 "), received


def _assert_partial_head_closed(sock: socket.socket) -> None:
    """Send a partial head on `sock` and assert the server closes it after the timeout."""
    sock.sendall(PARTIAL_HEAD)
    sent = time.monotonic()
    _assert_timed_out(read_until_closed(sock, sent + HEADER_TIMEOUT_S + CLOSE_SLACK_S))
    assert time.monotonic() - sent >= HEADER_TIMEOUT_S * 0.9


def test_partial_heads_are_closed_while_others_are_served(url):
    started = time.monotonic()
    socks = [connect(url) for _ in range(50)]
    try:
        for s in socks:
            s.sendall(PARTIAL_HEAD)
        # the stuck connections do not keep a fresh one from being served meanwhile
        assert httpx.get(f"{url}/health", timeout=5).json() == {"status": "ok"}
        deadline = started + HEADER_TIMEOUT_S + CLOSE_SLACK_S
        for s in socks:
            _assert_timed_out(read_until_closed(s, deadline))
    finally:
        for s in socks:
            s.close()
    assert httpx.get(f"{url}/health", timeout=5).json() == {"status": "ok"}


def test_silent_connection_is_closed(url):
    with connect(url) as s:
        _assert_timed_out(read_until_closed(s, time.monotonic() + HEADER_TIMEOUT_S
                                             + CLOSE_SLACK_S))


def test_partial_head_after_keep_alive_is_closed(url):
    with connect(url) as s:
        s.sendall(FULL_HEAD)
        assert read_response(s).startswith(b"HTTP/1.1 200 ")
        # uvicorn's keep-alive timer is cancelled by these bytes: only the head timer is left
        _assert_partial_head_closed(s)


def test_idle_keep_alive_outlives_header_timeout(url):
    """The wait between requests stays the keep-alive timeout, not the head's; the next head
    is still timed."""
    with connect(url) as s:
        s.sendall(FULL_HEAD)
        assert read_response(s).startswith(b"HTTP/1.1 200 ")
        time.sleep(HEADER_TIMEOUT_S + 0.5)
        s.sendall(FULL_HEAD)
        assert read_response(s).startswith(b"HTTP/1.1 200 ")
        _assert_partial_head_closed(s)


def test_slow_handler_is_not_cut(url):
    """The timer covers the head only: a handler running past it completes, while a partial
    head sent at the same time is closed."""
    with connect(url) as slow, connect(url) as stuck:
        started = time.monotonic()
        slow.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        _assert_partial_head_closed(stuck)
        response = read_response(slow)
    assert response.startswith(b"HTTP/1.1 200 ") and response.endswith(b'{"status":"slow"}')
    assert time.monotonic() - started >= SLOW_HANDLER_S


def test_head_completed_in_time_is_served(url):
    """A head sent in pieces within the timeout is served; the next head on the same
    connection gets a timer of its own."""
    with connect(url) as s:
        half = len(FULL_HEAD) // 2
        s.sendall(FULL_HEAD[:half])
        time.sleep(0.3)
        s.sendall(FULL_HEAD[half:])
        response = read_response(s)
        assert response.startswith(b"HTTP/1.1 200 ") and response.endswith(b'{"status":"ok"}')
        _assert_partial_head_closed(s)
