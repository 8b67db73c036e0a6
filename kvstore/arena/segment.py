"""The POSIX shared-memory segment behind a host arena: create (owner) and attach (worker).

The owner creates it with ``multiprocessing.shared_memory.SharedMemory``, which registers it with
the owner's resource tracker (unlinked if the owner dies without closing). Workers attach with
:func:`attach_segment`, which never registers it; kvstore/arena/view.py says why.
"""

from __future__ import annotations

import mmap
import os
import secrets
from multiprocessing.shared_memory import SharedMemory

from kvstore.arena.errors import ArenaAllocationError, ArenaAttachError


def segment_name(node_id: str | None = None) -> str:
    """A fresh segment name ``pdc-{node_id[:8]}-{12 hex}`` (``pdc-{12 hex}`` without a node id);
    at most 25 characters, inside macOS's 31-character POSIX limit."""
    token = secrets.token_hex(6)
    return f"pdc-{node_id[:8]}-{token}" if node_id else f"pdc-{token}"


def create_segment(name: str, size: int) -> SharedMemory:
    """Create the segment and commit its memory (tmpfs pages are otherwise allocated on first
    touch, and a full ``/dev/shm`` then kills the toucher with SIGBUS)."""
    try:
        shm = SharedMemory(name=name, create=True, size=size)
    except OSError as e:
        raise ArenaAllocationError(f"cannot create {size}-byte segment {name}: {e}") from e
    if hasattr(os, "posix_fallocate"):  # Linux; macOS has no tmpfs-style overcommit
        try:
            os.posix_fallocate(shm._fd, 0, size)  # the stdlib keeps the fd private
        except OSError as e:
            shm.close()
            shm.unlink()
            raise ArenaAllocationError(
                f"cannot preallocate {size} bytes of shared memory for {name} ({e}); "
                "is /dev/shm large enough? (Docker: --shm-size)"
            ) from e
    return shm


def attach_segment(name: str, size: int) -> mmap.mmap:
    """Map ``size`` bytes of POSIX shared-memory segment ``name`` read-write, untracked."""
    try:
        import _posixshmem  # the stdlib's own binding, used by multiprocessing.shared_memory
    except ImportError as e:
        raise ArenaAttachError("POSIX shared memory is unavailable on this platform") from e
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    except FileNotFoundError as e:
        raise ArenaAttachError(
            f"shared-memory segment {name!r} does not exist "
            "(closed by its owner, or created on another node)"
        ) from e
    except OSError as e:
        raise ArenaAttachError(f"cannot open shared-memory segment {name!r}: {e}") from e
    try:
        actual = os.fstat(fd).st_size
        if actual < size:
            raise ArenaAttachError(f"segment {name!r} is {actual} bytes, expected >= {size}")
        return mmap.mmap(fd, size)  # keeps its own duplicate of fd
    finally:
        os.close(fd)
