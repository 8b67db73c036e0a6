"""uvicorn's h11 protocol with a request-head timeout.

uvicorn bounds only the idle time between requests (`timeout_keep_alive`); a client that sends
a request head byte by byte, or never finishes it (slowloris), holds its connection for ever.
`HeaderTimeoutH11Protocol` gives every request head a deadline:

- a new connection must deliver a complete head within `header_timeout_s` of being accepted;
- on a kept-alive connection the idle wait stays uvicorn's (`timeout_keep_alive`); once the
  next request's first bytes arrive, its head must be complete within `header_timeout_s`;
- the clock stops when h11 parses a complete `h11.Request`: the body and the handler are not
  covered (a slow handler, a streamed response, a large upload all run as before).

On expiry the client gets `408 Request Timeout` with `Connection: close` and the connection is
closed. This is nginx's `client_header_timeout` / Apache mod_reqtimeout's `header=` for uvicorn.
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

# Written raw, not through h11: h11 lets a server respond only after it has parsed a request,
# and here there is none. The connection is closed right after, so h11's state no longer matters.
_REQUEST_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\n"
                             b"content-type: text/plain; charset=utf-8\r\n"
                             b"content-length: 24\r\n"
                             b"connection: close\r\n\r\n"
                             b"request header timed out")


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's `H11Protocol` that closes a connection whose request head is not complete
    within `header_timeout_s` seconds (module docstring). Pass a class made by
    `header_timeout_protocol` as `uvicorn.Config(http=...)`; uvicorn instantiates it once
    per connection.
    """

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # A connection that sends nothing at all is as costly as one that sends half a head.
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._update_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # uvicorn has just started the next cycle; a pipelined partial head may sit in h11's
        # buffer with no further data_received to come.
        self._update_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _update_head_timer(self) -> None:
        """Keep the timer running exactly while bytes of a request head are pending.

        h11's client state is IDLE until it has parsed a complete request head; with bytes
        received (or buffered) in that state, a head is under way. IDLE with nothing received
        is the keep-alive wait, which uvicorn's own timer governs.
        """
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            self._cancel_head_timer()
        elif self._head_timer is None and self.conn.trailing_data[0]:
            self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._on_head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        log.debug("closing %s: no complete request head within %g s",
                  "%s:%d" % self.client if self.client else "a connection", self.header_timeout_s)
        if self.conn.our_state is h11.IDLE:  # nothing of a response has been written
            self.transport.write(_REQUEST_TIMEOUT_RESPONSE)
        try:
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:
            pass  # h11 already in an error state: closing the transport is all that is left
        self.transport.close()


def header_timeout_protocol(header_timeout_s: float) -> type[HeaderTimeoutH11Protocol]:
    """The protocol class to pass as `uvicorn.Config(http=...)` for a head deadline of
    `header_timeout_s` seconds (> 0).

    A subclass, not a functools.partial: uvicorn declares `http` as a protocol class and reads
    class attributes from it (e.g. `alpn_protocols`).

    Raises ValueError when `header_timeout_s` is not positive.
    """
    if not header_timeout_s > 0:
        raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s!r}")
    return type(HeaderTimeoutH11Protocol.__name__, (HeaderTimeoutH11Protocol,),
                {"header_timeout_s": float(header_timeout_s), "__module__": __name__})
