"""The Mooncake source connector (``--kv-transfer mooncake``): a prefill worker offers each
request's KV to its decode over Mooncake's Transfer Engine, beside the copy the pool connector
saves to the KV store (the decode's fallback, and the prefix cache).

The worker registers one host staging buffer with TE once. When a request finishes, its blocks
are copied into a leased region of that buffer, layer-major (kvstore.transfer.mooncake), and
the region goes to the decode in PrefillResult.kv_region; the decode reads it with one TE batch
and writes the lease's generation into the region's release word. A region is reused once
released or once its lease (the KV plane's tail TTL, as for tail blocks) ran out; the engine's
own blocks are free as soon as the request finished, as with every other connector.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.config import KVTransferConfig
from kvstore.connector.base import BlockCache, KVConnector, KVConnectorContext, KVConnectorRequest
from kvstore.transfer.dest import WIRE_DTYPES
from kvstore.transfer.mooncake import RemoteRegion, new_transfer_engine, register, session_of

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


class MooncakeConnector(KVConnector):
    """Prefill side of ``--kv-transfer mooncake`` (see the module docstring). A request with
    max_tokens 1 (the decode finishes it at admission, fetching nothing) or streamed layer by
    layer (its KV went already) is not offered.

    Args:
        transfer: bind_host and mooncake_protocol (TE), source_buffer_bytes, timeout_s.
        lease_s: how long a region waits for its decode's read before it is reused.

    Attributes:
        regions_offered_total / regions_released_total / regions_expired_total: leases given
            out, handed back by their decode, and reclaimed at their end unreleased.
        buffer_full_total: requests not offered because the buffer had no room.
    """

    def __init__(self, transfer: KVTransferConfig, lease_s: float) -> None:
        self.transfer, self.lease_s = transfer, lease_s
        self._engine = None
        self._session = ""
        self._buffer: torch.Tensor | None = None
        self._allocator = RegionAllocator(transfer.source_buffer_bytes)
        self._release_words = torch.zeros(MAX_LEASES, dtype=torch.int64)
        self._free_words = list(range(MAX_LEASES - 1, -1, -1))
        self._leases: dict[int, _Lease] = {}  # release word -> lease
        self._generations = itertools.count(1)
        self.regions_offered_total = self.regions_released_total = 0
        self.regions_expired_total = self.buffer_full_total = 0

    @classmethod
    def from_context(cls, ctx: KVConnectorContext) -> MooncakeConnector:
        return cls(ctx.transfer, ctx.kv_config.tail_ttl_s)

    def register_kv_caches(self, cache: BlockCache) -> None:
        """Starts TE and registers the staging buffer and the release words with it.

        Raises KVTransferError when TE is missing or fails to start."""
        super().register_kv_caches(cache)
        self._engine = new_transfer_engine(self.transfer)
        self._session = session_of(self._engine, self.transfer.bind_host)
        self._buffer = torch.empty(self._allocator.capacity, dtype=torch.uint8)
        register(self._engine, [self._buffer, self._release_words])

    @property
    def session(self) -> str:
        """This worker's TE session name (``host:rpc_port``)."""
        return self._session

    def request_finished(self, request: KVConnectorRequest, block_ids: Sequence[int]
                         ) -> tuple[bool, dict]:
        """Copies every block of the prompt (full ones, then the tail) into a leased region;
        params ``kv_region`` (a RemoteRegion), or none when the request is not offered."""
        if request.request.sampling.max_tokens == 1 or request.runs_alone or not block_ids:
            return False, {}
        cache = self.cache
        layers, kv, *block = cache.block_shape
        nbytes = len(block_ids) * math.prod(cache.block_shape) * cache.dtype.itemsize
        self._reclaim()
        offset = self._allocator.allocate(nbytes)
        if offset is None or not self._free_words:
            if offset is not None:
                self._allocator.free(offset, nbytes)
            self.buffer_full_total += 1
            log.warning("the Mooncake staging buffer is full; %s's decode reads the KV store",
                        request.request_id, extra={"request_id": request.request_id})
            return False, {}
        region = self._buffer[offset:offset + nbytes].view(cache.dtype).view(
            layers, kv, len(block_ids), *block)
        region.copy_(cache.read_blocks(block_ids).permute(1, 2, 0, *range(3, 3 + len(block))))
        word = self._free_words.pop()
        lease = self._leases[word] = _Lease(offset, nbytes, next(self._generations),
                                            time.time() + self.lease_s)
        self.regions_offered_total += 1
        return False, {"kv_region": RemoteRegion(
            self._session, self._buffer.data_ptr() + offset, len(block_ids),
            tuple(cache.block_shape), WIRE_DTYPES[cache.dtype],
            self._release_words[word:].data_ptr(), lease.generation, lease.expires_at)}

    def get_finished(self) -> tuple[dict, dict]:
        self._reclaim()
        return {}, {}

    def _reclaim(self) -> None:
        """Free the regions whose decode released them or whose lease ended."""
        if not self._leases:
            return
        now = time.time()
        words = list(self._leases)
        for word, value in zip(words, self._release_words[words].tolist()):
            lease = self._leases[word]
            released = value == lease.generation
            if released or now > lease.expires_at:
                del self._leases[word]
                self._allocator.free(lease.offset, lease.nbytes)
                self._free_words.append(word)
                if released:
                    self.regions_released_total += 1
                else:
                    self.regions_expired_total += 1

    def stats(self) -> dict:
        return {"kv_mooncake_session": self._session,
                "kv_mooncake_regions_offered_total": self.regions_offered_total,
                "kv_mooncake_regions_released_total": self.regions_released_total,
                "kv_mooncake_regions_expired_total": self.regions_expired_total,
                "kv_mooncake_buffer_full_total": self.buffer_full_total,
                "kv_mooncake_regions_leased": len(self._leases)}

    def close(self) -> None:
        self._engine = None  # TE's destructor closes its sessions and listeners

