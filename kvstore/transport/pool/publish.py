"""The publish connector: a decode worker's saves into the KV pool. When a sequence finishes,
the full blocks of its prompt and output that no prefill published go to this node's store
under their chained keys, so the next turn of a conversation (its prompt is this one's prompt,
the reply and a new message) reuses the reply's KV instead of recomputing it.

``request_finished`` does the work for a sequence that ended normally (a stop token, max_tokens
or the context limit), after its last token was emitted; an aborted or failed one saves
nothing more. With a publish interval the engine also calls ``save_progress`` while
the sequence runs, each time N more of its blocks are full: those blocks are whole (their
KV never changes again), so they go out at once and a later turn, or another request sharing
the prefix, need not wait for the end; ``request_finished`` then puts only the rest, and
``abort`` forgets a sequence that will not finish. The blocks' bytes are copied out on the engine loop, so the
engine frees the blocks at once, and put off the loop, on one thread, in order. The put goes
through the node store (arena and commit), which records the blocks in the global index like
a prefill's, under the tier that holds them.

Which keys are new: a request that came with a PrefillResult had its prompt's full blocks
published by the prefill (``block_keys``), so only the blocks after those are copied; a
colocated request's blocks are all new. A block the store holds already is kept once by the
store. A failed put is counted and logged; the blocks are recomputed by whoever misses them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from pdcluster.engine.core.kv_connector import KVConnector, KVConnectorRequest, KVTransferParams
from pdcluster.kvstore.transport.context import KVConnectorContext
from pdcluster.kvstore.handoff import DecodeHandoff
from pdcluster.kvstore.node_store_api import NodeStore

log = logging.getLogger(__name__)


class PublishConnector(KVConnector):
    """Puts a finished sequence's new full blocks into ``store`` (see the module docstring).

    Attributes (thread-safe through ``stats``): blocks_published_total, the blocks put;
    bytes_published_total, their bytes; publish_failures_total, blocks whose put failed.
    """

    def __init__(self, store: NodeStore) -> None:
        self.store = store
        self.blocks_published_total = self.bytes_published_total = 0
        self.publish_failures_total = 0
        self._lock = threading.Lock()
        self._saves = ThreadPoolExecutor(1, thread_name_prefix="decode-publish")
        self._saved: dict[str, int] = {}  # request id -> leading blocks put while it ran

    @classmethod
    def from_context(cls, ctx: KVConnectorContext) -> PublishConnector:
        if ctx.local_store is None:
            raise ValueError("the publish connector needs the node's store (local_store)")
        return cls(ctx.local_store)

    def request_finished(self, request: KVConnectorRequest, block_ids: Sequence[int]
                         ) -> tuple[bool, KVTransferParams]:
        """request.block_keys: the chained keys of every full block of its KV (prompt and
        output, in order); block_ids: its block table, whose first len(block_keys) blocks hold
        them. Copies the blocks no prefill published and puts them off the loop; never delays
        the blocks' release (returns delay_free False). Nothing for a request that ended
        without a result (what it put while running stays). Raises ValueError when the
        table is shorter than the keys."""
        if block_ids:
            keys = list(request.block_keys)
            self._save(request, keys, block_ids[:len(keys)])
        self._saved.pop(request.request_id, None)
        return False, {}

    def save_progress(self, request: KVConnectorRequest, keys: Sequence[bytes],
                      block_ids: Sequence[int]) -> None:
        """A running request's first len(keys) blocks are full (keys: their chained keys;
        block_ids: the cache blocks holding them): copies those not put yet and puts them off
        the loop. Raises ValueError when the lengths differ."""
        self._save(request, list(keys), block_ids)
        self._saved[request.request_id] = len(keys)

    def abort(self, request_id: str) -> None:
        """The request ends without finishing: what it put while running stays (whole blocks);
        nothing more goes out."""
        self._saved.pop(request_id, None)

    def _save(self, request: KVConnectorRequest, keys: list[bytes],
              block_ids: Sequence[int]) -> None:
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} block keys for {len(block_ids)} blocks")
        published = DecodeHandoff.of(request.kv_transfer_params).block_keys  # by its prefill
        start = max(len(published), self._saved.get(request.request_id, 0))
        if start >= len(keys):
            return
        data = self.cache.read_blocks(list(block_ids[start:])).cpu()
        self._saves.submit(self._put, keys[start:], data)

    def stats(self) -> dict:
        with self._lock:
            return {"kv_blocks_published_total": self.blocks_published_total,
                    "kv_bytes_published_total": self.bytes_published_total,
                    "kv_publish_failures_total": self.publish_failures_total}

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every put submitted so far has ended (succeeded or failed)."""
        self._saves.submit(lambda: None).result(timeout_s)

    def close(self) -> None:
        self._saves.shutdown(wait=False)

    def _put(self, keys: list[bytes], data: torch.Tensor) -> None:
        try:
            self.store.put(keys, data)
        except Exception as exc:  # noqa: BLE001 — a lost publish costs a later recompute
            log.warning("%d decoded blocks not published: %s", len(keys), exc)
            with self._lock:
                self.publish_failures_total += len(keys)
            return
        with self._lock:
            self.blocks_published_total += len(keys)
            self.bytes_published_total += data.numel() * data.element_size()
