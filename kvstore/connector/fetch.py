"""The fetch connector: a decode worker's KV connector. It moves a request's prompt KV from the
prefill side into the request's reserved cache blocks, through the transfer backends of
kvstore.transfer.

As a connector (FetchConnector): a request that comes with a prefill's KV transfer params
(kvstore.handoff.DecodeHandoff) matches its prompt
past the tokens the decode's own prefix cache holds, asynchronously
(get_num_new_matched_tokens); once it holds its blocks the fetch is planned
(update_state_after_alloc) and started (start_load_kv), and get_finished reports it settled —
landed, or failed after its retry, and then the engine recomputes the prompt. Only the blocks
after the cached ones travel (incremental transfer); the engine asks for that only where the
blocks come by the store path, as a pushed transfer brings the whole prompt.
request_finished lets go of what the prefill side holds for a request that never fetched.

The path a request's blocks take (KVFetch):

1. pair — with ``--kv-transfer torch`` the prefill pushes every block of the prompt (the full
   ones, then the tail) over its torch.distributed pair channel with this worker
   (``pair_address``, ``pair_tag``). If the pair fails, the fetch falls back, once, to
   the store path: the prefill publishes every block to its node's KV store as well (the pool
   is the prefix cache), so a broken pair costs time, not the request.
   With ``--kv-transfer mooncake`` the prefill instead copies them into a region of the memory
   its Transfer Engine registered (``kv_region``) and this worker reads the region
   with one TE batch straight into the reserved blocks of its registered cache
   (kvstore.transport.mooncake.backend); a failed read falls back to the store path the same way.
2. store — full blocks through this node's shared-memory arena when the prefill ran on this
   node, else by key over gRPC streams; the tail by its one-shot handle over gRPC
   (tests may give the connector a fake backend for this path).
3. layer — with ``--kv-streaming layer`` the prefill announces the request before computing
   (FetchConnector.start_stream, before the decode even has the request) and the pieces of
   each layer are taken from the prefill node's store as they are put (LayerStreamReceiver).

Faults: every attempt has a deadline (KVTransferConfig.timeout_s; a layer stream's
bounds the silence between pieces). A failed or timed-out attempt is retried once from
another holder: after a pair, a Mooncake read or a layer stream, the prefill node's store
(keyed blocks + tail); after the store itself, the store again over gRPC (the one other path
to the only node known to hold the tail). If the retry fails too, the fetch FAILS and the engine recomputes the
prompt locally (the decode engine), so a transfer fault costs time, not the request.

Blocks land straight in the reserved cache blocks, written from the backends' threads (a
CallbackDest): no running request uses those blocks, and once get_finished has reported the
fetch (landed, failed, or aborted and settled) nothing more is written, so the engine may free
them then.
A request that ends without fetching (request_finished) has its store tail dropped and a
pushed transfer drained into a discarding destination, so the pair stays healthy instead of
failing at the sender's deadline. Protobuf, shared memory or raw tensors only: no pickle.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence

import torch

from pdcluster.engine.core.kv_connector import (BlockCache, KVConnector, KVConnectorRequest,
                                                KVTransferParams, LoadOutcome)
from pdcluster.kvstore.config import KVStoreConfig, KVTransferConfig
from pdcluster.kvstore.connector.context import KVConnectorContext
from pdcluster.kvstore.errors import KVStoreError, KVTransferTimeout
from pdcluster.kvstore.handoff import DecodeHandoff
from pdcluster.kvstore.node_client import NodeStoreClient
from pdcluster.kvstore.transfer.base import (FetchRequest, KVReceiver, KVTransferBackend,
                                             TransferState)
from pdcluster.kvstore.transfer.dest import CacheDest, CallbackDest
from pdcluster.kvstore.transfer.registry import create_backend
from pdcluster.kvstore.transport.layer_stream.stream import (ALL_LAYERS, LayerPiece,
                                                             LayerStreamAnnounce,
                                                             LayerStreamReceiver)
from pdcluster.kvstore.transport.mooncake.layer_stream import MooncakeLayerStreamReceiver
from pdcluster.kvstore.transport.pool.arena_receiver import ArenaReceiver
from pdcluster.kvstore.transport.pool.grpc_backend import GrpcTransferBackend

log = logging.getLogger(__name__)

#: Paths whose success took the tail block from the prefill node's store.
_TAKES_STORE_TAIL = frozenset({"grpc", "arena"})
#: Attempts of one fetch: the first path, then one retry from another holder.
MAX_ATTEMPTS = 2
#: Requests whose kv_timings are kept (the most recent).
MAX_TIMINGS = 4096


class FetchConnector(KVConnector):
    """A decode worker's KV connector: starts, polls and accounts the fetches of its requests
    (see the module docstring); its accounting is thread-safe.

    Blocks land in the cache given to register_kv_caches, in the KV pool's layout (every KV
    head): the runner's `wire_kv` (at TP=1 the paged cache itself; at TP=k rank 0 writes whole
    blocks and each rank keeps its KV heads — fetched once, not once per rank).

    Args:
        transfer: the transfer settings (``--kv-transfer``).
        node_id, node_client: this worker's Ray node and its KV store; with both, full blocks
            published on this node are read through the shared-memory arena.
        backend: use this backend instead of building ``transfer.backend`` (tests: a fake
            with failure injection).
        kv_config: the KV store's config, whose token, TLS and max message size every
            channel to a store or a prefill peer uses. None: no token and no TLS (stores
            without auth, tests), unless ``transfer`` carries them under their deprecated
            names (kvstore.config.kv_plane_of).

    Attributes:
        bytes_by_backend: KV bytes written into the cache by successful fetches, by path
            ("torch", "mooncake", "grpc", "arena", or a given backend's name).
        errors_by_backend: failed attempts by path and kind: "timeout" (KVTransferTimeout, a
            deadline passed) or "error"; attempts of aborted fetches are not counted.
        kv_timings: per request (the last MAX_TIMINGS fetched): when its fetch started
            (``fetch_start_s``) and settled (``admitted_s``, time.time()), the paths tried, a
            layer stream's per-piece arrivals, and ``failed`` when nothing landed.
    """

    polled = True

    def __init__(self, transfer: KVTransferConfig, node_id: str | None = None,
                 node_client: NodeStoreClient | None = None,
                 backend: KVTransferBackend | None = None,
                 kv_config: KVStoreConfig | None = None) -> None:
        self.transfer, self.node_id, self.node_client = transfer, node_id, node_client
        self.backend = backend or create_backend(transfer, kv_config)
        # the store path, tails and releases always go over gRPC (releases on its threads)
        self.grpc = (self.backend if isinstance(self.backend, GrpcTransferBackend)
                     else GrpcTransferBackend(transfer, kv_config))
        self.pair = self.backend if self.backend.handoff == "push" else None
        self.puller = self.backend if self.backend.handoff == "region" else None
        self.store = self.backend if self.backend.handoff == "store" else self.grpc
        self.bytes_by_backend: Counter[str] = Counter()
        #: failed attempts by path and kind ("timeout": past a deadline, "error": the rest);
        #: an aborted fetch's attempt is neither
        self.errors_by_backend: dict[str, Counter[str]] = {}
        self._lock = threading.Lock()
        self._planned: list[tuple[KVConnectorRequest, list[int]]] = []
        self._fetches: dict[str, KVFetch] = {}
        self._fetched: set[str] = set()  # fetches started whose request has not finished
        self.kv_timings: OrderedDict[str, dict] = OrderedDict()
        self.num_fetch_retries_total = 0

    @classmethod
    def from_context(cls, ctx: KVConnectorContext) -> FetchConnector:
        return cls(ctx.transfer, ctx.node_id, ctx.local_store, kv_config=ctx.kv_config)

    def get_num_new_matched_tokens(self, request: KVConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """The prompt after the `num_computed_tokens` found cached here (whole blocks),
        asynchronously, when the request comes with a prefill's KV transfer params."""
        if request.kv_transfer_params is None:
            return 0, False
        return request.num_prompt_tokens - num_computed_tokens, True

    def allows_local_prefix(self, request: KVConnectorRequest) -> bool:
        """For a prompt from a prefill: with incremental transfer on
        (KVTransferConfig.incremental_transfer), unless it comes whole by a push (torch pair,
        TE region, layer stream), which was sent before this worker was asked."""
        if request.kv_transfer_params is None:
            return True
        return (self.transfer.incremental_transfer
                and not DecodeHandoff.of(request.kv_transfer_params).pushed)

    def update_state_after_alloc(self, request: KVConnectorRequest, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        """Plans the fetch of the last `num_external_tokens` of the prompt into `block_ids`;
        the blocks before them hold cached KV already and are left alone."""
        if num_external_tokens:
            skip = (request.num_prompt_tokens - num_external_tokens) // self.cache.block_size
            self._planned.append((request, list(block_ids), skip))

    def start_load_kv(self) -> None:
        """Start the planned fetches (a layer stream not announced here in time is taken now,
        from the store where its pieces wait); never blocks."""
        planned, self._planned = self._planned, []
        for request, table, skip in planned:
            handoff = DecodeHandoff.of(request.kv_transfer_params)
            self._track(KVFetch(self, request.request_id, table, handoff, handoff.layer_stream,
                                skip))

    def start_stream(self, announce: LayerStreamAnnounce, block_table: Sequence[int]) -> KVFetch:
        """A layer stream announced before its request came, taken into blocks reserved for it
        while the prefill computes; never blocks. Once the request comes, adopt() it
        (kvstore's pre-arrival reservation, SGLang's decode "prealloc" queue)."""
        return KVFetch(self, announce.request_id, block_table, None, announce)

    def adopt(self, request: KVConnectorRequest, fetch: KVFetch) -> None:
        """The request of a stream started by start_stream came: report it as its load."""
        fetch.handoff = DecodeHandoff.of(request.kv_transfer_params)
        self._track(fetch)

    def _track(self, fetch: KVFetch) -> None:
        self._fetches[fetch.request_id] = fetch
        self._fetched.add(fetch.request_id)
        self.kv_timings[fetch.request_id] = {"fetch_start_s": fetch.started_s}
        while len(self.kv_timings) > MAX_TIMINGS:
            self.kv_timings.popitem(last=False)

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
            stream = fetch.layer_receiver
            detail = {"paths": list(fetch.paths),
                      "arrivals": list(stream.arrivals) if stream is not None else []}
            self.num_fetch_retries_total += len(fetch.paths) - 1
            timings = self.kv_timings.get(request_id, {})
            timings.update(detail, admitted_s=time.time())
            if state is TransferState.SUCCESS:
                bs = self.cache.block_size
                num_tokens = fetch.handoff.num_tokens(bs) - fetch.skip_blocks * bs
                loaded[request_id] = LoadOutcome(num_tokens, {fetch.path: num_tokens},
                                                 detail=detail)
            else:
                loaded[request_id] = LoadOutcome(failures=[f"{'→'.join(fetch.paths)}: "
                                                           f"{fetch.error}"], detail=detail)
                timings["failed"] = True
        return {}, loaded

    def request_finished(self, request: KVConnectorRequest, block_ids: Sequence[int]
                         ) -> tuple[bool, KVTransferParams]:
        """For a request that ended without fetching (aborted or refused while waiting, or
        stopped by its first token): a pushed transfer is drained and the store tail dropped.
        Never blocks; nothing to do for one that fetched, or a colocated one (no KV transfer
        params)."""
        if request.request_id in self._fetched:
            self._fetched.discard(request.request_id)
            return False, {}
        if request.kv_transfer_params is None:
            return False, {}
        prefill = DecodeHandoff.of(request.kv_transfer_params)
        if prefill.layer_stream is not None:
            self._release_pieces(prefill.layer_stream)
        if self.pair is not None and prefill.pair_address is not None:
            pushed = _pair_request(prefill)
            sink = CallbackDest(lambda start, blocks: None, pushed.num_blocks,
                                self.cache.block_shape, self.cache.dtype)
            self.pair.create_receiver().start(pushed, sink)  # its own thread, own deadline
        if self.puller is not None and prefill.kv_region is not None:
            self.grpc.submit(self.puller.release, prefill.kv_region)
        self._release_tail(prefill)
        return False, {}

    def abort(self, request_id: str) -> None:
        """Its fetch stops; get_finished reports it once nothing more is written into its
        blocks (at once, or when a pair receive under way settles: see KVFetch.abort)."""
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

    # ---- for KVFetch ----------------------------------------------------------------------

    def _release_tail(self, prefill: DecodeHandoff | None) -> None:
        """Drop the tail block on the prefill side (in the background; never blocks)."""
        if prefill is not None and prefill.tail_handle is not None:
            self.grpc.submit(self._release_handles, prefill.kv_address, [prefill.tail_handle])

    def _release_pieces(self, announce: LayerStreamAnnounce, start: int = 0) -> None:
        """Drop a layer stream's pieces ``start..`` from the prefill's store, or release its
        TE region (background)."""
        if announce.region is not None:
            if self.puller is not None:
                self.grpc.submit(self.puller.release, announce.region)
        elif start < len(announce.pieces):
            self.grpc.submit(self._release_handles, announce.address, announce.handles[start:])

    def _release_handles(self, address: str, handles: list[str]) -> None:
        client = self.grpc.client(address)
        for handle in handles:
            try:
                client.release_tail(handle)
            except KVStoreError:
                pass  # the store's tail TTL reclaims it

    def _store_path(self, prefill: DecodeHandoff) -> str:
        if (self.store is self.grpc and self.node_client is not None
                and prefill.kv_node_id == self.node_id):
            return "arena"
        return self.store.name

    def _dest(self, table: list[int]) -> CacheDest:
        """The blocks ``table`` of the cache: written by ``_write``, or straight into the
        cache by a backend that can."""
        return CacheDest(lambda start, blocks: self._write(table, start, blocks), table,
                         self.cache, self.cache.block_shape, self.cache.dtype)

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

    Starting never blocks: the prompt's KV goes into ``block_table[0 : n_full (+1 if tail)]``
    (a layer stream's into ``block_table[0 : stream.num_blocks]``). With ``skip_blocks`` k the
    first k full blocks are cached here already: only keys k.. and the tail are fetched, into
    ``block_table[k:]``, by the store paths (a pushed transfer or a layer stream always brings
    the whole prompt, so it takes none to skip). A fetch started from a layer-stream announce
    (``handoff`` None) needs the prefill's params (set ``handoff``) only to retry from the store.

    Attributes:
        paths: the paths tried so far, in order: "layer", "torch", "mooncake", "grpc", "arena"
            or a given backend's name; at most MAX_ATTEMPTS (the first, then one retry from
            another holder).
        receiver: the current path's receiver.
        stream: the layer stream it started with, or None.
        error: the error the fetch FAILED with, once it has (then the engine recomputes).
    """

    def __init__(self, connector: FetchConnector, request_id: str, block_table: Sequence[int],
                 handoff: DecodeHandoff | None, stream: LayerStreamAnnounce | None = None,
                 skip_blocks: int = 0) -> None:
        prefill = handoff
        num_blocks = (stream.num_blocks if stream is not None
                      else len(prefill.block_keys) + (prefill.tail_handle is not None))
        pushed = stream is not None or prefill.pair_address is not None \
            or prefill.kv_region is not None
        if skip_blocks and (pushed or skip_blocks > len(prefill.block_keys)):
            raise ValueError(f"cannot skip {skip_blocks} blocks of a pushed transfer or of "
                             f"{len(prefill.block_keys)} keyed blocks")
        self.skip_blocks = skip_blocks
        self._connector, self._table = connector, list(block_table[skip_blocks:num_blocks])
        self.request_id, self.handoff, self.stream = request_id, handoff, stream
        self.started_s = time.time()
        self.paths: list[str] = []
        self.error: KVStoreError | None = None
        self.aborted = False
        self._state = TransferState.TRANSFERRING  # until settled
        self.layer_receiver: LayerStreamReceiver | None = None
        if stream is not None:
            first = "layer"
        elif connector.pair is not None and prefill.pair_address is not None:
            first = "torch"
        elif connector.puller is not None and prefill.kv_region is not None:
            first = "mooncake"
        else:
            first = connector._store_path(prefill)
        self.receiver = self._start(first)

    @property
    def path(self) -> str:
        return self.paths[-1]

    def poll(self) -> TransferState:
        """The fetch's state; SUCCESS and FAILED are final. A layer stream that failed before
        its hand-off is set stays TRANSFERRING (its retry needs it)."""
        if self._state.done:
            return self._state
        state = self.receiver.poll()
        if state is TransferState.FAILED and not self.aborted \
                and len(self.paths) < MAX_ATTEMPTS:
            if self.handoff is None:
                return TransferState.TRANSFERRING
            error = _error_of(self.receiver)
            self._connector._count_error(self.path, error)
            log.warning("KV fetch of %s over %s failed, retrying from the KV store: %s",
                        self.request_id, self.path, error,
                        extra={"request_id": self.request_id})
            self._leave_path()
            self.receiver = self._start(self._retry_path())
            state = self.receiver.poll()
        if state.done:
            self._settle(state)
        return state

    def abort(self) -> bool:
        """Stop fetching. True: nothing more will be written. False (a pair receive or a
        Mooncake read under way): bytes may still land until it is done — the receive is left
        to finish, or to fail at its deadline, because aborting it would tear the pair channel
        down, and every other transfer on it, as torch cannot cancel a posted recv; TE cannot
        cancel a read at all. Either way the connector reports the fetch from get_finished once
        it has settled."""
        self.aborted = True
        if self.path in ("torch", "mooncake") and not self.poll().done:
            return False
        self.receiver.abort()
        self.poll()
        return True

    def _start(self, path: str) -> KVReceiver:
        self.paths.append(path)
        connector, prefill = self._connector, self.handoff
        if path == "layer":
            writer = LayerWriter(connector.cache, self._table)
            args = (self.stream, writer.write, writer.finish, writer.piece_shape,
                    connector.cache.dtype, connector.transfer.timeout_s)
            if self.stream.region is not None and connector.puller is not None:
                receiver = MooncakeLayerStreamReceiver(connector.puller, *args)
            else:  # without a puller (a misconfigured pair) it times out: the store retry
                receiver = LayerStreamReceiver(connector.grpc.client(self.stream.address), *args)
            self.layer_receiver = receiver
            receiver.start()
            return receiver
        if path == "torch":
            receiver, request = connector.pair.create_receiver(), _pair_request(prefill)
        elif path == "mooncake":
            region = prefill.kv_region
            receiver = connector.puller.create_receiver()
            request = FetchRequest(region.session, prefill.block_keys, prefill.tail_handle,
                                   prefill.num_tail_tokens, region=region)
        else:
            receiver = (ArenaReceiver(connector.grpc, connector.node_client) if path == "arena"
                        else connector.store.create_receiver())
            request = FetchRequest(prefill.kv_address, prefill.block_keys[self.skip_blocks:],
                                   prefill.tail_handle, prefill.num_tail_tokens)
        receiver.start(request, connector._dest(self._table))
        return receiver

    def _retry_path(self) -> str:
        if self.path in ("layer", "torch", "mooncake"):
            return self._connector._store_path(self.handoff)
        return "grpc" if self.path == "arena" else self.path

    def _leave_path(self) -> None:
        """The layer stream's pieces nobody will take are dropped from the store."""
        if self.path == "layer":
            self._connector._release_pieces(self.stream, self.receiver.num_taken)

    def _settle(self, state: TransferState) -> None:
        self._state = state
        if state is TransferState.SUCCESS:
            self._connector._count(_bytes_by_backend(self.receiver, self.path))
        else:
            self.error = _error_of(self.receiver)
            if not self.aborted:
                self._connector._count_error(self.path, self.error)
            self._leave_path()
        if not (state is TransferState.SUCCESS and self.path in _TAKES_STORE_TAIL):
            self._connector._release_tail(self.handoff)  # not taken: do not wait for its TTL


class LayerWriter:
    """Puts a layer stream's pieces into the reserved blocks: straight into the paged cache
    (TP=1), else into a staging copy written whole at the end, each rank keeping its KV heads
    (the ShardedKVView writes only whole blocks)."""

    def __init__(self, cache: BlockCache, table: list[int]) -> None:
        self.table, self.cache = table, cache
        self.direct = hasattr(cache, "k")  # the paged cache itself (TP=1), not a sharded view
        self.staging = None if self.direct else torch.zeros(
            (len(table), *self.cache.block_shape), dtype=self.cache.dtype)

    def piece_shape(self, piece: LayerPiece) -> tuple[int, ...]:
        shape = self.cache.block_shape  # (layers, K|V or latent, block_size, kv_heads, head_dim)
        return (piece.num_blocks, *(shape if piece.layer == ALL_LAYERS else shape[1:]))

    def write(self, piece: LayerPiece, data: torch.Tensor) -> None:
        whole = piece.layer == ALL_LAYERS
        lo, hi = piece.block_start, piece.block_start + piece.num_blocks
        if not self.direct:
            if whole:
                self.staging[lo:hi] = data
            else:
                self.staging[lo:hi, piece.layer] = data
        elif whole:
            self.cache.write_blocks(self.table[lo:hi], data)
        else:
            index = torch.tensor(self.table[lo:hi], device=self.cache.device)
            data = data.to(self.cache.device)
            for part, tensor in enumerate(self.cache.parts(piece.layer)):
                tensor[index] = data[:, part]

    def finish(self) -> None:
        if self.staging is not None:
            self.cache.write_blocks(self.table, self.staging)


def _pair_request(prefill: DecodeHandoff) -> FetchRequest:
    return FetchRequest(prefill.pair_address, prefill.block_keys, prefill.tail_handle,
                        prefill.num_tail_tokens, tag=prefill.pair_tag)


def _bytes_by_backend(receiver: KVReceiver, path: str) -> dict[str, int]:
    total = receiver.result()
    if isinstance(receiver, ArenaReceiver):
        return {"arena": receiver.arena_bytes, "grpc": total - receiver.arena_bytes}
    if isinstance(receiver, MooncakeLayerStreamReceiver):
        return {"layer-mooncake": total}
    return {path: total}  # "layer": the layer stream's pieces (over gRPC)


def _error_of(receiver: KVReceiver) -> KVStoreError:
    try:
        receiver.result()
    except KVStoreError as exc:
        return exc
    raise RuntimeError("receiver did not fail")
