"""Stream peers for engines in one process (no Ray): announces and cancels reach the engine
cores directly, as the actors' entries do across processes."""

from __future__ import annotations

from typing import Any

from pdcluster.decode_worker.instance import cancel_layer_stream, expect_layer_stream
from pdcluster.engine.core.engine_core import EngineCore
from pdcluster.kvstore.transport.peers import StreamPeers


class LocalStreamPeers(StreamPeers):
    """Engine cores in this process, by worker id; a worker that is not an EngineCore is a
    test's stand-in with the actors' ``expect_layer_stream`` / ``cancel_layer_stream``."""

    def __init__(self, workers: dict[str, Any] | None = None) -> None:
        self.workers = {} if workers is None else workers

    def announce(self, decode_id: str, announce: Any) -> bool:
        worker = self.workers.get(decode_id)
        if worker is None:
            return False
        if isinstance(worker, EngineCore):
            expect_layer_stream(worker, announce)
        else:
            worker.expect_layer_stream(announce)
        return True

    def cancel_at_decode(self, decode_id: str, request_id: str) -> None:
        worker = self.workers.get(decode_id)
        if isinstance(worker, EngineCore):
            cancel_layer_stream(worker, request_id)
        elif worker is not None:
            worker.cancel_layer_stream(request_id)

    def cancel_at_prefill(self, prefill_id: str, request_id: str) -> None:
        worker = self.workers.get(prefill_id)
        if worker is not None:
            worker.abort(request_id)  # the prefill gives the request up
