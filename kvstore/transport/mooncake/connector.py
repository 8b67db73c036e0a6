"""The Mooncake source connector (``--kv-transfer mooncake``): a prefill worker offers each
request's KV to its decode over Mooncake's Transfer Engine, beside the copy the pool connector
saves to the KV store (the decode's fallback, and the prefix cache).

The worker registers one host staging buffer with TE once. When a request finishes, its blocks
are copied into a leased region of that buffer, laid out as the cache holds them: layer-major
from a cache with a tensor per layer, block-major (one gather) from a cross-layer cache
(kvstore.transport.mooncake.backend), and
the region goes to the decode in PrefillResult.kv_region; the decode reads it over TE and
writes the lease's generation into the region's release word. A region is reused once
released or once its lease (the KV plane's tail TTL, as for tail blocks) ran out; the engine's
own blocks are free as soon as the request finished, as with every other connector.

The buffer, its leases and the worker's TE are a RegionSource, which layer streams over TE
(kvstore.transport.layer_stream.connector) share: a stream leases one region for all its pieces and
writes them into it as the layers end (RegionStreamSender).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdcluster.engine.core.kv_connector import BlockCache, KVConnector, KVConnectorRequest
from pdcluster.kvstore.config import KVTransferConfig
from pdcluster.kvstore.transport.context import KVConnectorContext
from pdcluster.kvstore.errors import KVTransferError
from pdcluster.kvstore.transport.layer_stream.stream import LayerStreamSender
from pdcluster.kvstore.transport.mooncake.backend import RemoteRegion, cache_blocks, cache_spans
from pdcluster.kvstore.transport.mooncake.layer_stream import StreamRegion
from pdcluster.kvstore.transport.mooncake.settings import MooncakeSettings
from pdcluster.kvstore.transport.mooncake.te import new_transfer_engine, register, session_of

log = logging.getLogger(__name__)

#: Regions start on this byte boundary (a cache line).
ALIGN = 64
#: Leases that may be out at once (one release word each).
MAX_LEASES = 4096


class RegionAllocator:
    """First-fit allocation of byte ranges of a buffer of ``capacity`` bytes; freed ranges merge
    with their free neighbours. Offsets and sizes are ALIGN-aligned."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity - capacity % ALIGN
        self._free: list[tuple[int, int]] = [(0, self.capacity)] if self.capacity else []

    def allocate(self, nbytes: int) -> int | None:
        """The offset of ``nbytes`` free bytes, or None when no free range is that large."""
        size = -(-nbytes // ALIGN) * ALIGN
        for i, (offset, length) in enumerate(self._free):
            if length >= size:
                if length == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, length - size)
                return offset
        return None

    def free(self, offset: int, nbytes: int) -> None:
        size = -(-nbytes // ALIGN) * ALIGN
        i = bisect.bisect(self._free, (offset, 0))
        if i < len(self._free) and offset + size == self._free[i][0]:
            size += self._free.pop(i)[1]
        if i and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            offset, size = self._free[i - 1][0], self._free[i - 1][1] + size
            i -= 1
            del self._free[i]
        self._free.insert(i, (offset, size))

    @property
    def free_bytes(self) -> int:
        return sum(length for _, length in self._free)


@dataclass
class _Lease:
    offset: int
    nbytes: int
    generation: int
    expires_at: float
    pinned: bool = False  # its writer may still write: not freed, released or not


@dataclass(frozen=True)
class Lease:
    """A leased region of a RegionSource's buffer: ``view`` its bytes (uint8), ``word`` its
    release (and progress) word, ``generation`` what its reader writes there to free it."""

    view: torch.Tensor
    address: int
    word: int
    generation: int
    expires_at: float


class RegionSource:
    """One prefill worker's TE-registered staging buffer, whose regions are leased to decodes
    that read them (kvstore.transport.mooncake.backend): by the Mooncake connector (whole
    requests) and by layer streams over TE (one region per stream, written piece by piece).
    Built once per worker (``of``); thread-safe.

    Each lease has a release word (its reader writes the lease's generation there to free it)
    and a progress word (a layer stream's writer counts the pieces written there).

    Args:
        transfer: bind_host, and its MooncakeSettings (protocol, source_buffer_bytes).
        lease_s: how long a region waits for its reader before it is reused.

    Attributes:
        regions_offered_total / regions_released_total / regions_expired_total: leases given
            out, handed back by their reader, and reclaimed at their end unreleased.
    """

    def __init__(self, transfer: KVTransferConfig, lease_s: float) -> None:
        self.transfer, self.lease_s = transfer, lease_s
        self._lock = threading.Lock()
        self._engine = None
        self.session = ""
        self._buffer: torch.Tensor | None = None
        self._allocator = RegionAllocator(MooncakeSettings.of(transfer).source_buffer_bytes)
        self._release_words = torch.zeros(MAX_LEASES, dtype=torch.int64)
        self._progress_words = torch.zeros(MAX_LEASES, dtype=torch.int64)
        self._free_words = list(range(MAX_LEASES - 1, -1, -1))
        self._leases: dict[int, _Lease] = {}  # release word -> lease
        self._generations = itertools.count(1)
        self.regions_offered_total = self.regions_released_total = 0
        self.regions_expired_total = 0

    @classmethod
    def of(cls, ctx: KVConnectorContext) -> RegionSource:
        """The worker's region source, built by the first connector that asks."""
        if ctx.te_regions is None:
            ctx.te_regions = cls(ctx.transfer, ctx.kv_config.tail_ttl_s)
        return ctx.te_regions

    def start(self) -> None:
        """Start TE and register the buffer and the words with it (once; later calls return).

        Raises KVTransferError when TE is missing or fails to start."""
        with self._lock:
            if self._engine is not None:
                return
            engine = new_transfer_engine(self.transfer)
            self._buffer = torch.empty(self._allocator.capacity, dtype=torch.uint8)
            register(engine, [self._buffer, self._release_words, self._progress_words])
            self.session = session_of(engine, self.transfer.bind_host)
            self._engine = engine

    def lease(self, nbytes: int, pinned: bool = False) -> Lease | None:
        """A region of ``nbytes``, its progress word zeroed; None when the buffer or the words
        are all taken. A ``pinned`` one is not freed, whatever its reader says or however
        late, until ``unpin``: its writer may still be writing."""
        self.reclaim()
        with self._lock:
            offset = self._allocator.allocate(nbytes)
            if offset is None or not self._free_words:
                if offset is not None:
                    self._allocator.free(offset, nbytes)
                return None
            word = self._free_words.pop()
            lease = self._leases[word] = _Lease(offset, nbytes, next(self._generations),
                                                time.time() + self.lease_s, pinned)
            self._progress_words[word] = 0
            self.regions_offered_total += 1
        return Lease(self._buffer[offset:offset + nbytes], self._buffer.data_ptr() + offset,
                     word, lease.generation, lease.expires_at)

    def release_address(self, word: int) -> int:
        return self._release_words[word:].data_ptr()

    def stream_region(self, lease: Lease, offsets: Sequence[int]) -> StreamRegion:
        """What a decode needs to read a layer stream written into ``lease``."""
        return StreamRegion(self.session, lease.address, tuple(offsets),
                            self.progress_address(lease.word), self.release_address(lease.word),
                            lease.generation, lease.expires_at)

    def progress_address(self, word: int) -> int:
        return self._progress_words[word:].data_ptr()

    def unpin(self, lease: Lease) -> None:
        with self._lock:
            if lease.word in self._leases:
                self._leases[lease.word].pinned = False
        self.reclaim()

    def drop(self, lease: Lease) -> None:
        """Free ``lease`` now (nobody will read it), as its reader's release would."""
        self._release_words[lease.word] = lease.generation
        self.reclaim()

    def set_progress(self, word: int, value: int) -> None:
        """Publish ``value`` in the lease's progress word (after the bytes it announces)."""
        self._progress_words[word] = value

    def reclaim(self) -> None:
        """Free the regions whose reader released them or whose lease ended."""
        with self._lock:
            if not self._leases:
                return
            now = time.time()
            words = list(self._leases)
            for word, value in zip(words, self._release_words[words].tolist()):
                lease = self._leases[word]
                released = value == lease.generation
                if (released or now > lease.expires_at) and not lease.pinned:
                    del self._leases[word]
                    self._allocator.free(lease.offset, lease.nbytes)
                    self._free_words.append(word)
                    if released:
                        self.regions_released_total += 1
                    else:
                        self.regions_expired_total += 1

    @property
    def num_leased(self) -> int:
        with self._lock:
            return len(self._leases)

    def close(self) -> None:
        self._engine = None  # TE's destructor closes its sessions and listeners


class MooncakeConnector(KVConnector):
    """Prefill side of ``--kv-transfer mooncake`` (see the module docstring). A request with
    max_tokens 1 (the decode finishes it at admission, fetching nothing) or streamed layer by
    layer (its KV went already) is not offered.

    Args:
        transfer: bind_host, timeout_s, and its MooncakeSettings (protocol,
            source_buffer_bytes).
        lease_s: how long a region waits for its decode's read before it is reused.
        regions: the worker's RegionSource (shared with layer streams); None: one of its own.

    Attributes:
        buffer_full_total: requests not offered because the buffer had no room.
    """

    def __init__(self, transfer: KVTransferConfig, lease_s: float,
                 regions: RegionSource | None = None) -> None:
        self.regions = regions if regions is not None else RegionSource(transfer, lease_s)
        self.buffer_full_total = 0

    @classmethod
    def from_context(cls, ctx: KVConnectorContext) -> MooncakeConnector:
        return cls(ctx.transfer, ctx.kv_config.tail_ttl_s, RegionSource.of(ctx))

    def register_kv_caches(self, cache: BlockCache) -> None:
        """Starts TE and registers the staging buffer and the release words with it.

        Raises KVTransferError when TE is missing or fails to start."""
        super().register_kv_caches(cache)
        self.regions.start()

    @property
    def session(self) -> str:
        """This worker's TE session name (``host:rpc_port``)."""
        return self.regions.session

    def request_finished(self, request: KVConnectorRequest, block_ids: Sequence[int]
                         ) -> tuple[bool, dict]:
        """Copies every block of the prompt (full ones, then the tail) into a leased region;
        params ``kv_region`` (a RemoteRegion), or none when the request is not offered."""
        if request.max_tokens == 1 or request.runs_alone or not block_ids:
            return False, {}
        cache = self.cache
        n = len(block_ids)
        lease = self.regions.lease(n * cache.block_nbytes)
        if lease is None:
            self.buffer_full_total += 1
            log.warning("the Mooncake staging buffer is full; %s's decode reads the KV store",
                        request.request_id, extra={"request_id": request.request_id})
            return False, {}
        blocks = cache_blocks(cache)
        if blocks is not None:  # cross-layer: the region in the cache's own layout
            torch.index_select(blocks, 0, cache.index_of(block_ids),
                               out=lease.view[:n * cache.block_nbytes].view(n, cache.block_nbytes))
        else:  # region-major: each cache region's bytes of every block, contiguous
            data = cache.read_blocks(block_ids)
            for offset, nbytes in cache_spans(cache.spec):
                lease.view[n * offset:n * (offset + nbytes)].view(n, nbytes).copy_(
                    data[:, offset:offset + nbytes])
        return False, {"kv_region": RemoteRegion(
            self.regions.session, lease.address, n, cache.block_nbytes, cache_spans(cache.spec),
            self.regions.release_address(lease.word), lease.generation, lease.expires_at,
            block_major=blocks is not None)}

    def get_finished(self) -> tuple[dict, dict]:
        self.regions.reclaim()
        return {}, {}

    def stats(self) -> dict:
        regions = self.regions
        return {"kv_mooncake_session": regions.session,
                "kv_mooncake_regions_offered_total": regions.regions_offered_total,
                "kv_mooncake_regions_released_total": regions.regions_released_total,
                "kv_mooncake_regions_expired_total": regions.regions_expired_total,
                "kv_mooncake_buffer_full_total": self.buffer_full_total,
                "kv_mooncake_regions_leased": regions.num_leased}

    def close(self) -> None:
        self.regions.close()



class RegionStreamSender(LayerStreamSender):
    """A layer stream's pieces written into a leased region of the worker's RegionSource
    (``--kv-streaming layer`` with ``--kv-transfer mooncake``) instead of onto the store, in
    order, from the sender's thread; after each, the lease's progress word counts the pieces
    written. The decode reads them over TE
    (kvstore.transport.mooncake.layer_stream.MooncakeLayerStreamReceiver).

    The region is pinned (RegionSource.lease) until the sender's thread ends, so a decode that
    gives up early cannot free it under the writes; a cancelled stream's region then stays
    leased until the decode releases it or the lease ends: a read of it may be under way.
    """

    def __init__(self, regions: RegionSource, lease: Lease, announce) -> None:
        self.regions, self.lease = regions, lease
        self._offsets = announce.region.offsets
        self._written = 0
        super().__init__(None, announce)

    def _deliver(self, index: int, piece: torch.Tensor) -> None:
        start, end = self._offsets[index], self._offsets[index + 1]
        data = piece.reshape(-1).view(torch.uint8)
        if index != self._written or data.numel() != end - start:
            raise KVTransferError(
                f"layer stream of {self.announce.request_id}: piece {index} of "
                f"{data.numel()} bytes, expected piece {self._written} of {end - start}")
        self.lease.view[start:end].copy_(data)
        self._written = index + 1
        self.regions.set_progress(self.lease.word, self._written)  # after the bytes

    def _stopped(self) -> None:
        self.regions.unpin(self.lease)

    def _drop(self) -> None:
        """Nothing to drop: the region goes back once released or at its lease's end."""
