"""Mooncake Transfer Engine backend (``--kv-transfer mooncake``): the decode side pulls a
request's KV out of memory the prefill side registered with its Transfer Engine (TE), straight
into the decode's own registered paged cache. One-sided: the prefill's CPU takes no part once
the region is published.

Flow of one transfer::

    prefill: MooncakeConnector copies the prompt's blocks into a leased region of its
             registered staging buffer, layer-major; RemoteRegion --(PrefillResult, Ray)-->
    decode:  MooncakeKVReceiver.start(FetchRequest(region=...), CacheDest)
             -> destination blocks consecutive: one TE batch read straight into the cache,
                one piece per (layer, K|V) (the region holds each (layer, K|V)
                contiguously, as the cache holds each layer's K or V)
             -> scattered: one TE read of the whole region into a registered receive
                buffer, then one local copy per (layer, K|V) into the blocks
             -> writes the region's generation into its release word (a TE write): the
                prefill may reuse the region

Layout of a region: [layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim], the wire
block layout with the block axis moved inside, so that each (layer, K|V) of a request is one
contiguous span, as each layer's K or V of a paged cache is ([num_blocks, block_size, kv_heads,
head_dim] per layer).

Why scattered blocks are staged: TE's TCP transport opens a connection per piece (and a
request's pieces are its (layer, K|V) spans times its runs of consecutive blocks), so a read
of one piece per block costs a connection per 64 KiB-ish piece, far more than the local copy
(benchmarks/RESULTS.md). The receive buffers are registered once and reused
(``KVTransferConfig.receive_buffer_bytes``).

Where the decode cache is not host memory this process can hand to TE (a CUDA cache with the
CPU build, or a tensor-parallel view that scatters heads over ranks), the region is pulled
whole into a receive buffer the same way and written with ``dest.write_tensor``.

Quarantine: TE cannot cancel a transfer in flight, so while a read is in flight the receiver
does not fail at its deadline or on abort: bytes may still land in the destination blocks. It
settles (SUCCESS, or FAILED with the timeout or the abort that came meanwhile) only once TE
reported the read done, failed or timed out; the engine does not reuse the blocks before the
fetch settled. TE's own timeout (``MC_TRANSFER_TIMEOUT``) is set from ``timeout_s``.

Leases: the prefill frees a region once the decode wrote its release word, or once its lease
ran out (``expires_at``, wall clock). A receiver starts only if its whole deadline ends before
the lease does (less ``LEASE_MARGIN_S`` for clock skew between nodes); otherwise it fails at
once and the fetch takes the store path.

Security: TE's data plane has no authentication: any peer that reaches its ports can read and
write every registered region. Its listeners (handshake and TCP transport) bind ``bind_host``
only, though TE itself binds every interface (kvstore.transfer.te_bind). Run it on a trusted
network; the Kubernetes NetworkPolicy limits its ports to the cluster's pods. What crosses it
is raw KV bytes, never pickles; the control messages (the RemoteRegion) travel on the Ray
plane.
"""

from __future__ import annotations

import importlib.util
import math
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.config import KVStoreConfig, KVTransferConfig
from kvstore.errors import BlockLayoutError, KVTransferError, KVTransferTimeout
from kvstore.layout import DTYPE_ITEMSIZE
from kvstore.transfer.base import FetchRequest, KVReceiver, KVTransferBackend, TransferState
from kvstore.transfer.dest import CacheDest, CallbackDest
from kvstore.transfer.te_bind import confine_listeners

#: Seconds a region's lease must outlast a receiver's deadline: the two ends read different
#: clocks (the lease is wall-clock time on the prefill node).
LEASE_MARGIN_S = 2.0
#: TE's own floor for MC_TRANSFER_TIMEOUT (it ignores less).
_TE_MIN_TIMEOUT_S = 5
_MISSING = ("--kv-transfer mooncake needs Mooncake's Transfer Engine: pip install "
            "'pdcluster[mooncake]' (or [mooncake-cuda]), and the OS package libibverbs1")


