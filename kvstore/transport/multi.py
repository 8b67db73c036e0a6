"""Several connectors as one (vLLM's MultiConnector): a prefill worker's pool, layer stream
and torch pair connectors, or a decode worker's fetch, pool-load and publish connectors, run
side by side, and the engine sees one connector."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdcluster.engine.core.kv_connector import (BlockCache, KVConnector, KVConnectorMetadata,
                                                KVConnectorRequest, KVTransferParams, LoadOutcome)
from pdcluster.kvstore.transport.context import KVConnectorContext


class MultiConnector(KVConnector):
    """Calls every connector, in order. A request's loads come from the first connector that
    matches any of its tokens; its KV transfer params are the union of every connector's
    (``extra`` merged), reported once the last of them settled, or the first error."""

    def __init__(self, connectors: Sequence[KVConnector]) -> None:
        self.connectors = list(connectors)
        self.uses_layer_hooks = any(c.uses_layer_hooks for c in self.connectors)
        self.polled = any(c.polled for c in self.connectors)
        for connector in self.connectors:
            connector.wakeup = lambda: self.wakeup()
        self._loader: dict[str, KVConnector] = {}
        self._pending: dict[str, tuple[set[int], dict[str, object]]] = {}
        self._reads: _ReadOnce | None = None

    @classmethod
    def from_context(cls, ctx: KVConnectorContext) -> MultiConnector:
        raise TypeError("build a MultiConnector through "
                        "kvstore.transport.registry.create_connector")

    def register_kv_caches(self, cache: BlockCache) -> None:
        self.cache = self._reads = _ReadOnce(cache)
        for connector in self.connectors:
            connector.register_kv_caches(self._reads)

    def get_num_new_matched_tokens(self, request: KVConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        for connector in self.connectors:
            n, is_async = connector.get_num_new_matched_tokens(request, num_computed_tokens)
            if n:
                self._loader[request.request_id] = connector
                return n, is_async
        return 0, False

    def update_state_after_alloc(self, request: KVConnectorRequest, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        loader = self._loader.pop(request.request_id, None)
        if loader is not None:
            loader.update_state_after_alloc(request, block_ids, num_external_tokens)

    def request_finished(self, request: KVConnectorRequest, block_ids: Sequence[int]
                         ) -> tuple[bool, KVTransferParams | None]:
        delay, params, waiting = False, {}, set()
        try:
            for i, connector in enumerate(self.connectors):
                held, got = connector.request_finished(request, block_ids)
                delay |= held
                if got is None:
                    waiting.add(i)
                else:
                    _merge(params, got)
        finally:
            self._reads.forget()
        if not waiting:
            return delay, params
        self._pending[request.request_id] = (waiting, params)
        return delay, None

    def runs_alone(self, request: KVConnectorRequest) -> bool:
        return any(c.runs_alone(request) for c in self.connectors)

    def allows_local_prefix(self, request: KVConnectorRequest) -> bool:
        return all(c.allows_local_prefix(request) for c in self.connectors)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        for connector in self.connectors:
            connector.bind_connector_metadata(metadata)

    def start_load_kv(self) -> None:
        for connector in self.connectors:
            connector.start_load_kv()

    def wait_for_layer_load(self, layer: int) -> None:
        for connector in self.connectors:
            connector.wait_for_layer_load(layer)

    def save_kv_layer(self, layer: int) -> None:
        for connector in self.connectors:
            connector.save_kv_layer(layer)

    def wait_for_save(self) -> None:
        for connector in self.connectors:
            connector.wait_for_save()

    def save_progress(self, request: KVConnectorRequest, keys: Sequence[bytes],
                      block_ids: Sequence[int]) -> None:
        try:
            for connector in self.connectors:
                connector.save_progress(request, keys, block_ids)
        finally:
            self._reads.forget()

    def get_finished(self) -> tuple[dict[str, KVTransferParams | BaseException],
                                    dict[str, LoadOutcome]]:
        sent: dict[str, KVTransferParams | BaseException] = {}
        loaded: dict[str, LoadOutcome] = {}
        for i, connector in enumerate(self.connectors):
            done, loads = connector.get_finished()
            loaded.update(loads)
            for request_id, got in done.items():
                waiting, params = self._pending.get(request_id, (set(), {}))
                waiting.discard(i)
                if isinstance(got, BaseException):
                    self._pending.pop(request_id, None)
                    sent[request_id] = got
                elif request_id in self._pending:
                    _merge(params, got)
                    if not waiting:
                        sent[request_id] = self._pending.pop(request_id)[1]
        return sent, loaded

    def abort(self, request_id: str) -> None:
        self._loader.pop(request_id, None)
        for connector in self.connectors:
            connector.abort(request_id)

    def stats(self) -> dict:
        return {k: v for connector in self.connectors for k, v in connector.stats().items()}

    def close(self) -> None:
        for connector in self.connectors:
            connector.close()


def _merge(params: dict[str, object], more: KVTransferParams) -> None:
    extra = {**params.get("extra", {}), **more.get("extra", {})}
    params.update(more)
    if extra:
        params["extra"] = extra


class _ReadOnce:
    """The cache, except that reading the same blocks again while one request finishes gives
    the same copy: each connector reads what it sends, and the blocks are copied out once."""

    def __init__(self, cache: BlockCache) -> None:
        self._cache = cache
        self._last: tuple[tuple[int, ...], torch.Tensor] | None = None

    def __getattr__(self, name: str):
        return getattr(self._cache, name)

    def read_blocks(self, block_ids: Sequence[int]):
        ids = tuple(block_ids)
        if self._last is None or self._last[0] != ids:
            self._last = (ids, self._cache.read_blocks(ids))
        return self._last[1]

    def forget(self) -> None:
        self._last = None
