"""Configuration of one node's KV store and of the KV transfer backends (DESIGN.md "Config":
typed, explicit, 127.0.0.1 default)."""

from __future__ import annotations

from typing import Literal

import pydantic

#: Names of the transfer backends (kvstore.transfer.registry.TRANSFER_BACKENDS has the classes).
TransferBackendName = Literal["grpc", "torch", "fake"]


class KVTLSConfig(pydantic.BaseModel):
    """TLS of the KV gRPC plane (``--kv-tls-cert``, ``--kv-tls-key``, ``--kv-tls-ca``); PEM
    file paths, read when a server or channel is built (kvstore/tls.py).

    Attributes:
        cert_file / key_file: this node's certificate chain and private key: the KV store
            server presents them, and clients present them when the server asks (mutual TLS).
            The certificate's subjectAltName must name the address clients dial (the node's
            ``--kv-bind`` address), or set ``server_name``.
        ca_file: CA bundle clients verify servers against (None: the system's roots). When
            set, servers also require client certificates signed by it (mutual TLS).
        server_name: the name clients check in the server's certificate instead of the dialed
            host (one shared cluster certificate for every node).
    """

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")

    cert_file: str
    key_file: str
    ca_file: str | None = None
    server_name: str | None = None


class KVStoreConfig(pydantic.BaseModel):
    """Settings of one node's KV store: its gRPC server (kvstore.server.KVStoreServer), its
    tail blocks (kvstore.tail_store.TailStore) and its Ray actor (kvstore.actor.KVStoreActor).

    Attributes:
        host: bind address of the gRPC server (``--kv-bind``); 127.0.0.1 unless the cluster
            spans machines, then the node's routable address.
        port: TCP port; 0 picks a free port at start.
        capacity_bytes: host-DRAM budget in bytes of the tail blocks held at once
            (``--kv-tail-capacity-bytes``); keyed blocks live in the G2 arena and G3 tier,
            sized by kvstore.pool_config.KVPoolConfig.
        tail_ttl_s: seconds a tail block may wait to be taken before it is dropped (so a
            decode worker that never comes leaks nothing).
        transfer_timeout_s: deadline in seconds of each client RPC.
        max_message_bytes: max gRPC message size in bytes, both directions.
        token: shared secret (``--kv-token``) every call must present as
            ``authorization: Bearer <token>``; ``None`` turns auth off (tests of this module
            only: the cluster launcher always sets one). A ``SecretStr``, so it never shows in
            a repr or a log.
        tls: TLS of the gRPC server and its clients; ``None``: plaintext (the token still
            guards every call, but crosses the network in the clear).
        fault_injection: lets callers break the store actor on purpose
            (:meth:`kvstore.actor.KVStoreActor.inject_fault`: stop serving gRPC, stop
            heartbeating), as fault-tolerance tests do to a running cluster. Off by default,
            and no CLI flag sets it; with it off, injecting raises.
    """

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = pydantic.Field(default=0, ge=0, le=65535)
    capacity_bytes: int = pydantic.Field(default=1 << 30, gt=0)
    tail_ttl_s: float = pydantic.Field(default=120.0, gt=0)
    transfer_timeout_s: float = pydantic.Field(default=10.0, gt=0)
    max_message_bytes: int = pydantic.Field(default=64 << 20, gt=0)
    token: pydantic.SecretStr | None = None
    tls: KVTLSConfig | None = None
    fault_injection: bool = False


class KVTransferConfig(pydantic.BaseModel):
    """Settings of the receiving side of KV transfers (kvstore.transfer), one per worker.

    Attributes:
        backend: ``grpc`` (pull from a node's KV store), ``torch`` (torch.distributed
            point-to-point over a pair group: gloo on CPU, NCCL on CUDA) or ``fake`` (tests).
        timeout_s: default deadline of one transfer in seconds (FetchRequest.deadline_s wins).
        max_chunk_bytes: payload bytes per wire message (grpc) or per send/recv (torch).
        num_streams: grpc: concurrent FetchBlocks sessions one large transfer is split across.
        min_stream_bytes: grpc: a transfer is split only so that each stream gets at least
            this many bytes (small transfers stay on one stream).
        max_message_bytes: grpc channel's max message size in bytes.
        token: the KV plane's shared secret (``--kv-token``); ``None`` only in tests.
        tls: the KV plane's TLS (``--kv-tls-*``, copied from the KV store's config).
        bind_host: torch: address the sender's pair store binds (a node's routable address
            in a cluster).
        streaming: ``request`` (decode pulls the whole request's KV once prefill is done) or
            ``layer`` (each layer's KV for the new tokens is published as soon as that layer's
            prefill compute ends, overlapping the rest; Mooncake FAST'25 §3.1).
    """

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")

    backend: TransferBackendName = "grpc"
    timeout_s: float = pydantic.Field(default=10.0, gt=0)
    max_chunk_bytes: int = pydantic.Field(default=4 << 20, gt=0)
    num_streams: int = pydantic.Field(default=2, ge=1, le=64)
    min_stream_bytes: int = pydantic.Field(default=8 << 20, gt=0)
    max_message_bytes: int = pydantic.Field(default=64 << 20, gt=0)
    token: pydantic.SecretStr | None = None
    tls: KVTLSConfig | None = None
    bind_host: str = "127.0.0.1"
    streaming: Literal["request", "layer"] = "request"
