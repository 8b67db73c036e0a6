"""Slab files of the SSD tier: fixed-size slots, each one checksummed block, and their IO.

Layout (``S`` = ``slab_blocks``; a slot holds at most one block)::

    <directory>/slab-{n}.bin   slots n*S .. n*S+S-1, created (sparse) by the first write into it
    slot i at byte offset (i % S) * slot_nbytes, slot_nbytes = HEADER_NBYTES + block_nbytes
    header  = MAGIC (8 B) | key (32 B) | payload length (u64 LE) | checksum (u64 LE) | zero pad
    payload = block_nbytes raw bytes (one KV block, all layers)

Each operation opens the slab by path (``os.open`` + ``pread``/``pwritev`` + ``close``): measured
no slower than ``stat`` + ``pread`` on a cached fd, and a deleted slab then fails to open (a miss)
instead of being read through a stale descriptor; a write after a delete recreates the file.

Checksum: xxh3_64 (``xxhash`` package) measured 33-39 GB/s vs zlib.crc32's 3.3-3.7 GB/s on
20 KiB-1 MiB blocks, where crc32 would cost more than a 1 MiB page-cache read (~0.13 ms).
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from xxhash import xxh3_64_intdigest as checksum

MAGIC = b"PDKVSSD1"
_HEADER = struct.Struct("<8s32sQQ")
HEADER_NBYTES = 64  # _HEADER.size (56) padded so a payload starts 64-byte aligned in its slot
_SLAB_NAME = re.compile(r"slab-\d+\.bin")


@dataclass(frozen=True)
class SlabFiles:
    """Slots of ``block_nbytes`` payloads in ``directory``, ``slab_blocks`` slots per file.

    Not synchronized: the caller makes sure no two operations touch one slot at once.
    """

    directory: Path
    block_nbytes: int
    slab_blocks: int

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one slot on disk: header + payload."""
        return HEADER_NBYTES + self.block_nbytes

    def path(self, slot: int) -> Path:
        """The slab file holding ``slot``."""
        return self.directory / f"slab-{slot // self.slab_blocks}.bin"

    def offset(self, slot: int) -> int:
        """Byte offset of ``slot`` in its slab file."""
        return (slot % self.slab_blocks) * self.slot_nbytes

    def write(self, slot: int, key: bytes, payload: bytes, digest: int) -> bool:
        """Write header + payload into ``slot``; False on an OSError or a short write.

        ``digest`` is ``checksum(payload)``, computed by the caller (it keeps a copy).
        """
        header = _HEADER.pack(MAGIC, key, len(payload), digest).ljust(HEADER_NBYTES, b"\0")
        try:
            fd = os.open(self.path(slot), os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                written = os.pwritev(fd, [header, payload], self.offset(slot))
            finally:
                os.close(fd)
        except OSError:
            return False
        return written == HEADER_NBYTES + len(payload)

    def read(self, slot: int, key: bytes, digest: int) -> bytes | None:
        """The payload in ``slot`` if its magic, ``key``, length (``block_nbytes``), header
        checksum and payload checksum all match ``digest``; None otherwise (a missing or
        truncated slab, overwritten or flipped bytes, an OSError)."""
        try:
            fd = os.open(self.path(slot), os.O_RDONLY)
        except OSError:
            return None
        try:
            offset = self.offset(slot)
            header = os.pread(fd, _HEADER.size, offset)
            if len(header) != _HEADER.size:
                return None
            if _HEADER.unpack(header) != (MAGIC, key, self.block_nbytes, digest):
                return None
            payload = os.pread(fd, self.block_nbytes, offset + HEADER_NBYTES)
        except OSError:
            return None
        finally:
            os.close(fd)
        if len(payload) != self.block_nbytes or checksum(payload) != digest:
            return None
        return payload

    def delete_all(self) -> None:
        """Delete every ``slab-{n}.bin`` in the directory (other files are left alone)."""
        try:
            paths = list(self.directory.iterdir())
        except FileNotFoundError:
            return
        for path in paths:
            if _SLAB_NAME.fullmatch(path.name):
                path.unlink(missing_ok=True)
