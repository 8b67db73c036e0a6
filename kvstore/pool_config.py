"""Configuration of the cluster KV pool: tier capacities, the global index, node leases."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from kvstore.index import DEFAULT_INDEX_URL


class KVPoolConfig(BaseModel):
    """dram_cache_bytes: each node's G2 shared-memory arena (`--dram-cache-gb`).
    ssd_cache_dir: root of the G3 slab files, one sub-directory per node; None = no G3
        (`--ssd-cache-dir`). ssd_cache_bytes: G3 capacity per node (`--ssd-cache-gb`).
    index_url: `ray://<actor name>` (embedded default: one named in-memory index actor),
        `memory://` (process-local, single-process tests only) or `redis://host:port/db`.
    node_lease_s: a node whose store stops heartbeating drops out of lookups after this long.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    dram_cache_bytes: int = Field(256 << 20, gt=0)
    ssd_cache_dir: str | None = None
    ssd_cache_bytes: int = Field(1 << 30, gt=0)
    index_url: str = DEFAULT_INDEX_URL
    node_lease_s: float = Field(10.0, gt=0, le=10.0)
