"""A transport defined only here and registered through kvstore.transport.registry, to prove
that a transport is one package and one entry: the prefill's half keeps a request's blocks
in this process (a dict), the decode's half copies them into the reserved blocks on a thread
of its own. Its kv_transfer_params key, ``loopback``, is read by nothing else."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

import torch

from pdcluster.engine.core.kv_connector import KVConnector, KVConnectorRequest
from pdcluster.kvstore.errors import KVTransferError
from pdcluster.kvstore.handoff import DecodeHandoff
from pdcluster.kvstore.transport.base import (FetchRequest, KVReceiver, KVTransferBackend,
                                              TransferState)
from pdcluster.kvstore.transport.registry import Transport
from pdcluster.kvstore.transport.source import FetchHost, KVSource, Params

PARAM = "loopback"
#: what the prefill half offered, by handle: the blocks (whole prompt) and whether to hold
#: them back (a sender that never sends: only the deadline ends the receive)
OFFERED: dict[str, tuple[torch.Tensor, bool]] = {}
_handles = itertools.count()

#: the registry entry (a test registers it under "loopback")
LOOPBACK = Transport(f"{__name__}:LoopbackBackend", f"{__name__}:loopback_sources",
                     ("loopback",))


class LoopbackConnector(KVConnector):
    """Prefill half: offers every block of the prompt (a copy) under a fresh handle."""

    withhold = False

    def request_finished(self, request: KVConnectorRequest, block_ids: Sequence[int]
                         ) -> tuple[bool, dict]:
        handle = f"loop-{next(_handles)}"
        OFFERED[handle] = (self.cache.read_blocks(list(block_ids)).clone(), self.withhold)
        return False, {PARAM: handle}


class LoopbackReceiver(KVReceiver):
    def __init__(self, timeout_s: float) -> None:
        super().__init__()
        self._timeout_s = timeout_s

    def start(self, request: FetchRequest, dest) -> None:
        self._accept(request, dest, self._timeout_s)
        blocks, withhold = OFFERED.get(request.address, (None, False))
        if withhold:
            return  # never sends: the deadline fails it
        threading.Thread(target=self._guarded, args=(self._copy, blocks, dest),
                         daemon=True).start()

    def _copy(self, blocks: torch.Tensor | None, dest) -> None:
        if blocks is None:
            raise KVTransferError("nothing offered under this handle",
                                  address=self.request.address)
        for i in range(blocks.shape[0]):
            self._write(dest.write_tensor, i, blocks[i:i + 1])
            self._add_bytes(blocks[i].numel() * blocks.element_size())
        self._set_state(TransferState.SUCCESS)


class LoopbackBackend(KVTransferBackend):
    name = "loopback"

    def create_receiver(self) -> LoopbackReceiver:
        return LoopbackReceiver(self.config.timeout_s)


class LoopbackSource(KVSource):
    name = "loopback"
    pushed = True

    def __init__(self, host: FetchHost, backend: LoopbackBackend) -> None:
        super().__init__(host)
        self.backend = backend

    def offered(self, params: Params) -> bool:
        return params.get(PARAM) is not None

    def start(self, params: Params, table: list[int], skip_blocks: int,
              attempt: int) -> tuple[str, KVReceiver]:
        prefill = DecodeHandoff.of(params)
        receiver = self.backend.create_receiver()
        receiver.start(FetchRequest(params[PARAM], prefill.block_keys, prefill.tail_handle,
                                    prefill.num_tail_tokens), self.host.dest(table))
        return self.name, receiver

    def release(self, params: Params) -> None:
        OFFERED.pop(params[PARAM], None)

    def left(self, params: Params, receiver: KVReceiver) -> None:
        self.release(params)


def loopback_sources(host: FetchHost, backend: LoopbackBackend) -> list[KVSource]:
    return [LoopbackSource(host, backend)]
