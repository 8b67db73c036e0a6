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
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from decode_worker.kv_fetch import KVFetch
from kvstore.transfer.layer_stream import LayerStreamAnnounce
from kvstore.transfer.peers import StreamPeers

if TYPE_CHECKING:  # the engine imports this module
    from decode_worker.engine import DecodeEngine, DecodeSequence

log = logging.getLogger(__name__)

MAX_TRACKED_IDS = 4096


@dataclass
class PendingStream:
    announce: LayerStreamAnnounce
    block_table: list[int]
    fetch: KVFetch
    done_at: float | None = None  # time.monotonic() when its receiver finished


class PendingStreams:
    """Announced layer streams without their request yet; see the module docstring.

    Args:
        engine: the decode engine (its pool, fetcher and waiting queue).
        peers: to tell a prefill its stream is no longer wanted (None: nobody to tell).
        orphan_s: how long a finished stream waits for its request before it is dropped.
    """

    def __init__(self, engine: "DecodeEngine", peers: StreamPeers | None,
                 orphan_s: float) -> None:
        self.engine, self.peers, self.orphan_s = engine, peers, orphan_s
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
        receiver = None if pending is None else pending.fetch.layer_receiver
        if receiver is None:
            return None
        return {"pending": True, "num_taken": receiver.num_taken,
                "num_pieces": len(pending.announce.pieces)}

    def seen(self, request_id: str) -> None:
        """The request reached the engine (or ended): a later announce of it is ignored."""
        self._seen[request_id] = None
        while len(self._seen) > MAX_TRACKED_IDS:
            self._seen.popitem(last=False)

    def expect(self, announce: LayerStreamAnnounce) -> None:
        rid, engine = announce.request_id, self.engine
        if rid in self._seen or rid in self._streams:
            return
        needed = math.ceil((announce.num_prompt_tokens + 1) / engine.block_size)
        preempted = any(s.status.name == "PREEMPTED" for s in engine._waiting)
        if preempted or needed > engine.pool.num_free_blocks:
            return  # taken at admission instead
        table = engine.pool.allocate(needed)
        self._streams[rid] = PendingStream(announce, table,
                                           engine.fetcher.start_stream(announce, table))

    def take(self, seq: "DecodeSequence") -> PendingStream | None:
        """The stream announced for seq, if it may be attached; a stream seq's PrefillResult
        does not name (the prefill gave it up) is dropped."""
        pending = self._streams.get(seq.request_id)
        if pending is None:
            return None
        if seq.request.prefill is None or seq.request.prefill.layer_stream is None:
            self.drop(seq.request_id)
            return None
        return self._streams.pop(seq.request_id)

    def drop(self, request_id: str, tell_prefill: bool = False) -> bool:
        """Abort the stream, free its blocks (now: nothing more is written to them)."""
        self.seen(request_id)
        pending = self._streams.pop(request_id, None)
        if pending is None:
            return False
        pending.fetch.abort()
        self.engine.pool.free(pending.block_table)
        if tell_prefill and self.peers is not None:
            self.peers.cancel_at_prefill(pending.announce.prefill_worker_id, request_id)
        return True

    def attach_waiting(self) -> None:
        """Waiting requests whose stream was announced hold their blocks already: they move
        to WAITING_FOR_KV at once, out of turn (unless they end at admission)."""
        engine = self.engine
        for seq in list(engine._waiting):
            if seq.status.name == "PREEMPTED" or seq.request_id not in self._streams:
                continue
            if (seq.output_ids and engine._check_stop(seq) is not None) \
                    or engine._blocks_at_most(seq) > engine.pool.num_blocks:
                self.drop(seq.request_id)  # it ends at admission, fetching nothing
                continue
            pending = self.take(seq)
            if pending is not None:
                engine._waiting.remove(seq)
                engine._active[seq.request_id] = seq
                seq.block_table = pending.block_table
                pending.fetch.attach(seq.request.prefill)
                engine._start_waiting_for_kv(seq, pending.fetch)

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
