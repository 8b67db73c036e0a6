"""Mooncake Transfer Engine backend (``--kv-transfer mooncake``): the decode side pulls a
request's KV out of memory the prefill side registered with its Transfer Engine (TE) into its
own registered memory: its paged cache, or a receive buffer it copies from. One-sided: the
prefill's CPU takes no part once the region is published.

Flow of one transfer::

    prefill: MooncakeConnector copies the prompt's blocks into a leased region of its
             registered staging buffer, region-major; RemoteRegion --(PrefillResult, Ray)-->
    decode:  MooncakeKVReceiver.start(FetchRequest(region=...), CacheDest) submits the reads:
             -> destination blocks in a few runs of consecutive blocks: straight into the
                cache, one read per cache region and run (the region holds each of the
                KV cache spec's regions contiguously, as the cache holds each in a tensor)
             -> scattered: the region into a registered receive buffer as one read; once
                TE reports it, one local copy per cache region, or one index copy of a
                block-major region's blocks
             MooncakeKVReceiver.poll asks TE whether the reads are done and settles (landing a
             staged read); then it writes the region's generation into its release word (a
             TE write): the prefill may reuse the region

Layout of a region, the layout of the source's cache (engine.kv_cache; a cluster's workers
share it):
- region-major, from a cache with a tensor per layer and region (engine.kv_cache_spec): for
  each cache region in the spec's order, its bytes of every block, ``num_blocks x nbytes``
  from ``num_blocks x offset``, so that each region of a request is one contiguous span, as
  each region's tensor of such a cache is; a run of consecutive destination blocks takes a
  read per region;
- block-major (``RemoteRegion.block_major``), from a cross-layer cache: [num_blocks,
  block_nbytes], the moved unit itself, as a cross-layer cache holds its blocks; a run of
  consecutive destination blocks is one span of the region and one read.
A destination whose cache is laid out otherwise than the region takes the staged path and
``dest.write_tensor``.

Why scattered blocks are staged: TE's TCP transport opens a connection per read, and a read
per block would cost far more than the local copy (benchmarks/RESULTS.md). The receive
buffers are registered once and reused (MooncakeSettings.receive_buffer_bytes).

Why no thread per read: TE's sync calls spin on a core until the read is done, beside TE's
own I/O threads, and a thread that settles the read must then win the GIL from the engine
loop. A read is submitted on the caller's thread and checked without blocking; only the first
read from a peer goes on a thread of its own, as TE's handshake with a silent peer blocks for a
minute.

Where the decode cache is not host memory this process can hand to TE (a CUDA cache with the
CPU build, or a tensor-parallel view that scatters heads over ranks), the region is pulled
whole into a receive buffer the same way and written with ``dest.write_tensor``.

Quarantine: TE cannot cancel a transfer in flight, so while a read is in flight the receiver
does not fail at its deadline or on abort: bytes may still land in the destination blocks. It
settles (SUCCESS, or FAILED with the timeout or the abort that came meanwhile) only once TE
reported the read done, failed or timed out, or TE's own timeout passed
(``MC_TRANSFER_TIMEOUT``, set from ``timeout_s``, plus a nanosecond per byte: where TE's sync
reads give up); the engine does not reuse the blocks before the fetch settled.

Layer streams (``--kv-streaming layer``) over TE read a region the prefill writes piece by
piece: kvstore.transport.mooncake.layer_stream, on this backend.

Leases: the prefill frees a region once the decode wrote its release word, or once its lease
ran out (``expires_at``, wall clock). A receiver starts only if its whole deadline ends before
the lease does (less ``LEASE_MARGIN_S`` for clock skew between nodes); otherwise it fails at
once and the fetch takes the store path.

Security: TE's data plane has no authentication: any peer that reaches its ports can read and
write every registered region. Its listeners (handshake and TCP transport) bind ``bind_host``
only, though TE itself binds every interface (kvstore.transport.mooncake.te_bind). Run it on a
trusted network; the Kubernetes NetworkPolicy limits its ports to the cluster's pods. What
crosses it is raw KV bytes, never pickles; the control messages (the RemoteRegion) travel on
the Ray plane.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdcluster.engine.kv_cache_spec import KVCacheSpec
from pdcluster.kvstore.config import KVStoreConfig, KVTransferConfig
from pdcluster.kvstore.errors import (BlockLayoutError, KVStoreError, KVTransferError,
                                      KVTransferTimeout)
from pdcluster.kvstore.transport.base import (FetchRequest, KVReceiver, KVTransferBackend,
                                             TransferState)
from pdcluster.kvstore.transport.dest import CacheDest, CallbackDest
from pdcluster.kvstore.transport.mooncake.settings import MooncakeSettings
from pdcluster.kvstore.transport.mooncake.te import (TE_MISSING, TE_NO_BATCH, new_transfer_engine,
                                                     register, te_timeout_s)

#: Seconds a region's lease must outlast a receiver's deadline: the two ends read different
#: clocks (the lease is wall-clock time on the prefill node).
LEASE_MARGIN_S = 2.0
#: A read straight into the cache takes one TE read per run of consecutive blocks (between
#: cross-layer caches) or per (layer, K|V) and run; past this many, the region is staged
#: instead (TE's TCP transport connects per read).
MAX_DIRECT_READS = 64


@dataclass(frozen=True)
class RemoteRegion:
    """A request's KV in a source's TE-registered memory, and how to hand it back.

    Attributes:
        session: the source TE's session name, ``host:rpc_port``.
        address: the region's first byte in the source process.
        num_blocks: request blocks in the region (full ones, then the tail).
        block_nbytes: bytes of one block (KVCacheSpec.block_nbytes).
        spans: (offset in a block, bytes per block) of each cache region, the spec's order.
        release_address: an int64 word in the source's registered memory; writing
            ``generation`` there frees the region.
        generation: this lease's number (a stale release of an earlier lease is ignored).
        expires_at: ``time.time()`` on the source when the lease ends, released or not.
        block_major: the region is [num_blocks, block_nbytes] (from a cross-layer cache),
            not region-major (see the module docstring).
    """

    session: str
    address: int
    num_blocks: int
    block_nbytes: int
    spans: tuple[tuple[int, int], ...]
    release_address: int
    generation: int
    expires_at: float
    block_major: bool = False

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_nbytes


def cache_spans(spec: KVCacheSpec) -> tuple[tuple[int, int], ...]:
    """(offset, bytes per block) of each region of ``spec``: RemoteRegion.spans."""
    return tuple((r.offset, r.nbytes) for r in spec.regions)


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
        self.settings = MooncakeSettings.of(config)
        if importlib.util.find_spec("mooncake") is None:
            raise KVTransferError(TE_MISSING)
        self._lock = threading.Lock()
        self._engine = None
        self._registered: dict[int, object] = {}  # id(cache) -> cache (kept alive)
        self._release_words: torch.Tensor | None = None
        self._free_words: list[int] = []  # release words no write is reading
        self._releases: list[tuple[int, int]] = []  # (TE batch, word) of writes under way
        self._open_sessions: set[str] = set()  # peers TE has handshaken with
        #: TE's own timeout (MC_TRANSFER_TIMEOUT as new_transfer_engine sets it), seconds
        self.te_timeout_s = float(te_timeout_s(config))
        self._probe_word = torch.zeros(1, dtype=torch.int64)  # where `probe` reads into
        self._abandoned: list[torch.Tensor] = []  # receive buffers TE may still write
        self._free_buffers: list[torch.Tensor] = []  # kept receive buffers, idle
        self._kept: set[int] = set()  # data_ptr of every kept receive buffer
        self._buffer_bytes = 0  # their bytes, idle or not

    def engine(self):
        """This backend's TE, initialized on first use. Raises KVTransferError."""
        with self._lock:
            if self._engine is None:
                self._engine = new_transfer_engine(self.config)
                self._release_words = torch.zeros(256, dtype=torch.int64)
                # written per transfer: through numpy and an address, not torch indexing
                self._release_values = self._release_words.numpy()
                self._release_base = self._release_words.data_ptr()
                self._free_words = list(range(len(self._release_words)))
                register(self._engine, [self._release_words, self._probe_word])
            return self._engine

    def te_deadline(self, nbytes: int) -> float:
        """When TE's own sync calls would give up on ``nbytes`` started now (time.monotonic()):
        its timeout plus a nanosecond per byte."""
        return time.monotonic() + self.te_timeout_s + nbytes * 1e-9

    def is_open(self, session: str) -> bool:
        """Whether a read from ``session`` went out before (TE keeps the handshake)."""
        with self._lock:
            return session in self._open_sessions

    def mark_open(self, session: str, is_open: bool) -> None:
        """Record whether ``session`` answers: after a failed read, the next read from it
        handshakes again, off the caller's thread (a restarted peer may be silent)."""
        with self._lock:
            if is_open:
                self._open_sessions.add(session)
            else:
                self._open_sessions.discard(session)

    def probe(self, region: RemoteRegion) -> bool:
        """Read ``region``'s release word (8 bytes, blocking): TE's handshake with its source,
        which blocks for as long as TE's handshake timeout on a peer that does not answer.
        True when the source answered."""
        engine = self.engine()
        return engine.transfer_sync_read(region.session, self._probe_word.data_ptr(),
                                         region.release_address, 8) == 0

    def abandon(self, buffer: torch.Tensor) -> None:
        """Keep ``buffer`` from ``take_buffer`` alive and registered but never reuse it: a
        read TE gave up on may still write into it."""
        with self._lock:
            self._abandoned.append(buffer)

    def direct_cache(self, dest: CallbackDest):
        """The host paged cache (engine.kv_cache.PagedKVCache: a tensor per region, or a
        cross-layer one's ``blocks``) ``dest`` lands in, registered with TE;
        None when the blocks must go through ``dest.write_tensor``."""
        cache = dest.cache if isinstance(dest, CacheDest) else None
        if cache is None or not hasattr(cache, "tensors") or cache.device.type != "cpu":
            return None
        engine = self.engine()
        with self._lock:
            if id(cache) not in self._registered:
                register(engine, [cache.blocks] if cache_blocks(cache) is not None
                         else cache.tensors)
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
            keep = self._buffer_bytes + size <= self.settings.receive_buffer_bytes
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
        """Tell the source it may reuse ``region``: a TE write of its generation into its
        release word, started and not waited for. Best effort: a source that does not hear it
        (gone, or every local release word busy) frees the region when the lease ends."""
        engine = self.engine()
        with self._lock:
            self._reap_releases(engine)
            if not self._free_words:
                return
            word = self._free_words.pop()
            self._release_values[word] = region.generation
        batch = engine.batch_transfer_async_write(
            region.session, [self._release_base + 8 * word], [region.release_address], [8])
        with self._lock:
            if batch in TE_NO_BATCH:  # a source that went away: its regions went with it
                self._free_words.append(word)
            else:
                self._releases.append((batch, word))

    def _reap_releases(self, engine) -> None:
        """Free the release words whose write TE reported (under the lock)."""
        pending = []
        for batch, word in self._releases:
            status = engine.transfer_check_status(batch)
            if status == 0:
                pending.append((batch, word))
            elif status != -2:  # a write TE timed out may still read its word: keep it
                self._free_words.append(word)
        self._releases = pending

    def create_receiver(self) -> MooncakeKVReceiver:
        return MooncakeKVReceiver(self)


