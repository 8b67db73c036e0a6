"""Pluggable eviction policies for a fixed-capacity cache of chained prefix blocks.

Research code of ``benchmarks/cache_hit.py``: the product's pools keep the O(1) LRU free queue
of ``engine.core.block_pool.BlockPool``, which none of these beat by enough on the Mooncake trace
(benchmarks/RESULTS.md). A policy only *chooses*: its owner (:class:`PolicyCache`) holds the
data and calls ``victim()`` when it needs room. Calls an owner makes::

    on_insert(k, parent)  new entry, referenced once; ``parent`` = key of the block before it
    on_hit(k)             one more reference (an access the policy records)
    on_release(k)         one reference fewer
    victim() -> k         choose an evictable entry, forget it, return it (owner drops the data)
    on_remove(k)          forget an evictable entry the owner drops itself (a cache reset)

An entry is *evictable* when no request references it (``BlockPool`` refcount 0) and no cached
entry names it as parent: eviction is leaf-first, because a prefix hit needs every block before
it, so a cached child of an evicted block would be dead weight (SGLang's radix cache evicts
leaves only, too). A request's blocks are released tail-first (``BlockPool.free``), so with LRU a
parent is always more recent than its children and leaf-first changes nothing.

Policies (``EVICTION_POLICIES``: name -> factory ``capacity -> EvictionPolicy``):

    lru         least recently released first; O(1). Exactly BlockPool's free-queue order.
    s3fifo      S3-FIFO (Yang et al., SOSP'23): small + main FIFO, ghost queue; O(1) amortized.
    arc         ARC (Megiddo & Modha, FAST'03): adaptive recency/frequency split; O(1).
    lfuda       LFU with dynamic aging (Arlitt et al., 2000): priority L + references; O(log n).
    lfuda_sqrt  LFU-DA with priority L + sqrt(references): less weight on frequency; O(log n).

``DEFAULT_EVICTION`` is the best on the Mooncake conversation trace by
``benchmarks/cache_hit.py``: highest mean gain over LRU at 10-30% of the unique-block footprint,
smallest worst-case loss. Not thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.eviction.arc import ARCPolicy
from benchmarks.eviction.base import EvictionPolicy, Key
from benchmarks.eviction.lfuda import LFUDAPolicy
from benchmarks.eviction.lru import LRUPolicy
from benchmarks.eviction.replay import PolicyCache
from benchmarks.eviction.s3fifo import S3FIFOPolicy

__all__ = ["ARCPolicy", "DEFAULT_EVICTION", "EVICTION_POLICIES", "EvictionPolicy", "Key",
           "LFUDAPolicy", "LRUPolicy", "PolicyCache", "S3FIFOPolicy", "make_policy"]

EVICTION_POLICIES: dict[str, Callable[[int], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "s3fifo": S3FIFOPolicy,
    "arc": ARCPolicy,
    "lfuda": LFUDAPolicy,
    "lfuda_sqrt": lambda capacity: LFUDAPolicy(capacity, exponent=0.5),
}
DEFAULT_EVICTION = "lfuda_sqrt"


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """A new policy registered as ``name``, for a cache of ``capacity`` entries."""
    try:
        factory = EVICTION_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; "
                         f"known: {', '.join(EVICTION_POLICIES)}") from None
    return factory(capacity)