@dataclass(frozen=True)
class RemoteRegion:
    """A request's KV in a source's TE-registered memory, and how to hand it back.

    Attributes:
        session: the source TE's session name, ``host:rpc_port``.
        address: the region's first byte in the source process.
        num_blocks: request blocks in the region (full ones, then the tail).
        block_shape: one block in the wire layout, (layers, 2, block_size, kv_heads, head_dim).
        dtype: wire dtype name (``float32`` | ``bfloat16`` | ``float16``).
        release_address: an int64 word in the source's registered memory; writing
            ``generation`` there frees the region.
        generation: this lease's number (a stale release of an earlier lease is ignored).
        expires_at: ``time.time()`` on the source when the lease ends, released or not.
    """

    session: str
    address: int
    num_blocks: int
    block_shape: tuple[int, ...]
    dtype: str
    release_address: int
    generation: int
    expires_at: float

    @property
    def span_nbytes(self) -> int:
        """Bytes of one block of one (layer, K|V): block_size * kv_heads * head_dim * itemsize."""
        return math.prod(self.block_shape[2:]) * DTYPE_ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.num_blocks * math.prod(self.block_shape) * DTYPE_ITEMSIZE[self.dtype]


def new_transfer_engine(config: KVTransferConfig):
    """An initialized TE on ``config.bind_host`` with P2P handshakes (no metadata server), over
    ``config.mooncake_protocol``; its listeners bind ``config.bind_host`` only
    (kvstore.transfer.te_bind) and its transfers time out after ``config.timeout_s``.

    Raises:
        KVTransferError: the ``mooncake`` package is missing (``pdcluster[mooncake]``), the
            listeners cannot be confined, or TE failed to initialize.
    """
    # TE logs through glog at MC_LOG_LEVEL (INFO by default: a line per segment it opens)
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:  # the optional extra
        raise KVTransferError(_MISSING) from exc
    confine_listeners(config.bind_host)
    # read by TransferEngine's constructor: its sync calls give up after this long
    os.environ["MC_TRANSFER_TIMEOUT"] = str(max(_TE_MIN_TIMEOUT_S, math.ceil(config.timeout_s)))
    engine = TransferEngine()
    host = advertised_host(config.bind_host)
    if engine.initialize(host, "P2PHANDSHAKE", config.mooncake_protocol, "") != 0:
        raise KVTransferError(f"Mooncake TransferEngine failed to initialize on {host} over "
                              f"{config.mooncake_protocol}")
    return engine


def advertised_host(bind_host: str) -> str:
    """The address peers reach a TE bound to ``bind_host`` at: itself, or for a wildcard
    (0.0.0.0, ::: every interface, as across nodes) this node's Ray IP, as a KV store does."""
    if bind_host not in ("0.0.0.0", "::", ""):
        return bind_host
    import ray.util

    return ray.util.get_node_ip_address()


def session_of(engine, bind_host: str) -> str:
    """The TE session name peers use to reach ``engine``: ``host:rpc_port``."""
    return f"{advertised_host(bind_host)}:{engine.get_rpc_port()}"


def register(engine, tensors: Sequence[torch.Tensor]) -> None:
    """Register each contiguous tensor's memory with ``engine``. Raises KVTransferError."""
    for tensor in tensors:
        if engine.register_memory(tensor.data_ptr(), tensor.numel() * tensor.element_size()):
            raise KVTransferError("Mooncake register_memory failed")


