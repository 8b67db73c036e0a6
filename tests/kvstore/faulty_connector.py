"""A KV connector that wraps a real one and injects the faults a real part cannot produce on
demand: a save that fails for chosen requests, a load that lands nothing."""

from __future__ import annotations

from pdcluster.engine.core.kv_connector import KVConnector, LoadOutcome
from pdcluster.kvstore.errors import KVTransferError


class FaultyConnector(KVConnector):
    """``inner``, except that saves of ``fail_saves`` request ids report KVTransferError and,
    with ``fail_loads``, every load settles having landed nothing (after ``inner`` really
    loaded: the blocks it wrote are recomputed)."""

    def __init__(self, inner: KVConnector, fail_saves: set[str] = frozenset(),
                 fail_loads: bool = False) -> None:
        self.inner, self.fail_saves, self.fail_loads = inner, set(fail_saves), fail_loads
        inner.wakeup = lambda: self.wakeup()

    @classmethod
    def from_context(cls, ctx):
        raise TypeError("tests build it around a real connector")

    def register_kv_caches(self, cache) -> None:
        self.inner.register_kv_caches(cache)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.inner.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.inner.update_state_after_alloc(request, block_ids, num_external_tokens)

    def request_finished(self, request, block_ids):
        return self.inner.request_finished(request, block_ids)

    def start_load_kv(self) -> None:
        self.inner.start_load_kv()

    def get_finished(self):
        sent, loaded = self.inner.get_finished()
        sent = {rid: KVTransferError(f"{rid}: injected save failure")
                if rid in self.fail_saves else params for rid, params in sent.items()}
        if self.fail_loads:
            loaded = {rid: LoadOutcome(failures=["injected load failure"]) for rid in loaded}
        return sent, loaded

    def abort(self, request_id: str) -> None:
        self.inner.abort(request_id)

    def close(self) -> None:
        self.inner.close()
