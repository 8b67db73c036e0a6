"""The POSIX shared-memory segment behind a host arena: create (owner), attach (worker) and
reclaim (segments whose owner died).

Ownership is an ``flock`` on the segment itself, held by its creator for the arena's life. The
kernel drops it when the owner exits however it exits (SIGKILL included), so a process that can
take the lock knows the owner is gone; pid reuse cannot fool it. The owner creates the segment
empty (``O_EXCL``), locks it, and only then sizes it, so a segment with a size and no lock holder
has a dead owner, while an empty unlocked one may be a few microseconds old and is left alone.

The owner maps it with ``multiprocessing.shared_memory.SharedMemory``, which registers it with
the owner's resource tracker: that unlinks it if the owner exits without closing it, unless the
tracker dies with the owner (Ray kills a worker's whole process group), which is what reclaiming
is for. Workers attach with :func:`attach_segment`, which never registers it;
kvstore/arena/view.py says why.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import secrets
import time
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

from pdcluster.kvstore.arena.errors import ArenaAllocationError, ArenaAttachError

log = logging.getLogger(__name__)

#: Where Linux keeps POSIX shared-memory segments (a tmpfs); absent on macOS.
SHM_DIR = Path("/dev/shm")
#: Every arena segment's name starts with this (:func:`segment_name`).
SEGMENT_PREFIX = "pdc-"
#: An empty, unlocked segment older than this lost its creator between ``O_EXCL`` and ``flock``
#: (a window of microseconds): it is reclaimed too.
ORPHAN_EMPTY_AFTER_S = 60.0

try:
    import _posixshmem  # the stdlib's own binding, used by multiprocessing.shared_memory
except ImportError:  # not a POSIX platform
    _posixshmem = None


def segment_name(node_id: str | None = None) -> str:
    """A fresh segment name ``pdc-{node_id[:8]}-{12 hex}`` (``pdc-{12 hex}`` without a node id);
    at most 25 characters, inside macOS's 31-character POSIX limit."""
    token = secrets.token_hex(6)
    return f"{SEGMENT_PREFIX}{node_id[:8]}-{token}" if node_id else f"{SEGMENT_PREFIX}{token}"


@dataclass
class OwnedSegment:
    """A segment this process created: its mapping and the descriptor holding the owner lock.

    Attributes:
        shm: the read-write mapping (``shm.buf``, ``shm.name``).
        lock_fd: a descriptor of the segment with an exclusive ``flock`` on it, or ``None`` where
            the platform cannot lock shared memory (then the segment is never reclaimed).
    """

    shm: SharedMemory
    lock_fd: int | None

    def unlink(self) -> None:
        """Remove the name (no new attach succeeds), then drop the owner lock: a reclaimer that
        now takes it finds nothing left to reclaim. Idempotent.

        Raises:
            FileNotFoundError: the name was already removed by someone else; the lock is
                dropped either way.
        """
        try:
            self.shm.unlink()
        finally:
            if self.lock_fd is not None:
                os.close(self.lock_fd)
                self.lock_fd = None


def create_segment(name: str, size: int) -> OwnedSegment:
    """Create segment ``name`` of ``size`` bytes, owned (locked) by this process, and commit its
    memory (tmpfs pages are otherwise allocated on first touch, and a full ``/dev/shm`` then
    kills the toucher with SIGBUS).

    Raises:
        ArenaAllocationError: the name exists, POSIX shared memory is unavailable, or the memory
            cannot be committed (``/dev/shm`` too small); nothing is left behind.
    """
    if _posixshmem is None:
        raise ArenaAllocationError("POSIX shared memory is unavailable on this platform")
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    except OSError as e:
        raise ArenaAllocationError(f"cannot create {size}-byte segment {name}: {e}") from e
    try:
        lock_fd = fd if _lock_owner(fd) else None
        # sized only once locked: an empty segment tells a reclaimer "being created"
        os.ftruncate(fd, size)
        if hasattr(os, "posix_fallocate"):  # Linux; macOS has no tmpfs-style overcommit
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise ArenaAllocationError(
                    f"cannot preallocate {size} bytes of shared memory for {name} ({e}); "
                    "is /dev/shm large enough? (Docker: --shm-size)"
                ) from e
        shm = SharedMemory(name=name)  # maps it and registers it with the resource tracker
    except BaseException as e:
        os.close(fd)
        try:
            _posixshmem.shm_unlink("/" + name)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise ArenaAllocationError(f"cannot create {size}-byte segment {name}: {e}") from e
        raise
    if lock_fd is None:
        os.close(fd)
    return OwnedSegment(shm, lock_fd)


def _lock_owner(fd: int) -> bool:
    """Take the owner lock on a new segment; False where shared memory cannot be flocked.

    Blocks for the moment a reclaimer may hold it while it looks at the empty segment.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOLCK):
            return False
        raise
    return True


def reclaim_dead_segments(shm_dir: Path = SHM_DIR, prefix: str = SEGMENT_PREFIX) -> list[str]:
    """Unlink this machine's arena segments whose owner process is dead.

    A segment is reclaimed when its owner lock can be taken (the owner exited: the kernel
    dropped its ``flock``) and it has a size (its creator had locked it), or when it is empty
    and older than ``ORPHAN_EMPTY_AFTER_S``. A segment whose owner lives, in this process or
    another, is never touched, nor one this user cannot open. Workers still mapping a
    reclaimed segment keep their mapping; its memory returns to the OS when the last unmaps.

    Args:
        shm_dir: the shared-memory directory; nothing happens when it does not exist.
        prefix: only names starting with it are considered.

    Returns:
        The names unlinked (no leading slash).
    """
    if not shm_dir.is_dir():
        return []
    reclaimed: list[str] = []
    for entry in os.scandir(shm_dir):
        if entry.name.startswith(prefix) and _reclaim_if_dead(entry.path):
            reclaimed.append(entry.name)
    if reclaimed:
        log.info("reclaimed %d shared-memory arena(s) of dead owners: %s", len(reclaimed),
                 ", ".join(reclaimed))
    return reclaimed


def _reclaim_if_dead(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # gone meanwhile, another user's, or not a file
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # the owner holds it: alive (or the platform cannot tell)
        st = os.fstat(fd)
        if st.st_size == 0 and time.time() - st.st_mtime < ORPHAN_EMPTY_AFTER_S:
            return False  # its creator is about to lock it
        try:
            if os.stat(path, follow_symlinks=False).st_ino != st.st_ino:
                return False  # the name now belongs to a newer segment
            os.unlink(path)
        except OSError:
            return False
        return True
    finally:
        os.close(fd)


def attach_segment(name: str, size: int) -> mmap.mmap:
    """Map ``size`` bytes of POSIX shared-memory segment ``name`` read-write, untracked.

    Raises:
        ArenaAttachError: the segment does not exist, is smaller than ``size``, or POSIX shared
            memory is unavailable.
    """
    if _posixshmem is None:
        raise ArenaAttachError("POSIX shared memory is unavailable on this platform")
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
