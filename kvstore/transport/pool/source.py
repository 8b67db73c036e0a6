"""The pool as a decode's source: a prefilled request's keyed blocks and tail from the prefill
node's KV store, through this node's shared-memory arena when the prefill ran on this node,
else over gRPC. Every prefill publishes every block there as well (the pool is the prefix
cache), so this is every other source's fallback, and its own retry goes over gRPC."""

from __future__ import annotations

from pdcluster.kvstore.handoff import DecodeHandoff
from pdcluster.kvstore.transport.base import FetchRequest, KVReceiver, KVTransferBackend
from pdcluster.kvstore.transport.source import FetchHost, KVSource, Params
from pdcluster.kvstore.transport.layer_stream.source import LayerStreamSource
from pdcluster.kvstore.transport.pool.arena_receiver import ArenaReceiver


class PoolSource(KVSource):
    """Full blocks by key (from block ``skip_blocks`` on), then the tail by its one-shot
    handle. Paths: "arena" (first attempt, same node), "grpc", or ``store.name`` for a given
    store backend.

    Args:
        host: the fetch connector.
        store: builds the receivers of the gRPC path (default ``host.grpc``; tests give a
            backend that injects faults).
    """

    name = "pool"
    fallback = True

    def __init__(self, host: FetchHost, store: KVTransferBackend | None = None) -> None:
        super().__init__(host)
        self.store = store or host.grpc

    def offered(self, params: Params) -> bool:
        return bool(DecodeHandoff.of(params).kv_address)

    def start(self, params: Params, table: list[int], skip_blocks: int,
              attempt: int) -> tuple[str, KVReceiver]:
        prefill, host = DecodeHandoff.of(params), self.host
        if (attempt == 0 and self.store is host.grpc and host.node_client is not None
                and prefill.kv_node_id == host.node_id):
            path, receiver = "arena", ArenaReceiver(host.grpc, host.node_client)
        else:
            path, receiver = self.store.name, self.store.create_receiver()
        receiver.start(FetchRequest(prefill.kv_address, prefill.block_keys[skip_blocks:],
                                    prefill.tail_handle, prefill.num_tail_tokens),
                       host.dest(table))
        return path, receiver

    def left(self, params: Params, receiver: KVReceiver) -> None:
        self.release(params)

    def release(self, params: Params) -> None:
        """Drop the tail block on the prefill's store (in the background)."""
        prefill = DecodeHandoff.of(params)
        if prefill.tail_handle is not None:
            self.host.grpc.release_handles(prefill.kv_address, [prefill.tail_handle])

    def bytes_moved(self, path: str, receiver: KVReceiver) -> dict[str, int]:
        total = receiver.result()
        if isinstance(receiver, ArenaReceiver):
            return {"arena": receiver.arena_bytes, "grpc": total - receiver.arena_bytes}
        return {path: total}



def pool_sources(host: FetchHost, store: KVTransferBackend) -> list[KVSource]:
    """The pool transport's sources: a layer stream through the prefill node's store, and
    the keyed blocks and tail there."""
    return [LayerStreamSource(host), PoolSource(host, store)]
