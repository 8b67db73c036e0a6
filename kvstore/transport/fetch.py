"""The fetch connector: a decode worker's KV connector. It moves a request's prompt KV from the
prefill side into the request's reserved cache blocks, through the sources of the transports
it runs (kvstore.transport.source), and knows none of them.

As a connector (FetchConnector): a request that comes with a prefill's KV transfer params
matches its prompt past the tokens the decode's own prefix cache holds, asynchronously
(get_num_new_matched_tokens); once it holds its blocks the fetch is planned
(update_state_after_alloc) and started (start_load_kv), and get_finished reports it settled:
landed, or failed after its retry, and then the engine recomputes the prompt. Only the blocks
after the cached ones travel (incremental transfer) where the source pulls block by block; a
pushed transfer brings the whole prompt. request_finished lets go of what the prefill side
holds for a request that never fetched.

The chain (KVFetch): the first source the request's params offer (a layer stream, a pair push,
a Transfer Engine region, or the pool), then the pool: every prefill publishes every block to
its node's store as well (the pool is the prefix cache), so a broken transport costs time, not
the request. Every attempt has a deadline (KVTransferConfig.timeout_s; a layer stream's bounds
the silence between pieces); a failed attempt is retried once, from the pool (the pool's own
retry goes over gRPC, the one other path to the only node known to hold the tail). If the
retry fails too, the fetch FAILS and the engine recomputes the prompt locally.

Blocks land straight in the reserved cache blocks, written from the transports' threads (a
CacheDest): no running request uses those blocks, and once get_finished has reported the
fetch (landed, failed, or aborted and settled) nothing more is written, so the engine may free
them then. Protobuf, shared memory or raw tensors only: no pickle.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence

import torch

from pdcluster.engine.core.kv_connector import (KVConnector, KVConnectorRequest,
                                                KVTransferParams, LoadOutcome)
from pdcluster.kvstore.config import KVStoreConfig, KVTransferConfig
from pdcluster.kvstore.transport.context import KVConnectorContext
from pdcluster.kvstore.errors import KVStoreError, KVTransferTimeout
from pdcluster.kvstore.handoff import DecodeHandoff
from pdcluster.kvstore.node_client import NodeStoreClient
from pdcluster.kvstore.transport.base import KVReceiver, KVTransferBackend, TransferState
from pdcluster.kvstore.transport.dest import CacheDest
from pdcluster.kvstore.transport.source import KVSource
from pdcluster.kvstore.transport.layer_stream.source import PARAM as LAYER_STREAM
from pdcluster.kvstore.transport.layer_stream.stream import LayerStreamAnnounce
from pdcluster.kvstore.transport.pool.grpc_backend import GrpcTransferBackend
from pdcluster.kvstore.transport.registry import create_backend, decode_sources

log = logging.getLogger(__name__)

#: Attempts of one fetch: the first source, then one retry from the pool.
MAX_ATTEMPTS = 2


class FetchConnector(KVConnector):
    """A decode worker's KV connector: starts, polls and accounts the fetches of its requests
    (see the module docstring); its accounting is thread-safe.

    Blocks land in the cache given to register_kv_caches, in the KV pool's layout (every KV
    head): the runner's `wire_kv` (at TP=1 the paged cache itself; at TP=k rank 0 writes whole
    blocks and each rank keeps its KV heads: fetched once, not once per rank).

    Args:
        transfer: the transfer settings (``--kv-transfer``).
        node_id, node_client: this worker's Ray node and its KV store; with both, full blocks
            published on this node are read through the shared-memory arena.
        backend: the transport's backend instead of one built from ``transfer`` (tests).
        store: builds the pool's gRPC receivers instead of the pool's own backend (tests: a
            fake with failure injection).
        kv_config: the KV store's config, whose token, TLS and max message size every
            channel to a store or a prefill peer uses. None: no token and no TLS (stores
            without auth, tests).

    Attributes:
        sources: the sources it runs, in chain order (kvstore.transport.registry.decode_sources).
        bytes_by_backend: KV bytes written into the cache by successful fetches, by path
            ("torch", "mooncake", "grpc", "arena", "layer", "layer-mooncake", or a given store
            backend's name).
        errors_by_backend: failed attempts by path and kind: "timeout" (KVTransferTimeout, a
            deadline passed) or "error"; attempts of aborted fetches are not counted.
    """

    polled = True

    def __init__(self, transfer: KVTransferConfig, node_id: str | None = None,
                 node_client: NodeStoreClient | None = None,
                 backend: KVTransferBackend | None = None,
                 store: KVTransferBackend | None = None,
                 kv_config: KVStoreConfig | None = None) -> None:
        self.transfer, self.node_id, self.node_client = transfer, node_id, node_client
        self.timeout_s = transfer.timeout_s
        self.backend = backend or create_backend(transfer, kv_config)
        # the pool, tails and releases always go over gRPC (releases on its threads)
        self.grpc = (self.backend if isinstance(self.backend, GrpcTransferBackend)
                     else GrpcTransferBackend(transfer, kv_config))
        self.sources = decode_sources(self, self.backend.name, self.backend, store or self.grpc)
        self.bytes_by_backend: Counter[str] = Counter()
        #: failed attempts by path and kind ("timeout": past a deadline, "error": the rest);
        #: an aborted fetch's attempt is neither
        self.errors_by_backend: dict[str, Counter[str]] = {}
        self._lock = threading.Lock()
        self._planned: list[tuple[KVConnectorRequest, list[int], int]] = []
        self._fetches: dict[str, KVFetch] = {}
        self._fetched: set[str] = set()  # fetches started whose request has not finished
        self.num_fetch_retries_total = 0

    @classmethod
    def from_context(cls, ctx: KVConnectorContext) -> FetchConnector:
        return cls(ctx.transfer, ctx.node_id, ctx.local_store, kv_config=ctx.kv_config)

    def chain(self, params: Mapping[str, object]) -> list[KVSource]:
        """The sources ``params`` offer, in the order a fetch tries them."""
        return [source for source in self.sources if source.offered(params)]

    def get_num_new_matched_tokens(self, request: KVConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """The prompt after the `num_computed_tokens` found cached here (whole blocks),
        asynchronously, when the request comes with a prefill's KV transfer params."""
        if request.kv_transfer_params is None:
            return 0, False
        return request.num_prompt_tokens - num_computed_tokens, True

    def allows_local_prefix(self, request: KVConnectorRequest) -> bool:
        """For a prompt from a prefill: with incremental transfer on
        (KVTransferConfig.incremental_transfer), unless its first source brings it whole
        (KVSource.pushed), sent before this worker was asked."""
        if request.kv_transfer_params is None:
            return True
        chain = self.chain(request.kv_transfer_params)
        return self.transfer.incremental_transfer and not (chain and chain[0].pushed)

    def update_state_after_alloc(self, request: KVConnectorRequest, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        """Plans the fetch of the last `num_external_tokens` of the prompt into `block_ids`;
        the blocks before them hold cached KV already and are left alone."""
        if num_external_tokens:
            skip = (request.num_prompt_tokens - num_external_tokens) // self.cache.block_size
            self._planned.append((request, list(block_ids), skip))

    def start_load_kv(self) -> None:
        """Start the planned fetches; never blocks."""
        planned, self._planned = self._planned, []
        for request, table, skip in planned:
            self._track(KVFetch(self, request.request_id, table,
                                dict(request.kv_transfer_params), skip))

    def start_stream(self, announce: LayerStreamAnnounce,
                     block_table: Sequence[int]) -> KVFetch | None:
        """A layer stream announced before its request came, taken into blocks reserved for it
        while the prefill computes; never blocks. None: no source here takes such a stream
        (the request takes it from the pool at admission). Once the request comes, adopt() it
        (kvstore's pre-arrival reservation, SGLang's decode "prealloc" queue)."""
        params = {LAYER_STREAM: announce}
        if not self.chain(params):
            return None
        return KVFetch(self, announce.request_id, block_table, params, adopted=False)

    def adopt(self, request: KVConnectorRequest, fetch: KVFetch) -> None:
        """The request of a stream started by start_stream came: report it as its load."""
        fetch.adopt(dict(request.kv_transfer_params))
        self._track(fetch)

    def _track(self, fetch: KVFetch) -> None:
        self._fetches[fetch.request_id] = fetch
        self._fetched.add(fetch.request_id)

    def get_finished(self) -> tuple[dict, dict[str, LoadOutcome]]:
        """Fetches that settled: the prompt landed (num_tokens: the prompt after the blocks
        cached here), or failed after its retry (failures; nothing landed that counts:
        recompute). The detail has the paths tried and a layer stream's arrivals:
        [(piece, layer, time.time())]."""
        loaded: dict[str, LoadOutcome] = {}
        for request_id, fetch in list(self._fetches.items()):
            state = fetch.poll()
            if not state.done:
                continue
            del self._fetches[request_id]
            detail = {"paths": list(fetch.paths), "arrivals": fetch.arrivals()}
            self.num_fetch_retries_total += len(fetch.paths) - 1
            if state is TransferState.SUCCESS:
                bs = self.cache.block_size
                num_tokens = (DecodeHandoff.of(fetch.params).num_tokens(bs)
                              - fetch.skip_blocks * bs)
                loaded[request_id] = LoadOutcome(num_tokens, {fetch.path: num_tokens},
                                                 detail=detail)
            else:
                loaded[request_id] = LoadOutcome(failures=[f"{'→'.join(fetch.paths)}: "
                                                           f"{fetch.error}"], detail=detail)
        return {}, loaded

    def request_finished(self, request: KVConnectorRequest, block_ids: Sequence[int]
                         ) -> tuple[bool, KVTransferParams]:
        """For a request that ended without fetching (aborted or refused while waiting, or
        stopped by its first token): every source its params offer lets go of what the
        prefill side holds for it (a pushed transfer drained, the store tail dropped). Never
        blocks; nothing to do for one that fetched, or a colocated one (no KV transfer
        params)."""
        if request.request_id in self._fetched:
            self._fetched.discard(request.request_id)
            return False, {}
        if request.kv_transfer_params is None:
            return False, {}
        for source in self.chain(request.kv_transfer_params):
            source.release(request.kv_transfer_params)
        return False, {}

    def abort(self, request_id: str) -> None:
        """Its fetch stops; get_finished reports it once nothing more is written into its
        blocks (at once, or when a receive under way settles: see KVFetch.abort)."""
        fetch = self._fetches.get(request_id)
        if fetch is not None:
            fetch.abort()

    def stats(self) -> dict:
        with self._lock:
            by_backend = dict(self.bytes_by_backend)
            errors = {path: dict(kinds) for path, kinds in self.errors_by_backend.items()}
        return {"kv_bytes_fetched_total": sum(by_backend.values()),
                "kv_bytes_fetched_by_backend": by_backend,
                "kv_transfer_errors_by_backend": errors,
                "num_fetch_retries_total": self.num_fetch_retries_total}

    def close(self) -> None:
        for backend in {id(b): b for b in (self.backend, self.grpc)}.values():
            backend.close()

    # ---- for the sources and KVFetch ------------------------------------------------------

    def dest(self, table: list[int]) -> CacheDest:
        """The blocks ``table`` of the cache: written by ``_write``, or straight into the
        cache by a transport that can."""
        return CacheDest(lambda start, blocks: self._write(table, start, blocks), table,
                         self.cache, (self.cache.block_nbytes,), torch.uint8)

    def _write(self, table: list[int], start: int, blocks: torch.Tensor) -> None:
        self.cache.write_blocks(table[start:start + blocks.shape[0]], blocks)

    def _count(self, by_backend: dict[str, int]) -> None:
        with self._lock:
            self.bytes_by_backend.update(by_backend)

    def _count_error(self, path: str, error: KVStoreError) -> None:
        kind = "timeout" if isinstance(error, KVTransferTimeout) else "error"
        with self._lock:
            self.errors_by_backend.setdefault(path, Counter())[kind] += 1


class KVFetch:
    """One request's prompt KV on its way into its reserved blocks; the engine polls it once
    per step and never blocks on it.

    Starting never blocks: the prompt's KV goes into ``block_table[0 : n]`` (n: the first
    source's num_blocks). With ``skip_blocks`` k the first k full blocks are cached here
    already: only keys k.. and the tail are fetched, into ``block_table[k:]`` (a pushed source
    brings the whole prompt, so it takes none to skip). A fetch not ``adopted`` (a layer
    stream started before its request came) has only the stream's params: it needs the
    request's (adopt) to retry from the pool.

    Attributes:
        params: the request's kv_transfer_params.
        paths: the paths tried so far, in order ("layer", "torch", "mooncake", "grpc",
            "arena" or a given store backend's name); at most MAX_ATTEMPTS.
        receiver: the current attempt's receiver; source: its source.
        error: the error the fetch FAILED with, once it has (then the engine recomputes).

    Raises:
        ValueError: no source is offered, or blocks to skip where none can be.
    """

    def __init__(self, connector: FetchConnector, request_id: str, block_table: Sequence[int],
                 params: Mapping[str, object], skip_blocks: int = 0,
                 adopted: bool = True) -> None:
        chain = connector.chain(params)
        if not chain:
            raise ValueError(f"no source of this decode takes the KV of {request_id}")
        first = chain[0]
        if skip_blocks and (first.pushed
                            or skip_blocks > len(DecodeHandoff.of(params).block_keys)):
            raise ValueError(f"cannot skip {skip_blocks} blocks of a {first.name} transfer")
        self.skip_blocks, self.adopted = skip_blocks, adopted
        self._connector, self.params = connector, params
        self._table = list(block_table[skip_blocks:first.num_blocks(params)])
        self.request_id = request_id
        self.started_s = time.time()
        self.paths: list[str] = []
        self.error: KVStoreError | None = None
        self.aborted = False
        self._state = TransferState.TRANSFERRING  # until settled
        self._tried: list[KVSource] = []
        self._receivers: list[KVReceiver] = []
        self._start(first)

    @property
    def path(self) -> str:
        return self.paths[-1]

    def adopt(self, params: Mapping[str, object]) -> None:
        self.params, self.adopted = params, True

    def arrivals(self) -> list:
        """A layer stream's per-piece arrivals, [(piece, layer, time.time())]; else []."""
        return next((list(r.arrivals) for r in self._receivers if hasattr(r, "arrivals")), [])

    def poll(self) -> TransferState:
        """The fetch's state; SUCCESS and FAILED are final. A fetch not adopted whose first
        attempt failed stays TRANSFERRING (its retry needs the request's params)."""
        if self._state.done:
            return self._state
        state = self.receiver.poll()
        if state is TransferState.FAILED and not self.aborted \
                and len(self.paths) < MAX_ATTEMPTS:
            if not self.adopted:
                return TransferState.TRANSFERRING
            retry = self._retry_source()
            if retry is not None:
                error = _error_of(self.receiver)
                self._connector._count_error(self.path, error)
                log.warning("KV fetch of %s over %s failed, retrying from %s: %s",
                            self.request_id, self.path, retry.name, error,
                            extra={"request_id": self.request_id})
                if retry is not self.source:
                    self.source.left(self.params, self.receiver)
                self._start(retry)
                state = self.receiver.poll()
        if state.done:
            self._settle(state)
        return state

    def abort(self) -> bool:
        """Stop fetching. True: nothing more will be written. False (an attempt its source
        cannot cancel, under way): bytes may still land until it is done; it is left to
        finish, or to fail at its deadline (see KVSource.cancellable). Either way the
        connector reports the fetch from get_finished once it has settled."""
        self.aborted = True
        if not self.source.cancellable and not self.poll().done:
            return False
        self.receiver.abort()
        self.poll()
        return True

    def _start(self, source: KVSource) -> None:
        attempt = self._tried.count(source)
        self._tried.append(source)
        path, self.receiver = source.start(self.params, self._table, self.skip_blocks,
                                           attempt)
        self.source = source
        self.paths.append(path)
        self._receivers.append(self.receiver)

    def _retry_source(self) -> KVSource | None:
        """The pool: itself once more if it failed, else the pool the params offer."""
        if self.source.fallback:
            return self.source
        return next((s for s in self._connector.chain(self.params) if s.fallback), None)

    def _settle(self, state: TransferState) -> None:
        self._state = state
        if state is TransferState.SUCCESS:
            self._connector._count(self.source.bytes_moved(self.path, self.receiver))
        else:
            self.error = _error_of(self.receiver)
            if not self.aborted:
                self._connector._count_error(self.path, self.error)
            self.source.left(self.params, self.receiver)
        for source in self._connector.chain(self.params):
            if source not in self._tried:  # what it offered stays unused: let go of it now
                source.release(self.params)


def _error_of(receiver: KVReceiver) -> KVStoreError:
    try:
        receiver.result()
    except KVStoreError as exc:
        return exc
    raise RuntimeError("receiver did not fail")
