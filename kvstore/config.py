"""Configuration of one node's KV store (DESIGN.md "Config": typed, explicit, 127.0.0.1 default)."""

from __future__ import annotations

import pydantic


class KVStoreConfig(pydantic.BaseModel):
    """Settings of a :class:`kvstore.server.KVStoreServer` and its host-DRAM block store.

    Attributes:
        host: bind address of the gRPC server; 127.0.0.1 unless the cluster spans machines.
        port: TCP port; 0 picks a free port at start.
        capacity_bytes: host-DRAM budget in bytes; keyed blocks past it are LRU-evicted.
        tail_ttl_s: seconds a tail block may wait to be taken before it is dropped (so a
            decode worker that never comes leaks nothing).
        transfer_timeout_s: deadline in seconds of each client RPC.
        max_message_bytes: max gRPC message size in bytes, both directions.
    """

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = pydantic.Field(default=0, ge=0, le=65535)
    capacity_bytes: int = pydantic.Field(default=1 << 30, gt=0)
    tail_ttl_s: float = pydantic.Field(default=120.0, gt=0)
    transfer_timeout_s: float = pydantic.Field(default=10.0, gt=0)
    max_message_bytes: int = pydantic.Field(default=64 << 20, gt=0)
