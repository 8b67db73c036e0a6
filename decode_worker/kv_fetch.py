"""Moves a request's prompt KV from the prefill side into its reserved decode cache blocks,
through the transfer backends of kvstore.transfer (DESIGN.md "Data plane").

The path a request's blocks take (KVFetcher.start_fetch):

1. pair — with ``--kv-transfer torch`` the prefill pushes every block of the prompt (the full
   ones, then the tail) over its torch.distributed pair channel with this worker
   (PrefillResult.pair_address, pair_tag). If the pair fails, the fetch falls back, once, to
   the store path: the prefill publishes every block to its node's KV store as well (the pool
   is the prefix cache), so a broken pair costs time, not the request.
2. store — full blocks through this node's shared-memory arena when the prefill ran on this
   node, else by key over gRPC streams; the tail by its one-shot handle over gRPC
   (``--kv-transfer fake``, tests only: the fake backend instead).

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
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch

from engine.kv_cache import PagedKVCache
from engine.protocol import PrefillResult
from kvstore.config import KVTransferConfig
from kvstore.errors import BlockLayoutError, BlockNotFoundError, KVStoreError, KVTransferError
from kvstore.node_client import NodeStoreClient
from kvstore.transfer.base import FetchRequest, KVReceiver, KVTransferBackend, TransferState
from kvstore.transfer.dest import BlockDest, CallbackDest, as_dest
from kvstore.transfer.grpc_backend import GrpcTransferBackend
from kvstore.transfer.registry import create_backend

log = logging.getLogger(__name__)

#: Paths whose success took the tail block from the prefill node's store.
_TAKES_STORE_TAIL = frozenset({"grpc", "arena"})


class KVFetcher:
    """Starts, drains and accounts the fetches of one decode worker; thread-safe.

    Args:
        kv_cache: where blocks land, in the KV pool's layout (every KV head): the runner's
            `wire_kv` (at TP=1 the paged cache itself; at TP=k rank 0 writes whole blocks and
            each rank keeps its KV heads — fetched once, not once per rank).
        transfer: the transfer settings (``--kv-transfer``), or a number: gRPC with that
            timeout in seconds and no token (stores without auth, tests).
        node_id, node_client: this worker's Ray node and its KV store; with both, full blocks
            published on this node are read through the shared-memory arena.
        backend: use this backend instead of building ``transfer.backend`` (tests: a fake
            with failure injection).

    Attributes:
        bytes_by_backend: KV bytes written into the cache by successful fetches, by path
            ("torch", "grpc", "arena", "fake").
        v_perturbation: TEST-ONLY hook. When non-zero, this value is added to every received V
            block before it is written to the cache, so a test can prove the decode output
            depends on the KV that came over the wire. Always 0 in serving.
    """

    def __init__(self, kv_cache: PagedKVCache, transfer: KVTransferConfig | float,
                 node_id: str | None = None, node_client: NodeStoreClient | None = None,
                 backend: KVTransferBackend | None = None) -> None:
        if not isinstance(transfer, KVTransferConfig):
            transfer = KVTransferConfig(timeout_s=float(transfer))
        self.kv_cache = kv_cache
        self.transfer = transfer
        self.node_id = node_id
        self.node_client = node_client
        self.backend = backend or create_backend(transfer)
        self.grpc = (self.backend if isinstance(self.backend, GrpcTransferBackend)
                     else GrpcTransferBackend(transfer))  # store path, tails, releases
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
        table = list(block_table[:num_blocks])
        dest = CallbackDest(lambda start, blocks: self._write(table, start, blocks), num_blocks,
                            self.kv_cache.block_shape, self.kv_cache.dtype)
        return KVFetch(self, prefill, dest)

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

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        for backend in {id(b): b for b in (self.backend, self.grpc)}.values():
            backend.close()

    # ---- internals ----------------------------------------------------------------------

    def _receiver(self, path: str) -> KVReceiver:
        if path == "arena":
            return _ArenaReceiver(self)
        if path == "torch":
            return self.pair.create_receiver()
        return self.store.create_receiver()

    def _store_path(self, prefill: PrefillResult) -> str:
        if (self.store is self.grpc and self.node_client is not None
                and prefill.kv_node_id == self.node_id):
            return "arena"
        return self.store.name

    def _write(self, table: list[int], start: int, blocks: torch.Tensor) -> None:
        if self.v_perturbation:
            blocks = blocks.clone()  # the backend's blocks are read-only views
            blocks[:, :, 1] += self.v_perturbation  # block layout [n, layers, k|v, ...]
        self.kv_cache.write_blocks(table[start:start + blocks.shape[0]], blocks)

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
    per step (STYLE.md item 7) and never blocks on it.

    Attributes:
        path: the path in use: "torch", "grpc", "arena" or "fake" (changes once, from "torch"
            to the store path, on the pair's failure).
        receiver: the current path's receiver.
        error: the error the fetch FAILED with, once it has.
        nbytes: bytes written, once SUCCESS.
    """

    def __init__(self, fetcher: KVFetcher, prefill: PrefillResult, dest: BlockDest) -> None:
        self._fetcher, self.prefill, self._dest = fetcher, prefill, dest
        pushed = fetcher.pair is not None and prefill.pair_address is not None
        self.path = "torch" if pushed else fetcher._store_path(prefill)
        self.error: KVStoreError | None = None
        self.nbytes = 0
        self._aborted = False
        self._settled = False
        self._state = TransferState.TRANSFERRING
        self.receiver = self._start(self.path)

    def poll(self) -> TransferState:
        """The fetch's state; SUCCESS and FAILED are final."""
        if self._settled:
            return self._state
        state = self.receiver.poll()
        if state is TransferState.FAILED and self.path == "torch" and not self._aborted:
            log.warning("KV pair transfer of %s failed, fetching from the KV store instead: %s",
                        self.prefill.request_id, _error_of(self.receiver))
            self.path = self._fetcher._store_path(self.prefill)
            self.receiver = self._start(self.path)
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

    def _start(self, path: str) -> KVReceiver:
        prefill = self.prefill
        request = _pair_request(prefill) if path == "torch" else FetchRequest(
            prefill.kv_address, prefill.block_keys, prefill.tail_handle, prefill.num_tail_tokens)
        receiver = self._fetcher._receiver(path)
        receiver.start(request, self._dest)
        return receiver

    def _settle(self, state: TransferState) -> None:
        self._settled, self._state = True, state
        if state is TransferState.SUCCESS:
            by_backend = _bytes_by_backend(self.receiver, self.path)
            self.nbytes = sum(by_backend.values())
            self._fetcher._count(by_backend)
        else:
            self.error = _error_of(self.receiver)
        if not (state is TransferState.SUCCESS and self.path in _TAKES_STORE_TAIL):
            self._fetcher.release_tail(self.prefill)  # not taken: do not wait for its TTL