class MooncakeKVReceiver(KVReceiver):
    """One pull of a RemoteRegion into its destination (see the module docstring). No thread
    of its own: ``start`` submits the reads and ``poll`` asks TE how they stand, so the time
    from a read landing to the fetch settling is the caller's poll interval."""

    def __init__(self, backend: MooncakeTransferBackend):
        super().__init__()
        self._backend = backend
        self._in_flight = False  # a TE read may be writing into the destination
        self._late: KVTransferError | None = None  # timeout or abort seen while in flight
        self._region: RemoteRegion | None = None
        self._dest: CallbackDest | None = None
        self._cache = None  # the registered host cache a staged read is copied into
        self._runs: list[tuple[int, int, int]] = []  # ... its runs of consecutive blocks
        self._index: torch.Tensor | None = None  # ... its block ids, where runs are many
        self._buffer: torch.Tensor | None = None  # the receive buffer of a staged read
        # ... its bytes, uint8 (a block-major region's as [num_blocks, block_nbytes])
        self._staged: torch.Tensor | None = None
        self._batches: list[int] | None = None  # unreported TE batches; None: none submitted
        self._refused: bool | Exception = False  # TE refused or failed a read (or raised)
        self._te_deadline = 0.0  # time.monotonic() when TE's own timeout passes
        self._connected = False  # the reads are being submitted or were

    def start(self, request: FetchRequest, dest: CallbackDest) -> None:
        """Raises BlockLayoutError when ``request.region`` does not match ``dest``."""
        region = request.region
        if not isinstance(region, RemoteRegion):
            raise BlockLayoutError("a mooncake fetch needs the source's RemoteRegion")
        if (region.num_blocks != dest.num_blocks or dest.block_shape != (region.block_nbytes,)
                or dest.dtype != torch.uint8):
            raise BlockLayoutError(
                f"region holds {region.num_blocks} blocks of {region.block_nbytes} bytes, the "
                f"destination {dest.num_blocks} x {dest.block_shape} {dest.wire_dtype}")
        self._dest = self._accept(request, dest, self._backend.config.timeout_s)
        self._region = region
        try:
            reads = self._plan(region, dest)
        except Exception as exc:  # noqa: BLE001 — a typed FAILED, as for a failed read
            self._fail(exc if isinstance(exc, KVStoreError) else
                       KVTransferError(f"{self._describe()}: {exc!r}", address=region.session))
            if self._backend.is_open(region.session):
                self._guarded(self._backend.release, region)  # it will not be read
            return
        connected = self._backend.is_open(region.session)
        with self._lock:
            self._in_flight, self._connected = True, connected
        if connected:
            self._submit(reads)
        else:
            # TE's first handshake with a peer blocks (a minute on a silent one): made by a
            # probe on a thread of its own; the reads follow unless the receiver gave up
            threading.Thread(target=self._connect, args=(reads,), daemon=True,
                             name="kv-mooncake-connect").start()

    def poll(self) -> TransferState:
        """As KVReceiver.poll, except that a read in flight neither times out nor aborts here:
        it settles when TE reports it (see Quarantine in the module docstring)."""
        with self._lock:
            if self._in_flight:
                now = time.monotonic()
                if self._late is None and self._deadline is not None and now > self._deadline:
                    self._late = KVTransferTimeout(f"{self._describe()} exceeded its deadline",
                                                   address=self._address())
                if self._batches is None:  # no read submitted yet
                    if self._late is None or self._connected:
                        return self._state
                    self._batches = []  # connecting: give up; `_connect` submits nothing
                elif not self._reported(now):
                    return self._state
                self._in_flight = False
            else:
                return super().poll()
        self._settle()
        return self._state

    def abort(self) -> None:
        """Stop the pull. While a TE read is in flight it returns at once and the receiver
        settles FAILED once TE reported the read (bytes may land until then: poll until done)."""
        with self._lock:
            if self._in_flight:
                if self._late is None:
                    self._late = KVTransferError(f"{self._describe()} aborted",
                                                 address=self._address())
                return
        super().abort()

    def _plan(self, region: RemoteRegion, dest: CallbackDest) -> list[tuple[int, int, int]]:
        """The reads, (destination address, source address, length): straight into the
        registered cache where that takes at most MAX_DIRECT_READS, else the region into a
        receive buffer as one read, landed (`_land`) once it settled. One read: the same
        bytes cut into concurrent reads moved slower over TE's TCP transport, at every size
        from 1 to 64 MiB (benchmarks/RESULTS.md)."""
        if time.time() + self._remaining_s() > region.expires_at - LEASE_MARGIN_S:
            raise KVTransferError(f"{self._describe()}: the source's lease ends before this "
                                  f"transfer's deadline", address=region.session)
        backend = self._backend
        cache = backend.direct_cache(dest)
        if cache is not None and ((cache_blocks(cache) is not None) != region.block_major
                                  or cache_spans(cache.spec) != region.spans):
            cache = None  # laid out otherwise than the region: through dest.write_tensor
        runs = _runs(dest.block_ids, cache.num_blocks) if cache is not None else []
        if region.block_major:
            return self._plan_block_major(region, dest, cache, runs)
        if runs and len(runs) * len(region.spans) <= MAX_DIRECT_READS:
            return list(zip(*_cache_pieces(region, cache, runs)))
        self._cache, self._runs = cache, runs
        if len(runs) > 4:
            self._index = torch.tensor(dest.block_ids, dtype=torch.int64)
        self._buffer = backend.take_buffer(region.nbytes)
        self._staged = self._buffer[:region.nbytes]
        return [(self._buffer.data_ptr(), region.address, region.nbytes)]

    def _plan_block_major(self, region: RemoteRegion, dest: CallbackDest, cache,
                          runs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """`_plan` of a block-major region: each run of consecutive destination blocks of a
        cross-layer cache is one span of the region, read straight into the cache as one read
        (cutting it into concurrent pieces measured no faster: benchmarks/RESULTS.md), where
        there are at most MAX_DIRECT_READS runs; otherwise the region goes into a receive
        buffer as one read, landed by one index copy (or, without a cache, written with
        ``dest.write_tensor``)."""
        block = region.block_nbytes
        if runs and len(runs) <= MAX_DIRECT_READS:
            base = cache_blocks(cache).data_ptr()
            return [(base + first * block, region.address + position * block, count * block)
                    for position, first, count in runs]
        self._cache = cache
        if cache is not None:
            self._index = torch.tensor(dest.block_ids, dtype=torch.int64)
        self._buffer = self._backend.take_buffer(region.nbytes)
        self._staged = self._buffer[:region.nbytes].view(region.num_blocks, region.block_nbytes)
        return [(self._buffer.data_ptr(), region.address, region.nbytes)]

    def _connect(self, reads: list[tuple[int, int, int]]) -> None:
        """The first read from a peer: TE's handshake, by an 8-byte probe of the region's
        release word, then the reads unless the receiver gave up meanwhile (its deadline or
        an abort: nothing is in flight, so it settles at once)."""
        region = self._region
        try:
            reached = self._backend.probe(region)
        except Exception:  # noqa: BLE001 — an unreachable peer, reported by the reads
            reached = False
        with self._lock:
            if self._batches is not None:  # gave up while connecting
                return
            if not reached:
                self._refused, self._batches = True, []
                return
            self._connected = True  # from here poll waits for the reads
        self._backend.mark_open(region.session, True)
        self._submit(reads)

    def _submit(self, reads: list[tuple[int, int, int]]) -> None:
        """Start each read as a TE batch of its own (TE reports a batch's first piece only
        without blocking)."""
        region = self._region
        batches: list[int] = []
        refused: bool | Exception = False
        try:
            engine = self._backend.engine()
            for dst, src, length in reads:
                batch = engine.batch_transfer_async_read(region.session, [dst], [src], [length])
                if batch in TE_NO_BATCH:
                    refused = True
                    break
                batches.append(batch)
        except Exception as exc:  # noqa: BLE001 — a library error is a failed read
            refused = exc
        with self._lock:
            self._refused = refused
            self._te_deadline = self._backend.te_deadline(region.nbytes)
            self._batches = batches

    def _reported(self, now: float) -> bool:
        """Whether TE reported every batch. Under the lock: a batch is checked until TE
        reports it, never after (TE frees it then)."""
        engine = self._backend.engine()
        pending = []
        for batch in self._batches:
            status = engine.transfer_check_status(batch)
            if status == 0:
                pending.append(batch)
            elif status < 0:  # failed (TE freed it) or timed out in TE
                self._refused = True
        self._batches = pending
        if pending and now > self._te_deadline:
            # TE's sync reads would have returned a failure here; its reads may still land
            # in the receive buffer, which is therefore never reused
            self._refused = True
            if self._buffer is not None:
                self._backend.abandon(self._buffer)
                self._buffer = self._staged = None
            return True
        return not pending

    def _settle(self) -> None:
        region, late = self._region, self._late
        try:
            if self._refused:
                self._backend.mark_open(region.session, False)
                cause = f": {self._refused!r}" if isinstance(self._refused, Exception) else ""
                self._fail(KVTransferError(f"{self._describe()}: Transfer Engine read failed "
                                           f"or timed out{cause}", address=region.session))
            elif late is not None:
                self._fail(late)
            elif self._buffer is None or self._guarded(self._write, self._land):
                self._add_bytes(region.nbytes)
                self._succeed()
        finally:
            if self._buffer is not None:
                self._backend.give_buffer(self._buffer)  # TE no longer writes into it
                self._buffer = self._staged = None
        # after settling: the request need not wait for the source to hear it; a peer never
        # reached is not written to (TE would handshake again, on this thread)
        if self._backend.is_open(region.session):
            self._guarded(self._backend.release, region)

    def _land(self) -> None:
        """The staged region into its destination. Into the registered cache: a block-major
        region's blocks by one index copy; a region-major region's spans by a copy per run of
        consecutive blocks, or one index copy each when there are many runs. Without a cache:
        ``dest.write_tensor`` of the whole region, as blocks."""
        cache, region, n = self._cache, self._region, self._region.num_blocks
        if region.block_major:
            if cache is None:
                self._dest.write_tensor(0, self._staged)
            else:
                cache.blocks.index_copy_(0, self._index, self._staged)
            return
        spans = [self._staged[n * offset:n * (offset + nbytes)].view(n, nbytes)
                 for offset, nbytes in region.spans]
        if cache is None:
            blocks = torch.zeros((n, region.block_nbytes), dtype=torch.uint8)
            for (offset, nbytes), source in zip(region.spans, spans):
                blocks[:, offset:offset + nbytes] = source
            self._dest.write_tensor(0, blocks)
            return
        for tensor, source in zip(cache.tensors, spans):
            target = _as_bytes(tensor)
            if self._index is not None:
                target.index_copy_(0, self._index, source)
                continue
            for position, block, count in self._runs:
                target[block:block + count].copy_(source[position:position + count])


def cache_blocks(cache) -> torch.Tensor | None:
    """A cross-layer cache's one tensor, uint8 [num_blocks, block_nbytes] (engine.kv_cache);
    None for a cache with a tensor per layer and region."""
    return getattr(cache, "blocks", None)


def _cache_pieces(region: RemoteRegion, cache, runs: Sequence[tuple[int, int, int]]
                  ) -> tuple[list[int], list[int], list[int]]:
    """(destination addresses, source addresses, lengths) of the region's pieces: for each
    cache region, one per run of consecutive destination blocks (`_runs`)."""
    dst, src, lengths = [], [], []
    for tensor, (offset, span) in zip(cache.tensors, region.spans):
        base = tensor.data_ptr()
        source = region.address + offset * region.num_blocks
        for position, block, count in runs:
            dst.append(base + block * span)
            src.append(source + position * span)
            lengths.append(count * span)
    return dst, src, lengths


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous [num_blocks, ...] cache tensor as uint8 [num_blocks, bytes per block]."""
    return tensor.view(tensor.shape[0], -1).view(torch.uint8)


def _runs(block_ids: Sequence[int], num_blocks: int) -> list[tuple[int, int, int]]:
    """(request position, first block id, count) of each run of consecutive block ids."""
    if block_ids and not (0 <= min(block_ids) and max(block_ids) < num_blocks):
        bad = next(b for b in block_ids if not 0 <= b < num_blocks)
        raise BlockLayoutError(f"block id {bad} outside the cache's {num_blocks}")
    starts = [position for position in range(len(block_ids))
              if position == 0 or block_ids[position] != block_ids[position - 1] + 1]
    ends = starts[1:] + [len(block_ids)]
    return [(first, block_ids[first], end - first) for first, end in zip(starts, ends)]