class MooncakeTransferBackend(KVTransferBackend):
    """The pulling side: one TE per worker; each paged cache it writes into registered once.

    A cache is registered on its first transfer (a decode's cache never moves, so its
    registration lasts as long as the backend). Release words are written from a small
    registered array, one slot per transfer in flight.
    """

    name = "mooncake"

    def __init__(self, config: KVTransferConfig, kv_config: KVStoreConfig | None = None):
        """Raises KVTransferError when the ``mooncake`` package is missing (a worker then
        fails at start, not at its first transfer)."""
        super().__init__(config, kv_config)
        if importlib.util.find_spec("mooncake") is None:
            raise KVTransferError(_MISSING)
        self._lock = threading.Lock()
        self._engine = None
        self._registered: dict[int, object] = {}  # id(cache) -> cache (kept alive)
        self._release_words: torch.Tensor | None = None
        self._next_word = 0
        self._free_buffers: list[torch.Tensor] = []  # kept receive buffers, idle
        self._kept: set[int] = set()  # data_ptr of every kept receive buffer
        self._buffer_bytes = 0  # their bytes, idle or not

    def engine(self):
        """This backend's TE, initialized on first use. Raises KVTransferError."""
        with self._lock:
            if self._engine is None:
                self._engine = new_transfer_engine(self.config)
                self._release_words = torch.zeros(256, dtype=torch.int64)
                register(self._engine, [self._release_words])
            return self._engine

    def direct_cache(self, dest: CallbackDest):
        """The host paged cache (per-layer ``k`` / ``v`` tensors) ``dest`` lands in, registered
        with TE; None when the blocks must go through ``dest.write_tensor``."""
        cache = dest.cache if isinstance(dest, CacheDest) else None
        if cache is None or not hasattr(cache, "k") or cache.device.type != "cpu":
            return None
        engine = self.engine()
        with self._lock:
            if id(cache) not in self._registered:
                register(engine, [*cache.k, *cache.v])
                self._registered[id(cache)] = cache
        return cache

    def take_buffer(self, nbytes: int) -> torch.Tensor:
        """A registered host buffer (uint8, at least ``nbytes``) for one staged read: an idle
        one, a new one kept while the kept ones total at most ``receive_buffer_bytes``, else
        one for this read alone. Give it back with ``give_buffer`` once the read settled.
        Raises KVTransferError."""
        engine = self.engine()
        with self._lock:
            fits = [i for i, b in enumerate(self._free_buffers) if b.numel() >= nbytes]
            if fits:  # the smallest that fits (by position: tensors compare elementwise)
                return self._free_buffers.pop(
                    min(fits, key=lambda i: self._free_buffers[i].numel()))
            size = max(1 << 20, 1 << (nbytes - 1).bit_length())  # a power of two: reusable
            keep = self._buffer_bytes + size <= self.config.receive_buffer_bytes
            if keep:
                self._buffer_bytes += size
        buffer = torch.empty(size if keep else nbytes, dtype=torch.uint8)
        try:
            register(engine, [buffer])
        except KVTransferError:
            if keep:
                with self._lock:
                    self._buffer_bytes -= size
            raise
        if keep:
            with self._lock:
                self._kept.add(buffer.data_ptr())
        return buffer

    def give_buffer(self, buffer: torch.Tensor) -> None:
        """Return a buffer from ``take_buffer`` (after its read settled: TE no longer writes
        into it)."""
        with self._lock:
            if buffer.data_ptr() in self._kept:
                self._free_buffers.append(buffer)
                return
        self.engine().unregister_memory(buffer.data_ptr())

    def release(self, region: RemoteRegion) -> None:
        """Tell the source it may reuse ``region`` (a TE write of its generation into its
        release word). Best effort: a source that does not hear it frees the region when the
        lease ends."""
        engine = self.engine()
        with self._lock:
            slot = self._next_word % len(self._release_words)
            self._next_word += 1
            self._release_words[slot] = region.generation
        # a non-zero status is a source that went away: its regions went with it
        engine.transfer_sync_write(region.session, self._release_words[slot:].data_ptr(),
                                   region.release_address, 8)

    def create_receiver(self) -> MooncakeKVReceiver:
        return MooncakeKVReceiver(self)


