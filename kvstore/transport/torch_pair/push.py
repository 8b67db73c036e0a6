"""The torch pair connector (``--kv-transfer torch``): pushes a prefill's KV blocks to its
decode peer over a torch.distributed pair channel (NCCL on GPU, gloo on CPU), beside the copy
the pool connector saves to the KV store (the decode's fallback, and the prefix cache)."""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence

from pydantic import SecretStr

from pdcluster.engine.core.kv_connector import KVConnector, KVConnectorRequest
from pdcluster.kvstore.config import KVTransferConfig
from pdcluster.kvstore.transport.context import KVConnectorContext
from pdcluster.kvstore.errors import KVTransferError
from pdcluster.kvstore.handoff import PrefillHandoff
from pdcluster.kvstore.transport.torch_pair.backend import TorchKVSender
from pdcluster.kvstore.transport.torch_pair.channel import TorchPairChannel

log = logging.getLogger(__name__)


class TorchPushConnector(KVConnector):
    """Prefill side: one pair channel (rank 0) per decode peer, and one TorchKVSender per
    request (kvstore.transport.torch_pair.backend). A request without a decode peer, with
    max_tokens 1 (the decode finishes it at admission, fetching nothing) or streamed layer by
    layer (its KV went already) is not pushed.

    Pair bootstrap: a peer's channel is opened — its own TCPStore bound on a free port of
    ``transfer.bind_host``, which is quick and never waits for the peer — on the peer's first
    request; its address reaches the decode in PrefillResult.pair_address over Ray, and the
    decode joins as rank 1 when it starts receiving that request; the group forms then (both
    within ``transfer.timeout_s``). A channel a failed send closed is kept (a posted send may
    still read its tensor; torch cannot cancel it) and replaced on the peer's next request by
    a new pair at a new address. Tags: a counter per channel.

    Args:
        transfer: bind_host, timeout_s (pair setup), max_chunk_bytes (per send).
        send_deadline_s: how long a request's blocks wait to be received: the decode posts its
            receive only once it has reserved cache blocks for the request.
        device: "cpu" (gloo) or "cuda" (NCCL): where the pushed blocks are.
        token: the KV plane's token (KVStoreConfig.token, ``--kv-token``) the decode peer
            must prove before a pair forms; None: no auth (tests).
    """

    def __init__(self, transfer: KVTransferConfig, send_deadline_s: float, device: str,
                 token: SecretStr | None = None) -> None:
        self.transfer = transfer
        self.token = token
        self.send_deadline_s = send_deadline_s
        self.device = device
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[TorchPairChannel, itertools.count]] = {}
        self._retired: list[TorchPairChannel] = []
        self.pairs_opened_total = 0
        self.pushes_total = 0

    @classmethod
    def from_context(cls, ctx: KVConnectorContext) -> TorchPushConnector:
        return cls(ctx.transfer, ctx.kv_config.tail_ttl_s, ctx.device, ctx.kv_config.token)

    def request_finished(self, request: KVConnectorRequest, block_ids: Sequence[int]
                         ) -> tuple[bool, dict]:
        """Starts the push of every block of the prompt (full ones, then the tail); params
        ``pair_address`` and ``pair_tag`` (None, 0: nothing pushed, the decode pulls)."""
        peer = PrefillHandoff.of(request.kv_transfer_params).decode_peer
        if peer is None or request.max_tokens == 1 or request.runs_alone or not block_ids:
            return False, {}
        address, tag = self._push(peer, block_ids)
        return False, {"pair_address": address, "pair_tag": tag} if address else {}

    def _push(self, peer: str, block_ids: Sequence[int]) -> tuple[str | None, int]:
        """Start sending the blocks (copied out: kept until sent) to ``peer``. Returns (pair
        address, tag); (None, 0) if no pair store could be bound (logged: the decode then
        pulls from the KV store)."""
        with self._lock:
            entry = self._channels.get(peer)
            if entry is None or entry[0].closed:
                if entry is not None:
                    self._retired.append(entry[0])
                try:
                    channel = TorchPairChannel(
                        0, self.transfer.bind_host, 0, timeout_s=self.transfer.timeout_s,
                        device=self.device, token=self.token,
                        chunk_bytes=self.transfer.max_chunk_bytes)
                except KVTransferError as exc:
                    log.warning("no KV pair channel for %s, it pulls from the store: %s",
                                peer, exc)
                    return None, 0
                entry = self._channels[peer] = (channel, itertools.count())
                self.pairs_opened_total += 1
            channel, tags = entry
            tag = next(tags) % 2**31
            self.pushes_total += 1
        TorchKVSender(channel).start(self.cache.read_blocks(block_ids), tag,
                                     self.send_deadline_s)
        return channel.address, tag

    def stats(self) -> dict:
        return {"kv_pairs_opened_total": self.pairs_opened_total,
                "kv_pushes_total": self.pushes_total}

    def close(self) -> None:
        with self._lock:
            channels = [c for c, _ in self._channels.values()] + self._retired
            self._channels, self._retired = {}, []
        for channel in channels:
            channel.close()
