"""Moves a request's prompt KV from the prefill side into its reserved decode cache blocks,
through the transfer backends of kvstore.transfer.

The path a request's blocks take (KVFetcher.start_fetch):

1. pair — with ``--kv-transfer torch`` the prefill pushes every block of the prompt (the full
   ones, then the tail) over its torch.distributed pair channel with this worker
   (PrefillResult.pair_address, pair_tag). If the pair fails, the fetch falls back, once, to
   the store path: the prefill publishes every block to its node's KV store as well (the pool
   is the prefix cache), so a broken pair costs time, not the request.
2. store — full blocks through this node's shared-memory arena when the prefill ran on this
   node, else by key over gRPC streams; the tail by its one-shot handle over gRPC
   (``--kv-transfer fake``, tests only: the fake backend instead).
3. layer — with ``--kv-streaming layer`` the prefill announces the request before computing
   (KVFetcher.start_stream, before the decode even has the request) and the pieces of each
   layer are taken from the prefill node's store as they are put (LayerStreamReceiver).

Faults: every attempt has a deadline (KVTransferConfig.timeout_s; a layer stream's
bounds the silence between pieces). A failed or timed-out attempt is retried once from
another holder: after a pair or layer stream, the prefill node's store (keyed blocks + tail);
after the store itself, the store again over gRPC (the one other path to the only node known
to hold the tail). If the retry fails too, the fetch FAILS and the engine recomputes the
prompt locally (decode_worker/engine.py), so a transfer fault costs time, not the request.

Blocks land straight in the reserved cache blocks, written from the backends' threads (a
CallbackDest): no running request uses those blocks, and once poll() has returned FAILED, or
abort() has returned True, nothing more is written, so the engine frees them at once.
A request that ends without fetching is release()d: its store tail is dropped and a pushed
transfer is drained into a discarding destination, so the pair stays healthy instead of
failing at the sender's deadline. Protobuf, shared memory or raw tensors only: no pickle.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Sequence

import torch

from engine.kv_cache import PagedKVCache
from engine.protocol import PrefillResult
from kvstore.config import KVStoreConfig, KVTransferConfig
from kvstore.errors import KVStoreError
from kvstore.node_client import NodeStoreClient
from kvstore.transfer.arena_receiver import ArenaReceiver
from kvstore.transfer.base import FetchRequest, KVReceiver, KVTransferBackend, TransferState
from kvstore.transfer.dest import CallbackDest
from kvstore.transfer.grpc_backend import GrpcTransferBackend
from kvstore.transfer.layer_stream import (ALL_LAYERS, LayerPiece, LayerStreamAnnounce,
                                           LayerStreamReceiver)
from kvstore.transfer.registry import create_backend

log = logging.getLogger(__name__)

#: Paths whose success took the tail block from the prefill node's store.
_TAKES_STORE_TAIL = frozenset({"grpc", "arena"})
#: Attempts of one fetch: the first path, then one retry from another holder.
MAX_ATTEMPTS = 2


class KVFetcher:
    """Starts, drains and accounts the fetches of one decode worker; thread-safe.

    Args:
        kv_cache: where blocks land, in the KV pool's layout (every KV head): the runner's
            `wire_kv` (at TP=1 the paged cache itself; at TP=k rank 0 writes whole blocks and
            each rank keeps its KV heads — fetched once, not once per rank).
        transfer: the transfer settings (``--kv-transfer``), or a number: gRPC with that
            timeout in seconds.
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
            ("torch", "grpc", "arena", "fake").
        v_perturbation: a fault to inject (DecodeWorker.inject_fault, only with
            EngineConfig.fault_injection on): when non-zero, added to every received V block
            before it is written to the cache. Always 0 in serving.
    """

    def __init__(self, kv_cache: PagedKVCache, transfer: KVTransferConfig | float,
                 node_id: str | None = None, node_client: NodeStoreClient | None = None,
                 backend: KVTransferBackend | None = None,
                 kv_config: KVStoreConfig | None = None) -> None:
        if not isinstance(transfer, KVTransferConfig):
            transfer = KVTransferConfig(timeout_s=float(transfer))
        self.kv_cache = kv_cache
        self.transfer = transfer
        self.node_id = node_id
        self.node_client = node_client
        self.backend = backend or create_backend(transfer, kv_config)
        # the store path, tails and releases always go over gRPC
        self.grpc = (self.backend if isinstance(self.backend, GrpcTransferBackend)
                     else GrpcTransferBackend(transfer, kv_config))
        self.pair = self.backend if self.backend.name == "torch" else None
        self.store = self.grpc if self.pair is not None else self.backend
        self.v_perturbation = 0.0
        self.bytes_by_backend: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._threads = ThreadPoolExecutor(4, thread_name_prefix="kv-fetch")

    @property
    def bytes_fetched_total(self) -> int:
        with self._lock:
            return sum(self.bytes_by_backend.values())

    def start_fetch(self, prefill: PrefillResult, block_table: Sequence[int]) -> KVFetch:
        """Begin writing the prompt's KV into ``block_table[0 : n_full (+1 if tail)]``; never
        blocks. Poll the returned fetch once per engine step."""
        num_blocks = len(prefill.block_keys) + (prefill.tail_handle is not None)
        return KVFetch(self, list(block_table[:num_blocks]), prefill)

    def start_stream(self, announce: LayerStreamAnnounce, block_table: Sequence[int]) -> KVFetch:
        """Begin taking a layer stream into ``block_table[0 : announce.num_blocks]`` while the
        prefill computes; never blocks. The fetch needs the PrefillResult (KVFetch.attach)
        only to retry from the store."""
        return KVFetch(self, list(block_table[:announce.num_blocks]), None, announce)

    def fetch(self, prefill: PrefillResult, block_table: Sequence[int]) -> int:
        """Synchronous start_fetch: waits for the fetch; returns the bytes written.

        Raises kvstore.errors.KVStoreError subclasses (missing block, timeout, RPC failure);
        the caller frees the blocks it reserved."""
        fetch = self.start_fetch(prefill, block_table)
        while not (state := fetch.poll()).done:
            fetch.receiver.wait(timeout_s=0.05)
        if state is TransferState.FAILED:
            raise fetch.error
        return fetch.nbytes

    def release(self, prefill: PrefillResult | None) -> None:
        """For a request that ends without fetching (aborted while waiting, finished at
        admission): drain a pushed transfer and drop the store tail. Never blocks; nothing to
        do for a colocated request (prefill None)."""
        if prefill is None:
            return
        if prefill.layer_stream is not None:
            self.release_pieces(prefill.layer_stream)
        if self.pair is not None and prefill.pair_address is not None:
            request = _pair_request(prefill)
            sink = CallbackDest(lambda start, blocks: None, request.num_blocks,
                                self.kv_cache.block_shape, self.kv_cache.dtype)
            self.pair.create_receiver().start(request, sink)  # its own thread, own deadline
        self.release_tail(prefill)

    def release_tail(self, prefill: PrefillResult | None) -> None:
        """Drop the tail block on the prefill side (in the background; never blocks)."""
        if prefill is not None and prefill.tail_handle is not None:
            self._threads.submit(self._release_tail_now, prefill)

    def release_pieces(self, announce: LayerStreamAnnounce, start: int = 0) -> None:
        """Drop a layer stream's pieces ``start..`` from the prefill's store (background)."""
        if start < len(announce.pieces):
            self._threads.submit(self._release_handles, announce.address,
                                 announce.handles[start:])

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        for backend in {id(b): b for b in (self.backend, self.grpc)}.values():
            backend.close()

    # ---- internals ----------------------------------------------------------------------

    def _dest(self, table: list[int]) -> CallbackDest:
        return CallbackDest(lambda start, blocks: self._write(table, start, blocks), len(table),
                            self.kv_cache.block_shape, self.kv_cache.dtype)

    def _stream_receiver(self, announce: LayerStreamAnnounce,
                         table: list[int]) -> LayerStreamReceiver:
        writer = LayerWriter(self.kv_cache, table, self._perturbed)
        return LayerStreamReceiver(self.grpc.client(announce.address), announce, writer.write,
                                   writer.finish, writer.piece_shape, self.kv_cache.dtype,
                                   self.transfer.timeout_s)

    def _receiver(self, path: str) -> KVReceiver:
        if path == "arena":
            return ArenaReceiver(self.node_client, self.grpc.client, self._threads,
                                 self.transfer.timeout_s)
        if path == "torch":
            return self.pair.create_receiver()
        return self.store.create_receiver()

    def _store_path(self, prefill: PrefillResult) -> str:
        if (self.store is self.grpc and self.node_client is not None
                and prefill.kv_node_id == self.node_id):
            return "arena"
        return self.store.name

    def _write(self, table: list[int], start: int, blocks: torch.Tensor) -> None:
        self.kv_cache.write_blocks(table[start:start + blocks.shape[0]],
                                   self._perturbed(blocks, 2))

    def _perturbed(self, blocks: torch.Tensor, kv_dim: int) -> torch.Tensor:
        """v_perturbation added to V (index 1 of dim ``kv_dim``: 2 for blocks [n, layers,
        k|v, ...], 1 for one layer's [n, k|v, ...])."""
        if not self.v_perturbation:
            return blocks
        blocks = blocks.clone()  # the backend's blocks are read-only views
        blocks.select(kv_dim, 1).add_(self.v_perturbation)
        return blocks

    def _release_handles(self, address: str, handles: list[str]) -> None:
        client = self.grpc.client(address)
        for handle in handles:
            try:
                client.release_tail(handle)
            except KVStoreError:
                pass  # the store's tail TTL reclaims it

    def _count(self, by_backend: dict[str, int]) -> None:
        with self._lock:
            self.bytes_by_backend.update(by_backend)

    def _release_tail_now(self, prefill: PrefillResult) -> None:
        try:
            self.grpc.client(prefill.kv_address).release_tail(prefill.tail_handle)
        except KVStoreError:
            pass  # the store's tail TTL reclaims it


class KVFetch:
    """One request's prompt KV on its way into its reserved blocks; the engine polls it once
    per step and never blocks on it.

    Attributes:
        paths: the paths tried so far, in order: "layer", "torch", "grpc", "arena" or "fake";
            at most MAX_ATTEMPTS (the first, then one retry from another holder).
        receiver: the current path's receiver.
        stream: the layer stream it started with, or None.
        error: the error the fetch FAILED with, once it has (then the engine recomputes).
        nbytes: bytes written, once SUCCESS.
    """

    def __init__(self, fetcher: KVFetcher, table: list[int], prefill: PrefillResult | None,
                 stream: LayerStreamAnnounce | None = None) -> None:
        self._fetcher, self._table, self.prefill, self.stream = fetcher, table, prefill, stream
        self.started_s = time.time()
        self.paths: list[str] = []
        self.error: KVStoreError | None = None
        self.nbytes = 0
        self._aborted = False
        self._settled = False
        self._state = TransferState.TRANSFERRING
        self.layer_receiver: LayerStreamReceiver | None = None
        if stream is not None:
            first = "layer"
        elif fetcher.pair is not None and prefill.pair_address is not None:
            first = "torch"
        else:
            first = fetcher._store_path(prefill)
        self.receiver = self._start(first)

    @property
    def path(self) -> str:
        return self.paths[-1]

    @property
    def retries(self) -> int:
        return len(self.paths) - 1

    def attach(self, prefill: PrefillResult) -> None:
        """The request's PrefillResult, for a fetch started from a layer-stream announce."""
        self.prefill = prefill

    def poll(self) -> TransferState:
        """The fetch's state; SUCCESS and FAILED are final. A layer stream that failed before
        its PrefillResult is attached stays TRANSFERRING (its retry needs the result)."""
        if self._settled:
            return self._state
        state = self.receiver.poll()
        if state is TransferState.FAILED and not self._aborted \
                and len(self.paths) < MAX_ATTEMPTS:
            if self.prefill is None:
                return TransferState.TRANSFERRING
            log.warning("KV fetch of %s over %s failed, retrying from the KV store: %s",
                        self.prefill.request_id, self.path, _error_of(self.receiver),
                        extra={"request_id": self.prefill.request_id})
            self._leave_path()
            self.receiver = self._start(self._retry_path())
            state = self.receiver.poll()
        if state.done:
            self._settle(state)
        return state

    def abort(self) -> bool:
        """Stop fetching. True: nothing more will be written, free the blocks now. False (a
        pair receive under way): poll until done, then free — the receive is left to finish,
        or to fail at its deadline, because aborting it would tear the pair channel down, and
        every other transfer on it, as torch cannot cancel a posted recv."""
        self._aborted = True
        if self.path == "torch" and not self.poll().done:
            return False
        self.receiver.abort()
        self.poll()
        return True

    def timings(self) -> dict:
        """The paths tried and a layer stream's arrivals: [(piece, layer, time.time())]."""
        arrivals = self.layer_receiver.arrivals if self.layer_receiver is not None else []
        return {"paths": list(self.paths), "arrivals": list(arrivals)}

    def _start(self, path: str) -> KVReceiver:
        self.paths.append(path)
        if path == "layer":
            receiver = self.layer_receiver = self._fetcher._stream_receiver(self.stream,
                                                                            self._table)
            receiver.start()
            return receiver
        prefill = self.prefill
        request = _pair_request(prefill) if path == "torch" else FetchRequest(
            prefill.kv_address, prefill.block_keys, prefill.tail_handle, prefill.num_tail_tokens)
        receiver = self._fetcher._receiver(path)
        receiver.start(request, self._fetcher._dest(self._table))
        return receiver

    def _retry_path(self) -> str:
        if self.path in ("layer", "torch"):
            return self._fetcher._store_path(self.prefill)
        return "grpc" if self.path == "arena" else self.path

    def _leave_path(self) -> None:
        """The layer stream's pieces nobody will take are dropped from the store."""
        if self.path == "layer":
            self._fetcher.release_pieces(self.stream, self.receiver.num_taken)

    def _settle(self, state: TransferState) -> None:
        self._settled, self._state = True, state
        if state is TransferState.SUCCESS:
            by_backend = _bytes_by_backend(self.receiver, self.path)
            self.nbytes = sum(by_backend.values())
            self._fetcher._count(by_backend)
        else:
            self.error = _error_of(self.receiver)
            self._leave_path()
        if not (state is TransferState.SUCCESS and self.path in _TAKES_STORE_TAIL):
            self._fetcher.release_tail(self.prefill)  # not taken: do not wait for its TTL


class LayerWriter:
    """Puts a layer stream's pieces into the reserved blocks: straight into the paged cache
    (TP=1), else into a staging copy written whole at the end, each rank keeping its KV heads
    (the ShardedKVView writes only whole blocks)."""

    def __init__(self, cache: PagedKVCache, table: list[int],
                 perturbed: Callable[[torch.Tensor, int], torch.Tensor]) -> None:
        self.table, self.cache, self._perturbed = table, cache, perturbed
        self.direct = isinstance(self.cache, PagedKVCache)
        self.staging = None if self.direct else torch.zeros(
            (len(table), *self.cache.block_shape), dtype=self.cache.dtype)

    def piece_shape(self, piece: LayerPiece) -> tuple[int, ...]:
        shape = self.cache.block_shape  # (layers, 2, block_size, kv_heads, head_dim)
        return (piece.num_blocks, *(shape if piece.layer == ALL_LAYERS else shape[1:]))

    def write(self, piece: LayerPiece, data: torch.Tensor) -> None:
        whole = piece.layer == ALL_LAYERS
        data = self._perturbed(data, 2 if whole else 1)
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
            self.cache.k[piece.layer][index] = data[:, 0]
            self.cache.v[piece.layer][index] = data[:, 1]

    def finish(self) -> None:
        if self.staging is not None:
            self.cache.write_blocks(self.table, self.staging)


def _pair_request(prefill: PrefillResult) -> FetchRequest:
    return FetchRequest(prefill.pair_address, prefill.block_keys, prefill.tail_handle,
                        prefill.num_tail_tokens, tag=prefill.pair_tag)


def _bytes_by_backend(receiver: KVReceiver, path: str) -> dict[str, int]:
    total = receiver.result()
    if isinstance(receiver, ArenaReceiver):
        return {"arena": receiver.arena_bytes, "grpc": total - receiver.arena_bytes}
    return {path: total}  # "layer": the layer stream's pieces (over gRPC)


def _error_of(receiver: KVReceiver) -> KVStoreError:
    try:
        receiver.result()
    except KVStoreError as exc:
        return exc
    raise RuntimeError("receiver did not fail")
