"""Layer streams announced to a decode worker before their request reaches it.

With ``--kv-streaming layer`` the prefill announces a request's stream (over Ray) before it
computes; the request itself (DecodeRequest, with the PrefillResult) comes later, from the
gateway. In between, the stream's cache blocks are reserved here and its pieces land in them
as each layer ends on the prefill (SGLang's decode "prealloc" queue plays the same role).

    announce ──▶ reserve blocks, take pieces ──▶ request arrives: attach (WAITING_FOR_KV)
                       │                              └─ admitted once the last piece landed
                       └─ no request within orphan_s of the stream ending, an abort, or the
                          prefill's cancel: pieces dropped, blocks freed

No room (or preempted requests waiting, which come first): nothing is reserved and the request
takes the stream at its admission instead, from the store where the pieces wait. Engine-loop
thread only.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from pdcluster.engine.core.request import Request, RequestStatus
from pdcluster.engine.core.scheduler import Scheduler
from pdcluster.kvstore.transport.fetch import FetchConnector, KVFetch
from pdcluster.kvstore.transport.peers import StreamPeers
from pdcluster.kvstore.transport.layer_stream.source import announce_of
from pdcluster.kvstore.transport.layer_stream.stream import LayerStreamAnnounce

log = logging.getLogger(__name__)

MAX_TRACKED_IDS = 4096


@dataclass
class PendingStream:
    announce: LayerStreamAnnounce
    block_table: list[int]
    fetch: KVFetch
    done_at: float | None = None  # time.monotonic() when its receiver finished


class PendingStreams:
    """Announced layer streams without their request yet (the engine's
    engine.core.engine_core.PreArrivalKV); see the module docstring.

    Args:
        scheduler: the engine's scheduler (its KV cache manager and waiting queue).
        connector: the engine's fetch connector, which starts the streams' receivers and
            adopts a stream as its request's fetch.
        peers: to tell a prefill its stream is no longer wanted (None: nobody to tell).
        orphan_s: how long a finished stream waits for its request before it is dropped.
    """

    def __init__(self, scheduler: Scheduler[Request], connector: FetchConnector,
                 peers: StreamPeers | None, orphan_s: float) -> None:
        self.scheduler, self.connector = scheduler, connector
        self.peers, self.orphan_s = peers, orphan_s
        self._streams: dict[str, PendingStream] = {}
        self._seen: OrderedDict[str, None] = OrderedDict()  # late announces are ignored
        self.orphans_total = 0

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def progress(self, request_id: str) -> dict | None:
        """{"pending": True, "num_taken", "num_pieces"} of a pending stream, else None."""
        pending = self._streams.get(request_id)
        if pending is None:
            return None
        receiver = pending.fetch.receiver
        return {"pending": True, "num_taken": receiver.num_taken,
                "num_pieces": len(pending.announce.pieces)}

    def arrived(self, request_id: str) -> None:
        """The request reached the engine (or ended): a later announce of it is ignored."""
        self._seen[request_id] = None
        while len(self._seen) > MAX_TRACKED_IDS:
            self._seen.popitem(last=False)

    def expect(self, announce: LayerStreamAnnounce) -> None:
        rid, kv = announce.request_id, self.scheduler.kv
        if rid in self._seen or rid in self._streams:
            return
        table: list[int] = []
        if self.scheduler.has_preempted() or \
                not kv.allocate_slots(table, announce.num_prompt_tokens + 1):
            return  # taken at admission instead
        fetch = self.connector.start_stream(announce, table)
        if fetch is None:  # no source here takes it: taken at admission, from the pool
            kv.free(table)
            return
        self._streams[rid] = PendingStream(announce, table, fetch)

    def take(self, request: Request) -> PendingStream | None:
        """The stream announced for the request, if it may be attached; a stream the request's
        KV transfer params do not name (the prefill gave it up) is dropped."""
        pending = self._streams.get(request.request_id)
        if pending is None:
            return None
        if request.kv_transfer_params is None or announce_of(request.kv_transfer_params) is None:
            self.drop(request.request_id)
            return None
        return self._streams.pop(request.request_id)

    def drop(self, request_id: str, tell_prefill: bool = False) -> bool:
        """Abort the stream, free its blocks (now: nothing more is written to them)."""
        self.arrived(request_id)
        pending = self._streams.pop(request_id, None)
        if pending is None:
            return False
        pending.fetch.abort()
        self.scheduler.kv.free(pending.block_table)
        if tell_prefill and self.peers is not None:
            self.peers.cancel_at_prefill(pending.announce.prefill_worker_id, request_id)
        return True

    def attach_waiting(self) -> None:
        """Waiting requests whose stream was announced hold their blocks already: they move
        to WAITING_FOR_KV at once, out of turn."""
        for seq in list(self.scheduler.waiting):
            if seq.status is RequestStatus.PREEMPTED or seq.request_id not in self._streams:
                continue
            pending = self.take(seq)
            if pending is not None:
                seq.block_table = pending.block_table
                self.scheduler.activate(seq, RequestStatus.WAITING_FOR_KV)
                self.connector.adopt(seq, pending.fetch)

    def poll(self) -> None:
        """Drop streams whose request never came (orphan_s after the stream ended)."""
        now = time.monotonic()
        for rid, pending in list(self._streams.items()):
            if pending.done_at is None:
                if pending.fetch.receiver.poll().done:
                    pending.done_at = now
            elif now - pending.done_at > self.orphan_s:
                log.warning("layer stream of %s: no request came, blocks freed", rid,
                            extra={"request_id": rid})
                self.orphans_total += 1
                self.drop(rid, tell_prefill=True)
