"""Configuration of the cluster KV pool: tier capacities, the global index, node leases."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdcluster.kvstore.index import DEFAULT_INDEX_URL


class KVPoolConfig(BaseModel):
    """dram_cache_bytes: each node's G2 shared-memory arena (`--dram-cache-gb`).
    ssd_cache_dir: root of the G3 slab files, one sub-directory per node; None = no G3
        (`--ssd-cache-dir`). ssd_cache_bytes: G3 capacity per node (`--ssd-cache-gb`).
    index_url: `ray://<actor name>` (embedded default: one named in-memory index actor),
        `memory://` (process-local, single-process tests only) or `redis://host:port/db`.
    node_lease_s: a node whose store stops heartbeating drops out of lookups after this long.
    backend: "pdcluster" (our node stores and index) or "mooncake-store" (`--kv-pool`): a
        Mooncake Store at `mooncake_master` ("host:port", its master's RPC address) is the
        prefix cache and the index; `index_url` then becomes ``mooncake://<mooncake_master>``
        and each prefill worker mounts `dram_cache_bytes` into the store, its Transfer Engine
        over `mooncake_protocol` (`--mooncake-store-protocol`: tcp | rdma).
    Raises ValueError (pydantic's ValidationError) for mooncake-store without a master.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    dram_cache_bytes: int = Field(256 << 20, gt=0)
    ssd_cache_dir: str | None = None
    ssd_cache_bytes: int = Field(1 << 30, gt=0)
    index_url: str = DEFAULT_INDEX_URL
    node_lease_s: float = Field(10.0, gt=0, le=10.0)
    backend: Literal["pdcluster", "mooncake-store"] = "pdcluster"
    mooncake_master: str | None = None
    mooncake_protocol: Literal["tcp", "rdma"] = "tcp"

    @model_validator(mode="before")
    @classmethod
    def _mooncake_index(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("backend") == "mooncake-store":
            if not data.get("mooncake_master"):
                raise ValueError("--kv-pool mooncake-store needs --mooncake-master HOST:PORT")
            data = {**data, "index_url": f"mooncake://{data['mooncake_master']}"}
        return data

    def index_options(self, bind_host: str) -> dict[str, Any]:
        """What a prefill worker opens the index with (`kvstore.index.open_index`'s kw): for
        mooncake-store, its store client's listen address and protocol and the segment it
        mounts; nothing otherwise."""
        if self.backend != "mooncake-store":
            return {}
        return {"bind_host": bind_host, "protocol": self.mooncake_protocol,
                "segment_bytes": self.dram_cache_bytes, "buffer_bytes": 64 << 20}
