"""Engine cores in the roles the workers give them, for tests that drive them without Ray."""

from __future__ import annotations

from collections.abc import Callable

from pdcluster.engine.core.engine_core import EngineCore
from pdcluster.engine.core.request import Request
from pdcluster.engine.protocol import DecodeRequest, TokenDelta
from pdcluster.kvstore.transport.fetch import FetchConnector


def submit_decode(core: EngineCore, request: DecodeRequest,
                  emit: Callable[[TokenDelta], None]) -> None:
    """Queue a decode instance's request; its deltas go to ``emit``."""
    core.add_request(Request.of_decode(request, emit))


def fetch_of(core: EngineCore) -> FetchConnector:
    """A decode instance's fetch connector (decode_worker.instance: the first of its
    connectors)."""
    return core.connector.connectors[0]
