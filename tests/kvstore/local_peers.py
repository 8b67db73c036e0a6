"""Stream peers for engines in one process (no Ray): announces and cancels call the engines
directly, as the actors' entries do across processes."""

from __future__ import annotations

from typing import Any

from kvstore.transfer.peers import StreamPeers


class LocalStreamPeers(StreamPeers):
    """Engines in this process, by worker id (``workers[id]`` has ``expect_layer_stream`` /
    ``cancel_layer_stream``, as the actors do)."""

    def __init__(self, workers: dict[str, Any] | None = None) -> None:
        self.workers = {} if workers is None else workers

    def announce(self, decode_id: str, announce: Any) -> bool:
        worker = self.workers.get(decode_id)
        if worker is None:
            return False
        worker.expect_layer_stream(announce)
        return True

    def cancel_at_decode(self, decode_id: str, request_id: str) -> None:
        if decode_id in self.workers:
            self.workers[decode_id].cancel_layer_stream(request_id)

    def cancel_at_prefill(self, prefill_id: str, request_id: str) -> None:
        if prefill_id in self.workers:
            self.workers[prefill_id].cancel_layer_stream(request_id)
