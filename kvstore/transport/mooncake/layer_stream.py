"""Layer streams over Mooncake's Transfer Engine (``--kv-streaming layer`` with
``--kv-transfer mooncake``): the decode side of a stream whose pieces the prefill writes into
one leased region of its TE-registered memory
(kvstore.transport.mooncake.connector.RegionStreamSender) as its layers end, counting them in
the region's progress word.

MooncakeLayerStreamReceiver takes the pieces in order, as the store-backed LayerStreamReceiver
does: it reads the progress word until a piece is written, then the piece, into a registered
receive buffer of the decode's MooncakeTransferBackend, hands it to the stream's writer, and
releases the region at the end (the prefill keeps it pinned while its writer may still write).
Reads go into the receive buffer, never into the cache, so an abort ends the stream at once;
leases, TE's timeout and the abandoned buffer work as for whole regions
(kvstore.transport.mooncake.backend).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from pdcluster.kvstore.errors import BlockLayoutError, KVTransferError
from pdcluster.kvstore.transport.base import _Cancelled
from pdcluster.kvstore.transport.layer_stream.stream import (POLL_MAX_S, POLL_MIN_S,
                                                             LayerStreamReceiver)
from pdcluster.kvstore.transport.mooncake.backend import LEASE_MARGIN_S, MooncakeTransferBackend
from pdcluster.kvstore.transport.mooncake.te import TE_NO_BATCH


@dataclass(frozen=True)
class StreamRegion:
    """A layer stream's pieces in a source's TE-registered memory (``--kv-streaming layer``
    with ``--kv-transfer mooncake``): piece i at ``address + offsets[i]``; the source writes
    the number of pieces written so far into the progress word as it goes.

    Attributes:
        session, release_address, generation, expires_at: as for a RemoteRegion.
        address: the region's first byte in the source process.
        offsets: each piece's byte offset in the region, then the region's length.
        progress_address: an int64 word in the source's registered memory: pieces written.
    """

    session: str
    address: int
    offsets: tuple[int, ...]
    progress_address: int
    release_address: int
    generation: int
    expires_at: float


class MooncakeLayerStreamReceiver(LayerStreamReceiver):
    """Decode side of a layer stream over TE: takes the pieces in order, as the store-backed
    LayerStreamReceiver does, reading the source's progress word until a piece is written and
    then the piece into a registered receive buffer (never into the cache directly: an abort
    may then end the stream at once). Releases the region once the stream ended.

    Args:
        backend: the decode's MooncakeTransferBackend (its TE, buffers and release words).
        Others as LayerStreamReceiver, whose ``client`` is unused here.
    """

    def __init__(self, backend: MooncakeTransferBackend, announce, write, finish, piece_shape,
                 dtype: torch.dtype, timeout_s: float) -> None:
        super().__init__(None, announce, write, finish, piece_shape, dtype, timeout_s)
        self._backend, self._region = backend, announce.region
        self._written = 0  # pieces the source said it wrote
        self._buffer: torch.Tensor | None = None

    def _receive(self) -> None:
        region = self._region
        sizes = [b - a for a, b in zip(region.offsets, region.offsets[1:])]
        self._buffer = self._backend.take_buffer(max(sizes, default=8))
        try:
            super()._receive()
        finally:
            if self._buffer is not None:  # None: abandoned to a read TE gave up on
                self._backend.give_buffer(self._buffer)
            if self._backend.is_open(region.session):
                self._guarded(self._backend.release, region)

    def _take(self, index: int) -> torch.Tensor:
        region, wait = self._region, POLL_MIN_S
        while self._written <= index:
            if self._cancelled or self.poll().done:
                raise _Cancelled()
            self._read(self._buffer.data_ptr(), region.progress_address, 8)
            self._written = int(self._buffer[:8].view(torch.int64).item())
            if self._written <= index:
                time.sleep(wait)  # not written yet
                wait = min(wait * 2, POLL_MAX_S)
        start, end = region.offsets[index], region.offsets[index + 1]
        shape = self._piece_shape(self.announce.pieces[index])
        if end - start != math.prod(shape) * self._dtype.itemsize:
            raise BlockLayoutError(f"{self._describe()}: piece {index} holds {end - start} "
                                   f"bytes, a {self._dtype} {shape} piece here")
        self._read(self._buffer.data_ptr(), region.address + start, end - start)
        return self._buffer[:end - start].view(self._dtype).view(shape)

    def _read(self, dst: int, src: int, length: int) -> None:
        """One TE read into the receive buffer, waited for without spinning a core. Raises
        KVTransferError (a failed read, a lease about to end, TE's own timeout)."""
        region, backend = self._region, self._backend
        if time.time() > region.expires_at - LEASE_MARGIN_S:
            raise KVTransferError(f"{self._describe()}: the source's lease ends",
                                  address=region.session)
        engine = backend.engine()
        batch = engine.batch_transfer_async_read(region.session, [dst], [src], [length])
        if batch in TE_NO_BATCH:
            backend.mark_open(region.session, False)
            raise KVTransferError(f"{self._describe()}: Transfer Engine refused the read",
                                  address=region.session)
        backend.mark_open(region.session, True)
        give_up = backend.te_deadline(length)
        wait = POLL_MIN_S / 5
        while (status := engine.transfer_check_status(batch)) == 0:
            if time.monotonic() > give_up:
                backend.abandon(self._buffer)  # the read may still land in it
                self._buffer = None
                raise KVTransferError(f"{self._describe()}: Transfer Engine read timed out",
                                      address=region.session)
            time.sleep(wait)
            wait = min(wait * 2, POLL_MIN_S)
        if status < 0:
            raise KVTransferError(f"{self._describe()}: Transfer Engine read failed",
                                  address=region.session)

    def _describe(self) -> str:
        return f"layer stream of {self.announce.request_id} over TE from {self._region.session}"

    def _address(self) -> str | None:
        return self._region.session