class MooncakeKVReceiver(KVReceiver):
    """One pull of a RemoteRegion into its destination (see the module docstring)."""

    def __init__(self, backend: MooncakeTransferBackend):
        super().__init__()
        self._backend = backend
        self._in_flight = False  # a TE read may be writing into the destination
        self._late: KVTransferError | None = None  # timeout or abort seen while in flight

    def start(self, request: FetchRequest, dest: CallbackDest) -> None:
        """Raises BlockLayoutError when ``request.region`` does not match ``dest``."""
        region = request.region
        if not isinstance(region, RemoteRegion):
            raise BlockLayoutError("a mooncake fetch needs the source's RemoteRegion")
        if (region.num_blocks != dest.num_blocks or tuple(region.block_shape) != dest.block_shape
                or region.dtype != dest.wire_dtype):
            raise BlockLayoutError(
                f"region holds {region.num_blocks} x {region.block_shape} {region.dtype}, the "
                f"destination {dest.num_blocks} x {dest.block_shape} {dest.wire_dtype}")
        dest = self._accept(request, dest, self._backend.config.timeout_s)
        with self._lock:
            self._in_flight = True
        threading.Thread(target=self._run, args=(region, dest), daemon=True,
                         name="kv-mooncake-read").start()

    def poll(self) -> TransferState:
        """As KVReceiver.poll, except that a read in flight neither times out nor aborts here:
        it settles when TE returns (see Quarantine in the module docstring)."""
        with self._lock:
            if self._in_flight:
                if self._late is None and self._deadline is not None \
                        and time.monotonic() > self._deadline:
                    self._late = KVTransferTimeout(f"{self._describe()} exceeded its deadline",
                                                   address=self._address())
                return self._state
        return super().poll()

    def abort(self) -> None:
        """Stop the pull. While a TE read is in flight it returns at once and the receiver
        settles FAILED when the read returns (bytes may land until then: poll until done)."""
        with self._lock:
            if self._in_flight:
                if self._late is None:
                    self._late = KVTransferError(f"{self._describe()} aborted",
                                                 address=self._address())
                return
        super().abort()

    def _run(self, region: RemoteRegion, dest: CallbackDest) -> None:
        try:
            ok = self._guarded(self._pull, region, dest)
        finally:
            with self._lock:
                self._in_flight = False
                late = self._late
        if ok and late is not None:
            self._fail(late)
        elif ok:
            self._succeed()
        # after settling: the request need not wait for the source to hear it
        self._guarded(self._backend.release, region)

    def _pull(self, region: RemoteRegion, dest: CallbackDest) -> None:
        if time.time() + self._remaining_s() > region.expires_at - LEASE_MARGIN_S:
            raise KVTransferError(f"{self._describe()}: the source's lease ends before this "
                                  f"transfer's deadline", address=region.session)
        backend = self._backend
        engine = backend.engine()
        cache = backend.direct_cache(dest)
        runs = _runs(dest.block_ids, cache.num_blocks) if cache is not None else []
        if len(runs) == 1:
            self._read(engine, region, *_cache_pieces(region, cache, runs))
        else:
            self._read_staged(engine, region, dest, cache)
        self._add_bytes(region.nbytes)

    def _read(self, engine, region: RemoteRegion, dst: list[int], src: list[int],
              lengths: list[int]) -> None:
        if engine.batch_transfer_sync_read(region.session, dst, src, lengths) != 0:
            raise KVTransferError(f"{self._describe()}: Transfer Engine read failed or timed "
                                  f"out", address=region.session)

    def _read_staged(self, engine, region: RemoteRegion, dest: CallbackDest, cache) -> None:
        """The whole region in one read into a receive buffer, then into the destination:
        one copy per (layer, K|V) into ``cache``'s blocks, or ``dest.write_tensor``."""
        backend = self._backend
        buffer = backend.take_buffer(region.nbytes)
        try:
            self._read(engine, region, [buffer.data_ptr()], [region.address], [region.nbytes])
            layers, kv, *block = region.block_shape
            staged = buffer[:region.nbytes].view(dest.dtype).view(
                layers, kv, region.num_blocks, *block)
            if cache is not None:
                index = torch.tensor(dest.block_ids, dtype=torch.int64)
                for layer in range(layers):
                    for which, tensors in enumerate((cache.k, cache.v)):
                        tensors[layer].index_copy_(0, index, staged[layer, which])
            else:
                self._write(dest.write_tensor, 0,
                            staged.permute(2, 0, 1, *range(3, staged.dim())))
        finally:
            # after the read settled and the copies ended: TE no longer writes into it
            backend.give_buffer(buffer)


def _cache_pieces(region: RemoteRegion, cache, runs: Sequence[tuple[int, int, int]]
                  ) -> tuple[list[int], list[int], list[int]]:
    """(destination addresses, source addresses, lengths) of the region's pieces: for each
    (layer, K|V), one per run of consecutive destination blocks (`_runs`)."""
    span = region.span_nbytes
    dst, src, lengths = [], [], []
    for layer in range(region.block_shape[0]):
        for which, tensors in enumerate((cache.k, cache.v)):
            base = tensors[layer].data_ptr()
            source = region.address + (layer * 2 + which) * region.num_blocks * span
            for position, block, count in runs:
                dst.append(base + block * span)
                src.append(source + position * span)
                lengths.append(count * span)
    return dst, src, lengths


def _runs(block_ids: Sequence[int], num_blocks: int) -> list[tuple[int, int, int]]:
    """(request position, first block id, count) of each run of consecutive block ids."""
    runs: list[tuple[int, int, int]] = []
    for position, block in enumerate(block_ids):
        if not 0 <= block < num_blocks:
            raise BlockLayoutError(f"block id {block} outside the cache's {num_blocks}")
        if runs and runs[-1][1] + runs[-1][2] == block:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((position, block, 1))
    return runs
