"""The torch pair as a decode's source: the prefill pushes every block of the prompt over the
pair's process group (``pair_address``, ``pair_tag`` in kv_transfer_params, written by
kvstore.transport.torch_pair.push), and the decode receives them into its reserved blocks."""

from __future__ import annotations

import torch

from pdcluster.kvstore.handoff import DecodeHandoff
from pdcluster.kvstore.transport.base import FetchRequest, KVReceiver
from pdcluster.kvstore.transport.dest import CallbackDest
from pdcluster.kvstore.transport.source import FetchHost, KVSource, Params
from pdcluster.kvstore.transport.torch_pair.backend import TorchTransferBackend


class TorchPairSource(KVSource):
    """A posted recv cannot be cancelled without tearing down the pair (and every transfer on
    it), so an aborted receive is left to finish or to fail at its deadline."""

    name = "torch"
    pushed = True
    cancellable = False

    def __init__(self, host: FetchHost, backend: TorchTransferBackend) -> None:
        super().__init__(host)
        self.backend = backend

    def offered(self, params: Params) -> bool:
        return params.get("pair_address") is not None

    def start(self, params: Params, table: list[int], skip_blocks: int,
              attempt: int) -> tuple[str, KVReceiver]:
        receiver = self.backend.create_receiver()
        receiver.start(_pushed(params), self.host.dest(table))
        return self.name, receiver

    def release(self, params: Params) -> None:
        """Drain the pushed transfer into a discarding destination, so the pair stays healthy
        instead of failing at the sender's deadline."""
        pushed, cache = _pushed(params), self.host.cache
        sink = CallbackDest(lambda start, blocks: None, pushed.num_blocks, (cache.block_nbytes,),
                            torch.uint8)
        self.backend.create_receiver().start(pushed, sink)  # its own thread, own deadline


def _pushed(params: Params) -> FetchRequest:
    prefill = DecodeHandoff.of(params)
    return FetchRequest(params["pair_address"], prefill.block_keys, prefill.tail_handle,
                        prefill.num_tail_tokens, tag=int(params.get("pair_tag", 0)))


def torch_sources(host: FetchHost, backend: TorchTransferBackend) -> list[KVSource]:
    return [TorchPairSource(host, backend)]
