"""Typed errors of the G2 host-DRAM arena (kvstore/arena)."""

from __future__ import annotations

from pdcluster.kvstore.errors import KVStoreError, StoreCapacityError


class ArenaFullError(StoreCapacityError):
    """``reserve`` needs more slots than are free or evictable: every other slot is leased (a
    read or write in flight) or pinned. A StoreCapacityError, as the gRPC service reports it.

    Nothing was evicted or reserved by the failing call.

    Attributes:
        needed: slots the call needed (keys not yet present, duplicates counted once).
        available: free slots plus evictable (stored, unleased, unpinned) slots at the time
            of the call.
    """

    def __init__(self, needed: int, available: int):
        super().__init__(
            f"host arena full: {needed} slots needed, {available} free or evictable "
            "(the rest are leased by reads or writes in flight, or pinned)"
        )
        self.needed = needed
        self.available = available

    def __reduce__(self):  # rebuilt from its own arguments when it crosses Ray's RPC
        return (type(self), (self.needed, self.available))


class ArenaAllocationError(KVStoreError):
    """The owner could not create or preallocate the shared-memory segment.

    Usually ``/dev/shm`` is smaller than the arena (Docker's default is 64 MiB: raise it with
    ``--shm-size``; Kubernetes: mount an ``emptyDir`` with ``medium: Memory``).
    """


class ArenaAttachError(KVStoreError):
    """A worker could not attach to the arena's segment: it does not exist (the owner closed it,
    or the name is from another node), it is smaller than announced, or POSIX shared memory is
    unavailable on this platform."""


class ArenaClosedError(KVStoreError):
    """The arena (owner side) or the view (worker side) was used after ``close()``."""
