"""The pool connector: a prefill worker's link to the cluster KV pool (Mooncake FAST'25 §4).

Loads: the part of a prompt's cached prefix that this worker's G1 lacks comes from the
fastest place in the cluster that holds it. Per block, in order of preference: this node's G2
arena, this node's G3 SSD (both read through the arena, because the node store promotes SSD
hits into G2), then another node's G2/G3 over gRPC. The Conductor's plan (PrefixPlan, in the
request's kv_transfer_params) says how many blocks to reuse and where they are; without a plan,
or with one whose keys are not this worker's, the global index is asked. Loading
stops at the first block that cannot be had (a miss, a corrupt SSD block, a failed or
timed-out transfer): the prefix is cut there and the rest is recomputed, so a fault costs
compute, never correctness.

Saves: once a prompt is computed, its full blocks go to this node's G2 under their keys (the
store keeps one copy of a key) and its partial tail block to the node's store under a
per-request handle, never keyed or indexed. Both run off the engine loop, in order. The
transfer params that come out (kvstore.handoff.DecodeHandoff: ``kv_address``,
``block_keys``, ``tail_handle``, ``num_tail_tokens``, ``kv_node_id``) tell the decode where to
pull from.

With `--kv-pool mooncake-store` the index is a Mooncake Store (kvstore.index.mooncake_store):
its blocks are found at the location "mooncake_store" and loaded from the store, hits counted
under that tier; a computed prompt's full blocks are put into the store once its params are
out (the node's G2 still takes them, for this request's decode to pull).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from pdcluster.engine.core.blocks import num_full_blocks
from pdcluster.engine.core.kv_connector import (KVConnector, KVConnectorRequest, KVTransferParams,
                                                LoadOutcome)
from pdcluster.kvstore.client import KVStoreClient
from pdcluster.kvstore.transport.context import KVConnectorContext
from pdcluster.kvstore.errors import KVStoreError
from pdcluster.kvstore.handoff import PrefillHandoff, PrefixPlan
from pdcluster.kvstore.index import KVIndex
from pdcluster.kvstore.node_store_api import NodeStore
from pdcluster.kvstore.remote import RemoteStores

log = logging.getLogger(__name__)

LOCAL_TIERS = ("host", "ssd")
#: the tier of blocks held by a Mooncake Store (kvstore.index.mooncake_store)
POOL_TIER = "mooncake_store"
#: Finished requests whose tail an abort may still release (the client left at the first token).
MAX_TRACKED_TAILS = 4096


class PoolConnector(KVConnector):
    """Loads cached prefixes from the pool and saves computed prompts into it.

    Args:
        node_id: this worker's node.
        store_client / store_address: this node's store over gRPC (tails; the address decodes
            pull from); None for a connector that only loads.
        local_store: this node's store as a kvstore.node_store_api.NodeStore: the arena
            beside a Ray store actor, or the gRPC client itself.
        index: the global index, asked when a request carries no plan (None: no loads
            without a plan).
        remote: other nodes' stores by node id (kvstore.remote.RemoteStores; None: only this
            node's blocks are loaded).
    """

    def __init__(self, node_id: str, store_client: KVStoreClient | None, store_address: str,
                 local_store: NodeStore, index: KVIndex | None = None,
                 remote: RemoteStores | None = None) -> None:
        self.node_id = node_id
        self.store_client, self.store_address = store_client, store_address
        self.local_store, self.index, self.remote = local_store, index, remote
        self._planned: list[tuple[str, list[bytes], list[int], Sequence | None]] = []
        self._lock = threading.Lock()
        self._loaded: dict[str, LoadOutcome] = {}
        self._sent: dict[str, KVTransferParams | BaseException] = {}
        # tails of finished prefills (bounded), and prefills publishing now whose caller left
        self._tails: OrderedDict[str, str] = OrderedDict()
        self._publishing: dict[str, bool] = {}  # request id -> aborted meanwhile
        self.pool_puts_total = self.pool_put_failures_total = 0
        self._loads = ThreadPoolExecutor(1, thread_name_prefix="prefill-load")
        self._saves = ThreadPoolExecutor(1, thread_name_prefix="prefill-publish")

    @classmethod
    def from_context(cls, ctx: KVConnectorContext) -> PoolConnector:
        return cls(ctx.node_id, ctx.store_client, ctx.store_address,
                   ctx.local_store if ctx.local_store is not None else ctx.store_client,
                   ctx.index, ctx.remote)

    # ---- scheduler side ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: KVConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Every full block after the G1 hits that the plan reuses (without a plan: every full
        block the prompt has, but the last token's, which is always computed); how many do
        land is known once the load settles."""
        bs = self.cache.block_size
        end = num_full_blocks(request.num_prompt_tokens - 1, bs)
        plan = _plan_of(request)
        if plan is not None:
            end = min(end, plan.num_load_blocks, len(plan.locations))
        elif self.index is None:
            return 0, False
        hit = num_computed_tokens // bs
        return max(0, end - hit) * bs, end > hit

    def update_state_after_alloc(self, request: KVConnectorRequest, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        if not num_external_tokens:
            return
        bs = self.cache.block_size
        start = request.num_computed_tokens // bs  # after its G1 hits
        end = start + num_external_tokens // bs
        plan = _plan_of(request)
        locations = plan.locations[start:end] if plan is not None else None
        self._planned.append((request.request_id, list(request.block_keys[start:end]),
                              list(block_ids[start:end]), locations))

    def request_finished(self, request: KVConnectorRequest, block_ids: Sequence[int]
                         ) -> tuple[bool, None]:
        """Copies the prompt's blocks out (the engine frees them next) and saves them off the
        loop; the params come from get_finished once both are on the store. Nothing for a
        request that ended without a result (its tail is dropped by abort)."""
        if not block_ids:
            return False, {}
        data = self.cache.read_blocks(block_ids).cpu()
        with self._lock:
            self._publishing[request.request_id] = False
        self._saves.submit(self._save, request, data)
        return False, None

    # ---- worker side ------------------------------------------------------------------------
    def start_load_kv(self) -> None:
        planned, self._planned = self._planned, []
        for request_id, keys, dest, locations in planned:
            self._loads.submit(self._load, request_id, keys, dest, locations)

    def get_finished(self) -> tuple[dict[str, KVTransferParams | BaseException],
                                    dict[str, LoadOutcome]]:
        with self._lock:
            sent, self._sent = self._sent, {}
            loaded, self._loaded = self._loaded, {}
        return sent, loaded

    def abort(self, request_id: str) -> None:
        """A finished prefill whose decode never took its tail has the tail dropped now rather
        than at the store's TTL (one still publishing: once it is put)."""
        with self._lock:
            if request_id in self._publishing:
                self._publishing[request_id] = True
                return
            handle = self._tails.pop(request_id, None)
        if handle is not None:
            self._saves.submit(self._release_tail, handle)

    def stats(self) -> dict:
        if not self._holds_pool():
            return {}
        return {"kv_mooncake_store_puts_total": self.pool_puts_total,
                "kv_mooncake_store_put_failures_total": self.pool_put_failures_total}

    def close(self) -> None:
        for executor in (self._loads, self._saves):
            executor.shutdown(wait=False)

    def _holds_pool(self) -> bool:
        return self.index is not None and self.index.holds_blocks

    def _pool_store(self):
        """The index's own block store (Mooncake Store). Raises KVIndexUnavailableError."""
        return self.index.block_store

    # ---- off the loop -----------------------------------------------------------------------
    def _load(self, request_id: str, keys: list[bytes], dest: list[int],
              locations: Sequence | None) -> None:
        try:
            outcome = self.load(keys, dest, locations)
        except Exception as exc:  # noqa: BLE001 — a failed load costs compute only
            outcome = LoadOutcome(failures=[f"load: {exc}"])
        with self._lock:
            self._loaded[request_id] = outcome
        self.wakeup()

    def load(self, keys: Sequence[bytes], dest_blocks: Sequence[int],
             locations: Sequence[Sequence] | None = None) -> LoadOutcome:
        """Fill dest_blocks[i] with keys[i]'s block for the longest loadable run of keys.

        locations: where each key's block is (the Conductor's plan: PrefixPlan.locations);
        None: looked up in the global index here."""
        outcome = LoadOutcome()
        if not keys:
            return outcome
        if locations is None:
            try:
                locations = self.index.longest_prefix(list(keys))
            except KVStoreError as exc:
                outcome.failures.append(f"index: {exc}")
                return outcome
        sources = self._sources(locations)
        data = torch.empty((len(sources), self.cache.block_nbytes), dtype=torch.uint8)
        loaded = 0
        for source, start, end in _runs(sources):
            got = self._fetch(source, list(keys[start:end]), data[start:end], outcome)
            loaded = start + got
            if got < end - start:
                break
        if loaded:
            self.cache.write_blocks(list(dest_blocks[:loaded]), data[:loaded])
        outcome.num_tokens = loaded * self.cache.block_size
        return outcome

    def _sources(self, locations: Sequence[Sequence]) -> list[str]:
        """Per key: "local", "mooncake_store" or the node id to fetch from; stops at the first
        unfetchable key."""
        sources: list[str] = []
        for locs in locations:
            fetchable = [loc for loc in locs if loc.tier in LOCAL_TIERS]
            if any(loc.node_id == self.node_id for loc in fetchable):
                sources.append("local")
            elif any(loc.tier == POOL_TIER for loc in locs):
                sources.append(POOL_TIER)
            elif fetchable and self.remote is not None:  # fastest tier first (host, then ssd)
                sources.append(fetchable[0].node_id)
            else:
                break
        return sources

    def _fetch(self, source: str, keys: list[bytes], out: torch.Tensor,
               outcome: LoadOutcome) -> int:
        """Fetch a run of keys from one source into out; returns how many leading keys came."""
        bs, tiers = self.cache.block_size, outcome.tokens_by_tier
        if source == "local":
            try:
                found = self.local_store.get(keys, out)
            except Exception as exc:  # noqa: BLE001 — a dead local store: recompute
                outcome.failures.append(f"local store: {exc}")
                return 0
            got = next((i for i, t in enumerate(found) if t is None), len(found))
            for tier in found[:got]:
                tiers[tier] = tiers.get(tier, 0) + bs
            return got
        if source == POOL_TIER:
            try:
                got = self._pool_store().get(keys, out)
            except KVStoreError as exc:  # an unreachable store: recompute
                outcome.failures.append(f"mooncake store: {exc}")
                return 0
            if got < len(keys):  # evicted since the lookup
                outcome.failures.append(f"mooncake store: {len(keys) - got} blocks gone")
            tiers[POOL_TIER] = tiers.get(POOL_TIER, 0) + got * bs
            return got
        try:
            out.copy_(self.remote.client(source).get_blocks(keys))
        except KVStoreError as exc:
            log.warning("prefix fetch of %d blocks from node %s failed: %s", len(keys), source,
                        exc)
            outcome.failures.append(f"node {source}: {exc}")
            self.remote.forget(source)
            return 0
        tiers["remote"] = tiers.get("remote", 0) + len(keys) * bs
        return len(keys)

    def _save(self, request: KVConnectorRequest, data: torch.Tensor) -> None:
        """Full blocks to the node's G2 by key, the tail by handle; then the params."""
        request_id, keys = request.request_id, list(request.block_keys)
        num_tail = request.num_prompt_tokens - len(keys) * self.cache.block_size
        handle = f"tail:{request_id}" if num_tail else None
        try:
            if keys:
                self.local_store.put(keys, data[: len(keys)])
            if handle is not None:
                self.store_client.put_tail(handle, data[len(keys)], num_tail)
        except BaseException as exc:  # noqa: BLE001 — the caller's error
            with self._lock:
                self._publishing.pop(request_id, None)
                self._sent[request_id] = exc
            self.wakeup()
            return
        with self._lock:
            aborted = self._publishing.pop(request_id, False)
            if handle is not None and not aborted:
                self._tails[request_id] = handle
                while len(self._tails) > MAX_TRACKED_TAILS:
                    self._tails.popitem(last=False)
            self._sent[request_id] = {
                "kv_address": self.store_address, "block_keys": tuple(keys),
                "tail_handle": handle, "num_tail_tokens": num_tail, "kv_node_id": self.node_id}
        if aborted and handle is not None:
            self._release_tail(handle)
        self.wakeup()
        if keys and self._holds_pool():
            self._put_in_pool(keys, data[: len(keys)])

    def _put_in_pool(self, keys: list[bytes], blocks: torch.Tensor) -> None:
        """Full blocks into the Mooncake Store, for any prefill to reuse; a failure costs
        later requests a recompute, so it is counted and logged, not raised."""
        try:
            stored = self._pool_store().put(keys, blocks)
        except KVStoreError as exc:
            stored, reason = 0, str(exc)
        else:
            reason = "the store refused the rest (full?)"
        self.pool_puts_total += stored
        if stored < len(keys):
            self.pool_put_failures_total += len(keys) - stored
            log.warning("%d of %d blocks not put into the Mooncake Store: %s",
                        len(keys) - stored, len(keys), reason)

    def _release_tail(self, handle: str) -> None:
        try:
            self.store_client.release_tail(handle)
        except Exception as exc:  # noqa: BLE001 — the store's TTL drops it anyway
            log.warning("tail %s not released: %s", handle, exc)


def _plan_of(request: KVConnectorRequest) -> PrefixPlan | None:
    """The Conductor's plan for the request's prefix, unless its keys are not the ones this
    worker computes (another model name or block size): then the index is asked instead."""
    plan = PrefillHandoff.of(request.kv_transfer_params).prefix_plan
    if plan is not None and tuple(plan.block_keys) != tuple(request.block_keys):
        log.warning("the Conductor's block keys differ from this worker's (model name or "
                    "block size?); loading the prefix without its plan",
                    extra={"request_id": request.request_id})
        return None
    return plan


def _runs(sources: list[str]) -> list[tuple[str, int, int]]:
    """Maximal runs of equal sources: (source, start, end)."""
    runs: list[tuple[str, int, int]] = []
    for i, source in enumerate(sources):
        if runs and runs[-1][0] == source:
            runs[-1] = (source, runs[-1][1], i + 1)
        else:
            runs.append((source, i, i + 1))
    return runs


class PoolLoadConnector(PoolConnector):
    """The pool connector of a decode worker (vLLM's ``kv_role`` "kv_consumer"): a prompt the
    decode computes itself (kept local by the PD decider, or colocated) loads its cached prefix
    from the pool as a prefill's would: this node's G2/G3, then other nodes'. It saves
    nothing: a decode's blocks go out through the publish connector. A request that comes with
    a prefill's hand-off is not its to load."""

    @classmethod
    def from_context(cls, ctx: KVConnectorContext) -> PoolLoadConnector:
        return cls(ctx.node_id, None, "", ctx.local_store, ctx.index, ctx.remote)

    def get_num_new_matched_tokens(self, request: KVConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        if request.kv_transfer_params is not None:
            return 0, False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def request_finished(self, request: KVConnectorRequest, block_ids: Sequence[int]
                         ) -> tuple[bool, KVTransferParams]:
        return False, {}

    def abort(self, request_id: str) -> None:
        """Nothing was put for the request; a load in flight still settles and is reported."""
