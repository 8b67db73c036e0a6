"""Raw TCP clients of an HTTP server, for tests of what the server does with connections that
no HTTP client would make (partial heads, stalled bodies, idle sockets)."""

from __future__ import annotations

import socket
import time


def connect(url: str) -> socket.socket:
    """A TCP connection to `url` (http://host:port)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def read_until_closed(sock: socket.socket, deadline: float) -> bytes:
    """Everything the server sends until it closes the connection; fails at `deadline`
    (time.monotonic()) if the connection is still open."""
    received = b""
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"connection still open; received {received!r}"
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(4096)
        except socket.timeout:
            continue  # the assertion above reports it
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk


def read_response(sock: socket.socket) -> bytes:
    """One complete response with a Content-Length body, read off a kept-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, f"closed mid-response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(4096)
        assert chunk, f"closed mid-body: {data!r}"
        body += chunk
    return head + b"\r\n\r\n" + body
