"""The decode Ray actor: an async actor over a decode instance's engine core
(decode_worker.instance), whose engine loop
(engine.core.engine_loop) runs on its own thread, the thread that also built the model.

Each gateway opens one `outputs` stream (a Ray streaming generator) per decode worker and
`submit`s requests under its subscriber id; the stream yields every step's deltas for that
gateway's requests as one item (decode_worker.outputs). On client disconnect the gateway calls
the idempotent `abort(request_id)`, or the request would hold its blocks until it finished for
nobody.
"""

from __future__ import annotations

import asyncio
import os
from typing import AsyncIterator

import ray

from pdcluster.decode_worker.instance import cancel_layer_stream, decode_core, expect_layer_stream
from pdcluster.decode_worker.outputs import SubscriberOutputs
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.core.engine_core import EngineCore
from pdcluster.engine.core.engine_loop import EngineLoop
from pdcluster.engine.core.request import Request
from pdcluster.engine.core.stats import SchedulerStats
from pdcluster.engine.logs import setup_worker_logging
from pdcluster.engine.protocol import DecodeRequest, TokenDelta
from pdcluster.engine.runner import ModelRunner
from pdcluster.engine.tp_instance import TPInstance
from pdcluster.kvstore.actor import kvstore_actor
from pdcluster.kvstore.config import KVStoreConfig, KVTransferConfig
from pdcluster.kvstore.transport.registry import create_connector
from pdcluster.kvstore.transport.context import KVConnectorContext
from pdcluster.kvstore.transport.fetch import FetchConnector
from pdcluster.kvstore.index import open_index
from pdcluster.kvstore.node_client import NodeStoreClient
from pdcluster.kvstore.pool_config import KVPoolConfig
from pdcluster.kvstore.remote import RemoteStores
from pdcluster.kvstore.transport.peers import RayStreamPeers, register_self
from pdcluster.kvstore.transport.layer_stream.stream import LayerStreamAnnounce


class DecodeWorker:
    """One decode instance; with engine_config.tensor_parallel_size k > 1 this actor is its
    rank 0 (the scheduler; it creates ranks 1..k-1, engine.tp_instance) and must be created in
    the instance's placement group (deploy.placement.tp_rank_options(pg, 0)). Rank 0 fetches
    each request's blocks in the KV pool's layout and scatters the KV-head slices to the ranks.

    transfer: the KV transfer settings (``--kv-transfer``), shared by every worker; None: gRPC
    with the KV store's rpc_timeout_s as its deadline. pool_config: where the global KV index
    is, to which the prefix cache of this worker's device blocks is announced (None: the
    cache works unindexed, and the Conductor cannot see it). The KV plane's token, TLS and message
    size are always kv_config's. With ``transfer.streaming == "layer"`` the actor
    registers itself (kvstore.transport.peers) so prefills can announce their layer streams.
    """

    def __init__(self, worker_id: str, engine_config: EngineConfig, kv_config: KVStoreConfig,
                 ray_namespace: str | None = None,
                 transfer: KVTransferConfig | None = None,
                 pool_config: KVPoolConfig | None = None) -> None:
        setup_worker_logging()  # --log-level / --log-format, as the gateway logs
        self.tp = TPInstance(engine_config)
        node_id = ray.get_runtime_context().get_node_id()
        timeout = kv_config.rpc_timeout_s
        transfer = transfer or KVTransferConfig(timeout_s=timeout)
        self.worker_id = worker_id
        self._peer_entry = None

        def build() -> EngineCore:
            # on the engine loop's thread: what waits on other actors (Ray calls) never runs
            # on this async actor's event loop
            node_client = NodeStoreClient(kvstore_actor(node_id, ray_namespace), timeout)
            peers = None
            if transfer.streaming == "layer":
                self._peer_entry = register_self(worker_id, ray_namespace)
                peers = RayStreamPeers(ray_namespace, timeout)
            index = (open_index(pool_config.index_url,
                                **pool_config.index_options(transfer.bind_host))
                     if pool_config is not None and engine_config.enable_prefix_caching
                     else None)
            runner = ModelRunner(engine_config, tp=self.tp.group)
            self.tp.start(runner)
            context = KVConnectorContext(
                worker_id, node_id, kv_config, transfer, local_store=node_client, index=index,
                remote=RemoteStores(ray_namespace, kv_config.token, timeout, kv_config.tls),
                device=runner.kv_cache.device.type)
            self.fetch = self._fetch_connector(context)
            publisher = (create_connector(["publish"], context) if transfer.decode_publish
                         else None)
            # prompts computed here load their cached prefix from the pool, as a prefill does
            loader = create_connector(["pool-load"], context) if index is not None else None
            return decode_core(runner, worker_id, os.getpid(), self.fetch, loader, publisher,
                               index, node_id, transfer.load_failure_policy,
                               transfer.decode_publish_interval, peers,
                               layer_streams=transfer.streaming == "layer")

        self.loop = EngineLoop(build, "decode-engine", freeze_heap=True)
        self.engine = self.loop.core
        self._outputs: SubscriberOutputs | None = None  # made on the event loop, at first use

    async def submit(self, request: DecodeRequest, subscriber: str) -> None:
        """Queues the request; its TokenDelta items come out of `outputs(subscriber)`."""
        emit = self._subscribers().add(subscriber, request.request_id)
        self.engine.add_request(Request.of_decode(request, emit))

    async def outputs(self, subscriber: str) -> AsyncIterator[list[TokenDelta]]:
        """Streaming generator of the subscriber's token deltas, a list per engine step
        (decode_worker.outputs); every request the subscriber submitted ends with a delta that
        has finish_reason set; deltas emitted before it opens wait for it. Closing it aborts the
        subscriber's unfinished requests."""
        async for batch in self._subscribers().stream(subscriber):
            yield batch

    def _subscribers(self) -> SubscriberOutputs:
        if self._outputs is None:  # on the actor's event loop, which __init__ does not run on
            self._outputs = SubscriberOutputs(asyncio.get_running_loop(), self.engine.abort)
        return self._outputs

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def expect_layer_stream(self, announce: LayerStreamAnnounce) -> None:
        """A prefill announces a request's layer stream (--kv-streaming layer)."""
        expect_layer_stream(self.engine, announce)

    async def cancel_layer_stream(self, request_id: str) -> None:
        """The prefill gave an announced layer stream up."""
        cancel_layer_stream(self.engine, request_id)

    async def info(self) -> dict:
        return {"worker_id": self.worker_id, "pid": os.getpid(), "role": "decode",
                "node_id": ray.get_runtime_context().get_node_id(), "tp_size": self.tp.size}

    async def stats(self) -> SchedulerStats:
        return self.engine.stats()

    def _fetch_connector(self, context: KVConnectorContext) -> FetchConnector:
        """The connector that takes each request's KV from its prefill (a subclass's to
        override: tests perturb what arrives)."""
        return FetchConnector.from_context(context)


def decode_actor(cls: type[DecodeWorker] = DecodeWorker):
    """The Ray actor class of ``cls`` (DecodeWorker or a subclass)."""
    return ray.remote(cls)
