"""A decode instance: the engine core (engine.core.engine_core) whose requests arrive with the
prefill's first token and KV transfer params, or colocated, with neither.

Its connectors, as one MultiConnector, in the order a request is matched:

1. fetch (kvstore.transport.fetch): a request from a prefill pulls its prompt's KV (after the
   blocks cached here, where the path allows) over the transport the prefill offered, and
   computes it here if the fetch fails;
2. pool-load (kvstore.transport.pool.connector, with an index): a prompt computed here loads
   its cached prefix from the pool after this worker's own hits, as a prefill's would, so where
   a request runs never changes what it can reuse;
3. publish (kvstore.transport.pool.publish, with ``--kv-decode-publish``): a normally finished
   sequence's new full blocks go to the pool, so the next turn reuses the reply.

With layer streaming, streams announced before their request comes land in blocks reserved
for them (decode_worker.kv_streams, the engine's pre-arrival KV).
"""

from __future__ import annotations

from pdcluster.decode_worker.kv_streams import PendingStreams
from pdcluster.engine.core.engine_core import EngineCore
from pdcluster.engine.core.kv_connector import KVConnector
from pdcluster.engine.runner import ModelRunner
from pdcluster.kvstore.transport.fetch import FetchConnector
from pdcluster.kvstore.transport.multi import MultiConnector
from pdcluster.kvstore.index import KVIndex, Location
from pdcluster.kvstore.index.device_feed import device_feed
from pdcluster.kvstore.transport.peers import StreamPeers
from pdcluster.kvstore.transport.layer_stream.stream import LayerStreamAnnounce

#: The prefix cache's events go to the index at most this often (a decode's allocations evict
#: cached blocks at nearly every step).
INDEX_BATCH_S = 0.1


def decode_core(runner: ModelRunner, worker_id: str, pid: int, fetch: FetchConnector,
                prefix_loader: KVConnector | None = None, publisher: KVConnector | None = None,
                index: KVIndex | None = None, node_id: str = "local-node",
                kv_load_failure_policy: str = "recompute", publish_interval: int = 0,
                peers: StreamPeers | None = None, layer_streams: bool = False) -> EngineCore:
    """The engine of a decode instance over ``fetch``, ``prefix_loader`` and ``publisher``
    (None: not run). ``index`` / ``node_id``: where the prefix cache's events go, as
    (node_id, "device", worker_id). ``publish_interval``: with a publisher, a running
    sequence's blocks also go out every this many full blocks. ``layer_streams``: take layer
    streams announced before their request (``peers``: how to tell a prefill one is dropped)."""
    connector = MultiConnector([c for c in (fetch, prefix_loader, publisher) if c is not None])
    core = EngineCore(runner, connector, worker_id, pid,
                      device_feed(index, Location(node_id, "device", worker_id), INDEX_BATCH_S),
                      kv_load_failure_policy,
                      publish_interval=publish_interval if publisher is not None else 0)
    if layer_streams:
        core.pre_arrival = PendingStreams(core.scheduler, fetch, peers,
                                          orphan_s=fetch.transfer.timeout_s)
    return core


def expect_layer_stream(core: EngineCore, announce: LayerStreamAnnounce) -> None:
    """A prefill announces a request's layer stream (--kv-streaming layer); ignored by an
    engine that takes none. Any thread."""
    streams = core.pre_arrival
    if streams is not None:
        core.call_soon(lambda: streams.expect(announce))


def cancel_layer_stream(core: EngineCore, request_id: str) -> None:
    """The prefill gave an announced layer stream up: dropped unless its request came. Any
    thread."""
    streams = core.pre_arrival
    if streams is not None:
        core.call_soon(lambda: core.scheduler.find_waiting(request_id) is None
                       and streams.drop(request_id))
