"""Loads the part of a prompt's cached prefix that this worker's G1 lacks, from the fastest
place in the cluster that holds it (Mooncake FAST'25 §4, "global cache-aware" reuse).

Order of preference per block: this node's G2 arena, this node's G3 SSD (both read through
the arena: the node store promotes SSD hits into G2), then another node's G2/G3 over gRPC.
Loading stops at the first block that cannot be had (a miss, a corrupt SSD block, a failed or
timed-out transfer): the prefix is cut there and the rest is recomputed, so a fault costs
compute, never correctness.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import torch

from engine.kv_cache import PagedKVCache
from kvstore.errors import KVStoreError
from kvstore.index import KVIndex, Location
from kvstore.node_client import NodeStoreClient
from kvstore.remote import RemoteStores

log = logging.getLogger(__name__)

LOCAL_TIERS = ("host", "ssd")


@dataclass
class LoadResult:
    """num_blocks: blocks loaded into G1; tokens_by_tier: tokens per source tier ("host",
    "ssd" on this node, "remote" from another node); failures: transfer errors seen."""

    num_blocks: int = 0
    tokens_by_tier: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


class PrefixLoader:
    def __init__(self, node_id: str, index: KVIndex, node_client: NodeStoreClient,
                 remote: RemoteStores, kv_cache: PagedKVCache) -> None:
        self.node_id = node_id
        self.index = index
        self.node_client = node_client
        self.remote = remote
        self.kv_cache = kv_cache

    def load(self, keys: Sequence[bytes], dest_blocks: Sequence[int],
             locations: Sequence[Sequence[Location]] | None = None) -> LoadResult:
        """Fill dest_blocks[i] with keys[i]'s block for the longest loadable run of keys.

        locations: where each key's block is (the Conductor's plan: PrefixPlan.locations);
        None: looked up in the global index here."""
        result = LoadResult()
        if not keys:
            return result
        if locations is None:
            try:
                locations = self.index.longest_prefix(list(keys))
            except KVStoreError as exc:
                result.failures.append(f"index: {exc}")
                return result
        plan = self._plan(locations)
        data = torch.empty((len(plan), *self.kv_cache.block_shape), dtype=self.kv_cache.dtype)
        loaded = 0
        for source, run_start, run_end in _runs(plan):
            got = self._fetch(source, list(keys[run_start:run_end]), data[run_start:run_end],
                              result)
            loaded = run_start + got
            if got < run_end - run_start:
                break
        if loaded:
            self.kv_cache.write_blocks(list(dest_blocks[:loaded]), data[:loaded])
        result.num_blocks = loaded
        return result

    def _plan(self, locations: list[list[Location]]) -> list[str]:
        """Per key: "local" or the node id to fetch from; stops at the first unfetchable key."""
        plan: list[str] = []
        for locs in locations:
            fetchable = [loc for loc in locs if loc.tier in LOCAL_TIERS]
            if any(loc.node_id == self.node_id for loc in fetchable):
                plan.append("local")
            elif fetchable:  # fastest tier first (the index orders host before ssd)
                plan.append(fetchable[0].node_id)
            else:
                break
        return plan

    def _fetch(self, source: str, keys: list[bytes], out: torch.Tensor,
               result: LoadResult) -> int:
        """Fetch a run of keys from one source into out; returns how many leading keys came."""
        block_tokens = self.kv_cache.block_size
        if source == "local":
            try:
                tiers = self.node_client.read(keys, out)
            except Exception as exc:  # noqa: BLE001 — a dead local store: recompute
                result.failures.append(f"local store: {exc}")
                return 0
            got = next((i for i, t in enumerate(tiers) if t is None), len(tiers))
            for tier in tiers[:got]:
                result.tokens_by_tier[tier] = result.tokens_by_tier.get(tier, 0) + block_tokens
            return got
        try:
            out.copy_(self.remote.client(source).get_blocks(keys))
        except KVStoreError as exc:
            log.warning("prefix fetch of %d blocks from node %s failed: %s", len(keys), source,
                        exc)
            result.failures.append(f"node {source}: {exc}")
            self.remote.forget(source)
            return 0
        result.tokens_by_tier["remote"] = result.tokens_by_tier.get("remote", 0) + \
            len(keys) * block_tokens
        return len(keys)


def _runs(plan: list[str]) -> list[tuple[str, int, int]]:
    """Maximal runs of equal sources: (source, start, end)."""
    runs: list[tuple[str, int, int]] = []
    for i, source in enumerate(plan):
        if runs and runs[-1][0] == source:
            runs[-1] = (source, runs[-1][1], i + 1)
        else:
            runs.append((source, i, i + 1))
    return runs
