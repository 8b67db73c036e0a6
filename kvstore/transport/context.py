"""What a worker builds its KV connectors from (``from_context`` of every connector in the
registry, kvstore.transport.registry), so that the registry builds any of them the same way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdcluster.kvstore.client import KVStoreClient
from pdcluster.kvstore.config import KVStoreConfig, KVTransferConfig
from pdcluster.kvstore.index import KVIndex
from pdcluster.kvstore.node_store_api import NodeStore

if TYPE_CHECKING:
    from pdcluster.kvstore.remote import RemoteStores
    from pdcluster.kvstore.transport.peers import StreamPeers


@dataclass
class KVConnectorContext:
    """Everything a connector may be built from.

    worker_id / node_id: this worker and its Ray node; ray_namespace: where named actors are.
    kv_config: the KV plane (token, TLS, timeouts, tail TTL); transfer: ``--kv-transfer``.
    token_budget: tokens per step (max_num_batched_tokens): a layer stream plans its chunks.
    index: the global index (None: no cluster-wide reuse).
    local_store: this node's store as a NodeStore (same node: through its arena); None: the
        gRPC client serves (a store without Ray, as in single-process setups).
    store_client / store_address: this node's store over gRPC, which other nodes reach
        (a prefill worker's; a decode worker reaches stores through its transfer backends).
    remote: other nodes' stores by node id, or None.
    peers: how to reach decode workers, or None.
    device: where the paged cache is ("cpu" or "cuda").
    te_regions: the worker's TE staging buffer
        (kvstore.transport.mooncake.connector.RegionSource, whose ``of`` builds it for the
        first connector that needs it and shares it with the others; not named here, as that
        module builds on this one).
    """

    worker_id: str
    node_id: str
    kv_config: KVStoreConfig
    transfer: KVTransferConfig
    token_budget: int = 0
    store_client: KVStoreClient | None = None
    store_address: str = ""
    local_store: NodeStore | None = None
    index: KVIndex | None = None
    remote: RemoteStores | None = None
    peers: StreamPeers | None = None
    ray_namespace: str | None = None
    device: str = "cpu"
    te_regions: object | None = None
