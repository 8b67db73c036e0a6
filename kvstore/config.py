"""Configuration of one node's KV store and of the KV transfer backends: typed and
explicit, bound to 127.0.0.1 unless configured, so nothing listens beyond the host by default.

The KV plane's shared settings (its token, its TLS and the gRPC message size) live on
:class:`KVStoreConfig` only: every channel of the plane, store server or transfer backend,
reads them from there, so the two ends of a channel cannot disagree.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic

#: Names of the transports (kvstore.transport.registry.TRANSPORTS has what implements them).
TransferBackendName = Literal["grpc", "torch", "mooncake"]
#: The transfer backends that move a request's KV fastest out of and into cross-layer caches
#: (engine.kv_cache), as vLLM's KV connectors state it (`prefer_cross_layer_blocks`): Mooncake's
#: Transfer Engine reads a run of consecutive blocks as one span there, instead of a read per
#: layer and K|V (kvstore.transport.mooncake.backend).
PREFER_CROSS_LAYER_BLOCKS = frozenset({"mooncake"})


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
    tail blocks (kvstore.tail_store.TailStore) and its Ray actor (kvstore.actor.KVStoreActor);
    and the settings the whole KV plane shares (``token``, ``tls``, ``max_message_bytes``),
    which the transfer backends take from here too (kvstore.transport.registry.create_backend).

    Attributes:
        host: bind address of the gRPC server (``--kv-bind``); 127.0.0.1 unless the cluster
            spans machines, then the node's routable address.
        port: TCP port; 0 picks a free port at start.
        tail_capacity_bytes: host-DRAM budget in bytes of the tail blocks held at once
            (``--kv-tail-capacity-bytes``); keyed blocks live in the G2 arena and G3 tier,
            sized by kvstore.pool_config.KVPoolConfig.
        tail_ttl_s: seconds a tail block may wait to be taken before it is dropped (so a
            decode worker that never comes leaks nothing).
        rpc_timeout_s: deadline in seconds of each call a worker makes to a KV store (a gRPC
            RPC, or a Ray call to the store actor); a whole transfer's deadline is
            KVTransferConfig.timeout_s.
        max_message_bytes: max gRPC message size in bytes, both directions, of the store
            server and of every gRPC client of the KV plane (transfer backends included).
        token: shared secret of the KV plane (``--kv-token``): every gRPC call must present it
            as ``authorization: Bearer <token>``, and a torch transfer pair proves it before
            its group forms. ``None`` turns auth off (tests of this module only: the cluster
            launcher always sets one). A ``SecretStr``, so it never shows in a repr or a log.
        tls: TLS of the gRPC server and its clients; ``None``: plaintext (the token still
            guards every call, but crosses the network in the clear).
    """

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = pydantic.Field(default=0, ge=0, le=65535)
    tail_capacity_bytes: int = pydantic.Field(default=1 << 30, gt=0)
    tail_ttl_s: float = pydantic.Field(default=120.0, gt=0)
    rpc_timeout_s: float = pydantic.Field(default=10.0, gt=0)
    max_message_bytes: int = pydantic.Field(default=64 << 20, gt=0)
    token: pydantic.SecretStr | None = None
    tls: KVTLSConfig | None = None


class KVTransferConfig(pydantic.BaseModel):
    """Settings of the KV transfers between prefill and decode workers (kvstore.transport), one
    per deployment, shared by every worker. The KV plane's token, TLS and gRPC message size are
    not here: a backend takes them from the KVStoreConfig (create_backend).

    Attributes:
        backend: ``grpc`` (pull from a node's KV store), ``torch`` (torch.distributed
            point-to-point over a pair group: gloo on CPU, NCCL on CUDA), ``mooncake``
            (Mooncake's Transfer Engine: the decode reads the prefill's registered memory;
            kvstore.transport.mooncake.backend).
        timeout_s: default deadline in seconds of one whole transfer (FetchRequest.deadline_s
            wins), and the limit of a torch pair's setup; each call to a KV store has its own
            KVStoreConfig.rpc_timeout_s.
        max_chunk_bytes: payload bytes per wire message (grpc) or per send/recv (torch).
        num_streams: grpc: concurrent FetchBlocks sessions one large transfer is split across.
        min_stream_bytes: grpc: a transfer is split only so that each stream gets at least
            this many bytes (small transfers stay on one stream).
        bind_host: torch: address the sender's pair store binds; mooncake: the address each
            worker's Transfer Engine announces and listens on (a node's routable address in a
            cluster).
        kv_connector_extra_config: the transport's own settings (vLLM's
            ``kv_connector_extra_config``), validated by it (its registry entry's
            ``settings``): mooncake's in kvstore.transport.mooncake.settings; grpc and torch
            take none. The pool's gRPC settings above stay at this level: the pool is every
            transport's fallback, so they apply whichever backend is chosen.
        streaming: ``request`` (decode pulls the whole request's KV once prefill is done) or
            ``layer`` (each layer's KV for the new tokens is published as soon as that layer's
            prefill compute ends, overlapping the rest; Mooncake FAST'25 §3.1).
        load_failure_policy: what a worker does when a KV load fails for good (a decode's
            fetch after its retry, a prefill's prefix load cut short): ``recompute`` (the
            default) computes what did not arrive, so the client sees no error, only latency,
            and the worker counts it (``pdcluster_kv_load_failures_total{action="recompute"}``)
            and logs a warning; ``fail`` ends the request with KVLoadError (the client gets
            an error: a 503, or an error event once its stream began), which shows a
            misconfigured data plane at once. vLLM's
            ``kv_load_failure_policy``, whose default became ``fail``.
        decode_publish: a decode worker puts the full blocks of a sequence that ended
            normally (prompt and output; the blocks no prefill published) into its node's KV
            store and so the index (kvstore.transport.pool.publish), so a conversation's next turn
            reuses the reply's KV.
        decode_publish_interval: with decode_publish, a running sequence's blocks also go out
            every this many full blocks, not only when it ends (0: at the end only).
        incremental_transfer: a decode worker that holds a prompt's leading blocks in its own
            prefix cache fetches only the blocks after them (store path only: a pushed
            transfer brings the whole prompt); off, every prompt travels whole.
    """

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")

    backend: TransferBackendName = "grpc"
    timeout_s: float = pydantic.Field(default=10.0, gt=0)
    max_chunk_bytes: int = pydantic.Field(default=4 << 20, gt=0)
    num_streams: int = pydantic.Field(default=2, ge=1, le=64)
    min_stream_bytes: int = pydantic.Field(default=8 << 20, gt=0)
    bind_host: str = "127.0.0.1"
    streaming: Literal["request", "layer"] = "request"
    load_failure_policy: Literal["recompute", "fail"] = "recompute"
    decode_publish: bool = True
    decode_publish_interval: int = pydantic.Field(0, ge=0)
    incremental_transfer: bool = True
    kv_connector_extra_config: dict[str, Any] = pydantic.Field(default_factory=dict)
