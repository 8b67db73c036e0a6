"""G2 (host DRAM) tier: one preallocated shared-memory arena per node, so
every worker on the node reads and writes the same bytes without copying them over RPC.

``owner.HostArena`` lives in the node's KV store actor and holds the metadata (key -> slot, LRU,
leases, pins); ``view.ArenaView`` is a worker's direct mapping of the same bytes. Only keys and
slot numbers cross RPC.

Light re-exports only: importing ``kvstore.arena`` does not import torch (the owner needs none);
import ``ArenaView`` from ``kvstore.arena.view``.
"""

from pdcluster.kvstore.arena.errors import (ArenaAllocationError, ArenaAttachError,
                                            ArenaClosedError, ArenaFullError)
from pdcluster.kvstore.arena.owner import HostArena

__all__ = [
    "ArenaAllocationError",
    "ArenaAttachError",
    "ArenaClosedError",
    "ArenaFullError",
    "HostArena",
]
