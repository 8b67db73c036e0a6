"""Optional API keys on the gateway (`--api-key`, repeatable, or `--api-key-file`).

Clients send `Authorization: Bearer <key>`, as the OpenAI clients do. A missing or wrong key gets
401 with OpenAI's error body; `/health` stays open (probes carry no key). Keys are compared in
constant time and never logged.
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Iterable

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from pdcluster.router.api_common import APIError

OPEN_PATHS = frozenset({"/health"})


def load_api_keys(keys: Iterable[str] = (), key_file: str | Path | None = None) -> list[str]:
    """Keys given directly plus one per non-empty, non-comment line of key_file."""
    out = [k.strip() for k in keys if k.strip()]
    if key_file is not None:
        for line in Path(key_file).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


class APIKeyAuth:
    """ASGI middleware: every HTTP request but OPEN_PATHS must carry one of `keys`."""

    def __init__(self, app: ASGIApp, keys: Iterable[str]) -> None:
        self.app = app
        self._keys = [k.encode() for k in keys]
        if not self._keys:
            raise ValueError("APIKeyAuth needs at least one key")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        error = APIError(401, "Incorrect or missing API key. Send it as 'Authorization: Bearer "
                         "<key>'.", code="invalid_api_key")
        response = JSONResponse(error.body(), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not token:
            return False
        # compare against every key, so timing does not reveal which (or whether one) matched
        matches = [hmac.compare_digest(token.strip(), key) for key in self._keys]
        return any(matches)
