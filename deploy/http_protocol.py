"""uvicorn's h11 protocol with the limits a gateway needs against slow or idle clients.

uvicorn bounds only the idle time between requests (`timeout_keep_alive`). A client that sends
a request head byte by byte, or never finishes it (slowloris), or sends a head and then no
body, holds its connection for ever, and any number of connections is accepted.
`GatewayH11Protocol` adds, per connection:

- **a head deadline** (nginx's `client_header_timeout`, Apache mod_reqtimeout's `header=`):
  a new connection must deliver a complete head within `header_timeout_s` of being accepted;
  on a kept-alive connection the idle wait stays uvicorn's (`timeout_keep_alive`), and once
  the next request's first bytes arrive its head must be complete within `header_timeout_s`.
  The clock stops when h11 parses a complete `h11.Request`.
- **a body deadline** (nginx's `client_body_timeout`): while a request's body is still to
  come, at most `body_timeout_s` may pass between two reads of it. A body the app has not read
  yet (uvicorn paused reading) is not the client's delay and does not count. A slow handler or
  a streamed response is not covered.
- **a connection cap** (nginx's `limit_conn`): a connection accepted while `max_connections`
  others are open takes the place of the one idle longest between requests, which is closed
  (as nginx reuses idle keep-alive connections when it runs out); with none idle it is
  answered at once with `503 Service Unavailable` (`Retry-After: 1`,
  `Connection: close`) and closed after a short linger, so the client reads the answer
  instead of a reset.

The keep-alive wait itself is uvicorn's `timeout_keep_alive`, which `pdcluster serve` sets
from `--keep-alive-timeout-s` (75 s, nginx's default; uvicorn's own is 5 s). It must outlast
the idle time of the clients' connection pools (httpx 5 s, aiohttp 15 s, a load balancer's
60 s): a client that sends on a connection the server is closing at that moment loses the
request. AWS's guidance for targets behind its load balancers says the same.

On a head or body timeout the client gets `408 Request Timeout` with `Connection: close` when
nothing of a response was written yet, and the connection is closed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

log = logging.getLogger(__name__)

#: Default deadline for a complete request head, seconds (ServeConfig.header_timeout_s).
DEFAULT_HEADER_TIMEOUT_S = 30.0
#: Default longest wait between two reads of a request body, seconds (ServeConfig.body_timeout_s).
DEFAULT_BODY_TIMEOUT_S = 30.0
#: Default wait between requests on a kept-alive connection, seconds
#: (ServeConfig.keep_alive_timeout_s; nginx's keepalive_timeout).
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 75.0
#: How long a refused connection stays open after its 503, reading and dropping what the
#: client sends (closing on unread bytes would reset the connection before the client reads).
REFUSED_LINGER_S = 1.0


def _raw_response(status: str, body: bytes, extra: bytes = b"") -> bytes:
    # Written raw, not through h11: h11 lets a server respond only after it has parsed a
    # request, and here there may be none. The connection is closed right after, so h11's
    # state no longer matters.
    return (b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
            + b"content-length: " + str(len(body)).encode() + b"\r\n" + extra
            + b"connection: close\r\n\r\n" + body)


_HEAD_TIMEOUT_RESPONSE = _raw_response("408 Request Timeout", b"request header timed out")
_BODY_TIMEOUT_RESPONSE = _raw_response("408 Request Timeout", b"request body timed out")
_OVER_CAP_RESPONSE = _raw_response("503 Service Unavailable",
                                   b"too many connections to this gateway", b"retry-after: 1\r\n")


class GatewayH11Protocol(H11Protocol):
    """uvicorn's `H11Protocol` with a head deadline, a body deadline and a connection cap
    (module docstring). Pass a class made by `gateway_protocol` as `uvicorn.Config(http=...)`;
    uvicorn instantiates it once per connection.
    """

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_connections: int | None = None

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self.refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.max_connections is not None and sum(
                not getattr(c, "refused", False) for c in self.connections) > self.max_connections:
            idle = [c for c in self.connections if c is not self and _idle_since(c) is not None]
            if not idle:
                self._refuse()
                return
            min(idle, key=_idle_since).timeout_keep_alive_handler()
        # A connection that sends nothing at all is as costly as one that sends half a head.
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return  # read and dropped until the linger ends
        super().data_received(data)
        self._update_timers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # uvicorn has just started the next cycle; a pipelined partial head may sit in h11's
        # buffer with no further data_received to come.
        self._update_timers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._cancel_body_timer()
        super().connection_lost(exc)

    def _update_timers(self) -> None:
        """Keep the head timer running exactly while bytes of a request head are pending, and
        restart the body timer on every read while a body is.

        h11's client state is IDLE until it has parsed a complete request head; with bytes
        received (or buffered) in that state, a head is under way. IDLE with nothing received
        is the keep-alive wait, which uvicorn's own timer governs. SEND_BODY: the head is in,
        the body is not complete.
        """
        state = self.conn.their_state
        if self.transport.is_closing() or state is not h11.IDLE:
            self._cancel_head_timer()
        elif self._head_timer is None and self.conn.trailing_data[0]:
            self._arm_head_timer()
        self._cancel_body_timer()
        if state is h11.SEND_BODY and not self.transport.is_closing():
            self._body_timer = self.loop.call_later(self.body_timeout_s, self._on_body_timeout)

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._on_head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self._close_timed_out("request head", self.header_timeout_s, _HEAD_TIMEOUT_RESPONSE,
                                  self.conn.our_state is h11.IDLE)

    def _on_body_timeout(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        if self.flow.read_paused:  # the app has not taken what came: not the client's wait
            self._body_timer = self.loop.call_later(self.body_timeout_s, self._on_body_timeout)
            return
        self._close_timed_out("request body", self.body_timeout_s, _BODY_TIMEOUT_RESPONSE,
                              self.cycle is None or not self.cycle.response_started)

    def _close_timed_out(self, what: str, timeout_s: float, response: bytes,
                         unanswered: bool) -> None:
        log.debug("closing %s: %s not received within %g s",
                  "%s:%d" % self.client if self.client else "a connection", what, timeout_s)
        if unanswered:  # nothing of a response has been written
            self.transport.write(response)
        try:
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:
            pass  # h11 already in an error state: closing the transport is all that is left
        self.transport.close()  # the app's receive() then returns http.disconnect

    def _refuse(self) -> None:
        self.refused = True
        log.warning("refusing a connection from %s: %d connections open (--max-connections)",
                    "%s:%d" % self.client if self.client else "a client", self.max_connections)
        self.transport.write(_OVER_CAP_RESPONSE)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(REFUSED_LINGER_S, self.transport.close)


def _idle_since(protocol: Any) -> float | None:
    """When `protocol`'s keep-alive timer fires (loop time) if the connection waits between
    requests with nothing of a next one received; else None."""
    timer = getattr(protocol, "timeout_keep_alive_task", None)
    if timer is None or protocol.transport.is_closing():
        return None
    if protocol.cycle is not None and not protocol.cycle.response_complete:
        return None
    if protocol.conn.their_state is not h11.IDLE or protocol.conn.trailing_data[0]:
        return None
    return timer.when()


def gateway_protocol(header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                     body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
                     max_connections: int | None = None) -> type[GatewayH11Protocol]:
    """The protocol class to pass as `uvicorn.Config(http=...)`: a head deadline of
    `header_timeout_s` seconds, at most `body_timeout_s` between two reads of a body (both
    > 0), at most `max_connections` connections open (None: no cap; else ≥ 1).

    A subclass, not a functools.partial: uvicorn declares `http` as a protocol class and reads
    class attributes from it (e.g. `alpn_protocols`).

    Raises ValueError when a timeout is not positive or the cap is below 1.
    """
    for name, value in (("header_timeout_s", header_timeout_s),
                        ("body_timeout_s", body_timeout_s)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    if max_connections is not None and max_connections < 1:
        raise ValueError(f"max_connections must be >= 1, got {max_connections!r}")
    return type(GatewayH11Protocol.__name__, (GatewayH11Protocol,),
                {"header_timeout_s": float(header_timeout_s),
                 "body_timeout_s": float(body_timeout_s), "max_connections": max_connections,
                 "__module__": __name__})
