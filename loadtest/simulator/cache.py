"""Simulated KV cache tiers, built from the real `BlockPool` and published to a real `KVIndex`.

Per prefill instance: an optional G1 device pool. Per prefill node: a G2 host-DRAM pool and an
optional G3 SSD pool. A finished prefill writes every full block of its prompt through to G1
and G2 (as a prefill worker caches in G1 and publishes to its node's arena); G2 evictions
demote into G3; a G3 hit is promoted back into G2. Every pool's cache events go to the index
under its Location, so the Conductor sees exactly what the pools hold.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from pdcluster.engine.core.block_pool import BlockPool
from pdcluster.engine.core.kv_events import BlockRemoved
from pdcluster.kvstore.index import KVIndex, Location


class TierPool:
    """One BlockPool used as a keyed LRU cache at one Location of the index."""

    def __init__(self, num_blocks: int, location: Location, index: KVIndex) -> None:
        self.pool = BlockPool(num_blocks)
        self.location = location
        self.index = index

    def __contains__(self, key: bytes) -> bool:
        return self.pool.get_cached_block(key) is not None

    def touch(self, keys: Sequence[bytes]) -> None:
        """Refresh the LRU position of the cached ones among `keys` (a hit)."""
        blocks = [b for b in (self.pool.get_cached_block(k) for k in keys) if b is not None]
        if blocks:
            self.pool.touch(blocks)
            self.pool.free(blocks)

    def insert(self, keys: Sequence[bytes]) -> list[bytes]:
        """Cache `keys` (a prefix chain), evicting LRU blocks; only the leading ones if not all
        fit. Returns the keys this evicted."""
        cached = [self.pool.get_cached_block(k) for k in keys]
        hits = [b for b in cached if b is not None]
        if hits:  # refresh their LRU position before allocating evicts anything
            self.pool.touch(hits)
            self.pool.free(hits)
        missing = [k for k, b in zip(keys, cached) if b is None][: self.pool.num_free_blocks]
        if missing:
            blocks = self.pool.allocate(len(missing))
            self.pool.cache_full_blocks(blocks, missing, None)
            self.pool.free(blocks)
        events = self.pool.take_events()
        if events:
            self.index.apply_events(self.location, events)
        return [k for e in events if isinstance(e, BlockRemoved) for k in e.keys]


class NodeCache:
    """The tiers one prefill instance can read locally: its G1, its node's G2 and G3."""

    def __init__(self, instance_id: str, node_id: str, index: KVIndex, device_blocks: int,
                 host_blocks: int, ssd_blocks: int) -> None:
        self.device = (TierPool(device_blocks, Location(node_id, "device", instance_id), index)
                       if device_blocks > 0 else None)
        self.host = TierPool(host_blocks, Location(node_id, "host"), index) \
            if host_blocks > 0 else None
        self.ssd = TierPool(ssd_blocks, Location(node_id, "ssd"), index) \
            if ssd_blocks > 0 else None
        self._tiers = [(name, t) for name, t in
                       (("device", self.device), ("host", self.host), ("ssd", self.ssd)) if t]

    def local_prefix(self, keys: Sequence[bytes]) -> tuple[int, int, Counter]:
        """(leading blocks held locally, of those the leading run in G1, blocks per tier)."""
        by_tier: Counter = Counter()
        device_run = 0
        n = 0
        for key in keys:
            tier = next((name for name, t in self._tiers if key in t), None)
            if tier is None:
                break
            if tier == "device" and device_run == n:
                device_run += 1
            by_tier[tier] += 1
            n += 1
        return n, device_run, by_tier

    def store(self, keys: Sequence[bytes]) -> None:
        """After a prefill: every full block of the prompt into G1 and G2 (G3 hits are thereby
        promoted into G2); G2 evictions are demoted into G3."""
        if self.device is not None:
            self.device.insert(keys)
        if self.host is not None:
            evicted = self.host.insert(keys)
            if self.ssd is not None and evicted:
                self.ssd.insert(evicted)
        elif self.ssd is not None:
            self.ssd.insert(keys)
