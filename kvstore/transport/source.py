"""The receiving half of a transport as a decode's fetch chain runs it.

A decode worker's FetchConnector knows no transport: it asks each source of the transports it
runs whether a request's ``kv_transfer_params`` offer it (the keys that transport's sending
half wrote, read only by this source), runs the first that does, and falls back to the pool's
(vLLM's MultiConnector order: the request's transport, then the cluster pool). A transport adds
its sources to its entry in :data:`kvstore.transport.registry.TRANSPORTS`; nothing else changes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from pdcluster.kvstore.handoff import DecodeHandoff
from pdcluster.kvstore.transport.base import KVReceiver

if TYPE_CHECKING:
    from pdcluster.engine.core.kv_connector import BlockCache
    from pdcluster.kvstore.node_client import NodeStoreClient
    from pdcluster.kvstore.transport.dest import CacheDest
    from pdcluster.kvstore.transport.pool.grpc_backend import GrpcTransferBackend

Params = Mapping[str, object]


class FetchHost(Protocol):
    """What a source may use of the decode's fetch connector."""

    cache: BlockCache
    grpc: GrpcTransferBackend  # the store's channels and a background pool for releases
    node_id: str | None
    node_client: NodeStoreClient | None
    timeout_s: float

    def dest(self, table: list[int]) -> CacheDest:
        """Blocks ``table`` of the cache as a transfer's destination."""


class KVSource(ABC):
    """One way a request's prompt KV reaches the decode's reserved blocks.

    Class attributes:
        pushed: the whole prompt comes this way, sent before the decode was asked, so the
            blocks the decode holds cached cannot be skipped.
        cancellable: ``abort`` stops a started attempt at once; False where the library cannot
            cancel it (a posted torch recv, a Transfer Engine read), and the fetch settles when
            the attempt does.
        fallback: the pool: tried after any other offered source, and retried on itself.
        preference: order among offered sources (lower first): a layer stream, started
            before the request came, goes before a whole-prompt push.
    """

    name: str = ""
    pushed = False
    cancellable = True
    fallback = False
    preference = 1

    def __init__(self, host: FetchHost) -> None:
        self.host = host

    @abstractmethod
    def offered(self, params: Params) -> bool:
        """Whether ``params`` (a request's kv_transfer_params) offer this source."""

    def num_blocks(self, params: Params) -> int:
        """Request blocks the transfer fills (full ones, then the tail)."""
        return DecodeHandoff.of(params).num_blocks

    @abstractmethod
    def start(self, params: Params, table: list[int], skip_blocks: int,
              attempt: int) -> tuple[str, KVReceiver]:
        """Start moving the prompt's blocks ``skip_blocks..`` into ``table`` (the reserved
        blocks from ``skip_blocks`` on); never blocks. ``attempt``: how many times this
        source ran for the request before. Returns the path's name (stats, ``paths``) and
        its started receiver."""

    def left(self, params: Params, receiver: KVReceiver) -> None:
        """An attempt that ended without success (failed, aborted): drop what nobody will
        take from the sender."""

    def release(self, params: Params) -> None:
        """The request ended without trying this source: let go of what the sending side
        holds for it (never blocks)."""

    def bytes_moved(self, path: str, receiver: KVReceiver) -> dict[str, int]:
        """Bytes a successful attempt moved, by path."""
        return {path: receiver.result()}
