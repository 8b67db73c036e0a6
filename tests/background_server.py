"""A uvicorn server on a daemon thread, for tests that talk HTTP to a real gateway."""

from __future__ import annotations

import threading
import time

import uvicorn

from pdcluster.deploy.http_protocol import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S,
                                            DEFAULT_KEEP_ALIVE_TIMEOUT_S, gateway_protocol)


class BackgroundServer:
    """A context manager serving an ASGI app by uvicorn on a daemon thread:
    `with BackgroundServer(app) as srv: httpx.get(srv.url + "/health")`.

    Connections are served by the gateway's protocol (deploy/http_protocol.py): one that sends
    no complete request head within `header_timeout_s` seconds, or whose body stops for
    `body_timeout_s`, or that waits `keep_alive_timeout_s` between requests, is closed; past
    `max_connections` open ones a new connection replaces an idle one or is refused.

    Raises RuntimeError when the server has not started within `start_timeout_s` seconds.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning", start_timeout_s: float = 30.0,
                 header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                 body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
                 max_connections: int | None = None,
                 keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S) -> None:
        self.server = uvicorn.Server(uvicorn.Config(
            app, host=host, port=port, log_level=log_level, lifespan="off",
            timeout_keep_alive=keep_alive_timeout_s,
            http=gateway_protocol(header_timeout_s, body_timeout_s, max_connections)))
        self.start_timeout_s = start_timeout_s
        self._thread = threading.Thread(target=self.server.run, name="gateway", daemon=True)
        self.url = ""

    def __enter__(self) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("gateway did not start")
            time.sleep(0.05)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)
