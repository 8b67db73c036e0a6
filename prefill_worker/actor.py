"""The prefill Ray actor.

A threaded (not async) actor: each call runs on one of Ray's actor threads, never on an event
loop, so a forward pass blocks nothing but itself; the engine's lock serializes forwards while
`abort`, `info` and `stats` stay answerable. Create it with `.options(max_concurrency=k)`, k > 1.
"""

from __future__ import annotations

import os

import ray

from engine.config import EngineConfig
from engine.protocol import PrefillRequest, PrefillResult
from engine.runner import ModelRunner
from kvstore.actor import local_kvstore_address
from kvstore.client import KVStoreClient
from prefill_worker.engine import PrefillEngine


@ray.remote
class PrefillWorker:
    """One prefill instance (tensor parallel size 1)."""

    def __init__(self, worker_id: str, engine_config: EngineConfig,
                 transfer_timeout_s: float = 10.0, ray_namespace: str | None = None) -> None:
        runner = ModelRunner(engine_config)
        address = local_kvstore_address(ray_namespace)
        client = KVStoreClient(address, timeout_s=transfer_timeout_s)
        self.worker_id = worker_id
        self.engine = PrefillEngine(runner, client, address, worker_id, os.getpid())

    def prefill(self, request: PrefillRequest) -> PrefillResult:
        return self.engine.prefill(request)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def info(self) -> dict:
        return {"worker_id": self.worker_id, "pid": os.getpid(), "role": "prefill",
                "node_id": ray.get_runtime_context().get_node_id(),
                "kv_address": self.engine.kv_address}

    def stats(self) -> dict:
        return self.engine.stats()