class _ArenaReceiver(KVReceiver):
    """Store path on the prefill's own node: full blocks from the node's shared-memory arena
    (only metadata over Ray RPC), then the tail by handle over gRPC; on the fetcher's threads.

    Attributes:
        arena_bytes: bytes of the full blocks (the rest of result() came over gRPC).
    """

    def __init__(self, fetcher: KVFetcher) -> None:
        super().__init__()
        self._fetcher = fetcher
        self.arena_bytes = 0

    def start(self, request: FetchRequest, dest: BlockDest | torch.Tensor) -> None:
        dest = as_dest(dest)
        if dest.num_blocks != request.num_blocks:
            raise BlockLayoutError(f"destination holds {dest.num_blocks} block(s), the request "
                                   f"{request.num_blocks}")
        self.request = request
        self._begin(request.deadline_s or self._fetcher.transfer.timeout_s,
                    TransferState.TRANSFERRING)
        self._fetcher._threads.submit(self._run, dest)

    def _run(self, dest: BlockDest) -> None:
        request = self.request
        try:
            keys = list(request.keys)
            if keys:
                out = torch.empty((len(keys), *dest.block_shape), dtype=dest.dtype)
                tiers = self._fetcher.node_client.read(keys, out)
                missing = [k for k, t in zip(keys, tiers) if t is None]
                if missing:
                    raise BlockNotFoundError(f"{len(missing)} of {len(keys)} blocks left this "
                                             "node's pool before decode read them",
                                             missing=missing)
                self._write(dest.write_tensor, 0, out)
                self.arena_bytes = len(keys) * dest.block_nbytes
                self._add_bytes(self.arena_bytes)
            if request.tail_handle is not None:
                client = self._fetcher.grpc.client(request.address)
                tail, num_tokens = client.take_tail(request.tail_handle,
                                                    timeout_s=self._remaining_s())
                if num_tokens != request.num_tail_tokens:
                    raise BlockLayoutError(f"tail {request.tail_handle!r} holds {num_tokens} "
                                           f"tokens, expected {request.num_tail_tokens}")
                self._write(dest.write_tensor, len(keys), tail.unsqueeze(0))
                self._add_bytes(dest.block_nbytes)
            self._succeed()
        except KVStoreError as exc:
            self._fail(exc)  # a no-op once aborted
        except Exception as exc:  # noqa: BLE001 — the write guard after an abort, or a bug
            self._fail(KVTransferError(f"{self._describe()}: {exc!r}", address=request.address))


def _pair_request(prefill: PrefillResult) -> FetchRequest:
    return FetchRequest(prefill.pair_address, prefill.block_keys, prefill.tail_handle,
                        prefill.num_tail_tokens, tag=prefill.pair_tag)


def _bytes_by_backend(receiver: KVReceiver, path: str) -> dict[str, int]:
    total = receiver.result()
    if isinstance(receiver, _ArenaReceiver):
        return {"arena": receiver.arena_bytes, "grpc": total - receiver.arena_bytes}
    return {path: total}


def _error_of(receiver: KVReceiver) -> KVStoreError:
    try:
        receiver.result()
    except KVStoreError as exc:
        return exc
    raise RuntimeError("receiver did not fail")
