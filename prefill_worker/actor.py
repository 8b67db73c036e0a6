"""The prefill Ray actor: a thin adapter over a prefill instance's engine core
(prefill_worker.instance), whose engine loop
(engine.core.engine_loop) runs on its own thread, the thread that also built the model.

A threaded (not async) actor: `prefill` waits for its result on one of Ray's actor threads
while the engine loop batches it with the others. Create it with `.options(max_concurrency=k)`:
k bounds the prefills queued on the engine at once. Every other method runs in a concurrency
group of its own ("control"), so aborts and stats are answered while k prefills wait.
"""

from __future__ import annotations

import logging
import os
from typing import Iterator

import ray

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.core.engine_core import EngineCore
from pdcluster.engine.core.engine_loop import EngineLoop
from pdcluster.engine.core.stats import SchedulerStats
from pdcluster.engine.logs import setup_worker_logging
from pdcluster.engine.protocol import FirstToken, PrefillRequest, PrefillResult
from pdcluster.engine.runner import ModelRunner
from pdcluster.engine.tp_instance import TPInstance
from pdcluster.kvstore.actor import kvstore_actor
from pdcluster.kvstore.client import KVStoreClient
from pdcluster.kvstore.config import KVStoreConfig, KVTransferConfig
from pdcluster.kvstore.transport.registry import (connector_class, create_connector,
                                                  prefill_connector_names)
from pdcluster.kvstore.transport.context import KVConnectorContext
from pdcluster.kvstore.index import open_index
from pdcluster.kvstore.node_client import NodeStoreClient
from pdcluster.kvstore.pool_config import KVPoolConfig
from pdcluster.kvstore.remote import RemoteStores
from pdcluster.kvstore.transport.peers import RayStreamPeers, register_self
from pdcluster.prefill_worker.instance import prefill_core, submit_prefill

log = logging.getLogger(__name__)

class PrefillWorker:
    """One prefill instance, using its node's KV store actor. With
    engine_config.tensor_parallel_size k > 1 this actor is rank 0 of the TP instance (see
    DecodeWorker); it publishes full blocks (every KV head, gathered from the ranks), so the KV
    pool's layout does not depend on TP, and loads cached prefixes by scattering head slices.

    transfer: the KV transfer settings (``--kv-transfer``), shared by every worker; with
    ``torch`` each request naming a decode peer has its blocks pushed to that peer over their
    pair channel, for as long as the store keeps a tail (``kv_config.tail_ttl_s``). None: gRPC.
    With ``transfer.streaming == "layer"`` (TP=1 only; at TP>1 whole requests, logged), each
    layer's KV goes to the request's decode peer while the prefill computes.
    """

    def __init__(self, worker_id: str, engine_config: EngineConfig, kv_config: KVStoreConfig,
                 pool_config: KVPoolConfig, ray_namespace: str | None = None,
                 transfer: KVTransferConfig | None = None) -> None:
        setup_worker_logging()  # --log-level / --log-format, as the gateway logs
        self.tp = TPInstance(engine_config)
        timeout = kv_config.rpc_timeout_s
        node_id = ray.get_runtime_context().get_node_id()
        store = kvstore_actor(node_id, ray_namespace)
        address = ray.get(store.address.remote(), timeout=30)
        transfer = transfer or KVTransferConfig()
        index = open_index(pool_config.index_url,
                           **pool_config.index_options(transfer.bind_host))
        self.worker_id, self.node_id = worker_id, node_id
        names = prefill_connector_names(transfer, self.tp.size)
        streams = any(connector_class(name).uses_layer_hooks for name in names)
        if transfer.streaming == "layer" and not streams:
            log.warning("--kv-streaming layer needs --prefill-tp 1; %s transfers whole "
                        "requests", worker_id)
        # the decode finds this worker by id to cancel a stream it gave up
        self._peer_entry = register_self(worker_id, ray_namespace) if streams else None
        self.kv_address = address
        ctx = KVConnectorContext(
            worker_id, node_id, kv_config, transfer,
            token_budget=engine_config.max_num_batched_tokens,
            store_client=KVStoreClient(address, timeout_s=timeout, token=kv_config.token,
                                       tls=kv_config.tls),
            store_address=address, local_store=NodeStoreClient(store, timeout), index=index,
            remote=RemoteStores(ray_namespace, kv_config.token, timeout, kv_config.tls),
            peers=RayStreamPeers(ray_namespace, timeout), ray_namespace=ray_namespace)

        def build() -> EngineCore:  # on the engine loop's thread
            runner = ModelRunner(engine_config, tp=self.tp.group)
            self.tp.start(runner)
            ctx.device = runner.kv_cache.device.type
            return prefill_core(runner, create_connector(names, ctx), worker_id, os.getpid(),
                                index, node_id, transfer.load_failure_policy)

        self.loop = EngineLoop(build, "prefill-engine", freeze_heap=True)
        self.engine = self.loop.core

    def prefill(self, request: PrefillRequest) -> Iterator[FirstToken | PrefillResult]:
        """A Ray streaming generator (``.options(num_returns="streaming")``): the FirstToken
        as soon as it is sampled, then the PrefillResult once the prompt's KV is published.
        Raises (on the item it concerns) RequestRejected, RequestAborted or KVStoreError."""
        first, result = submit_prefill(self.engine, request)
        yield first.result()
        yield result.result()

    @ray.method(concurrency_group="control")
    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    @ray.method(concurrency_group="control")
    def cancel_layer_stream(self, request_id: str) -> None:
        """The decode peer gave the request up (layer streaming)."""
        self.engine.abort(request_id)

    @ray.method(concurrency_group="control")
    def info(self) -> dict:
        return {"worker_id": self.worker_id, "pid": os.getpid(), "role": "prefill",
                "node_id": self.node_id,
                "kv_address": self.kv_address,
                "tp_size": self.tp.size}

    @ray.method(concurrency_group="control")
    def stats(self) -> SchedulerStats:
        return self.engine.stats()

    @ray.method(concurrency_group="control")
    def reset_prefix_cache(self) -> bool:
        """Drop this worker's G1 prefix cache (vLLM's reset_prefix_cache); False, changing
        nothing, while a prefill holds blocks."""
        return self.engine.reset_prefix_cache()


def prefill_actor(cls: type[PrefillWorker] = PrefillWorker):
    """The Ray actor class of ``cls`` (PrefillWorker or a subclass): its control methods in a
    concurrency group of their own, so aborts and stats are answered while prefills wait."""
    return ray.remote(concurrency_groups={"control": 2})(cls)
