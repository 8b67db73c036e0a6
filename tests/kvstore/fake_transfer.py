"""A fake transfer backend for tests: in-memory blocks, no threads, failure injection.

Like SGLang's ``fake`` connector it needs no peer; unlike it, it can fail on purpose:

* ``fail_on_calls={1}``: the first receiver the backend creates fails, the next succeeds
  (a transfer that fails once, then succeeds on retry);
* ``fail_after_bytes=n``: blocks are written until ``n`` bytes have landed, then the transfer
  fails (the caller must free its partly written blocks);
* ``delay_s``: the transfer completes (or fails) only once ``delay_s`` has passed, at a
  ``poll``; a ``delay_s`` past the deadline ends in a deadline failure.

All work happens inside ``poll``, so tests are deterministic.
"""

from __future__ import annotations

import time
from collections.abc import Collection, MutableMapping

import torch

from pdcluster.kvstore.config import KVStoreConfig, KVTransferConfig
from pdcluster.kvstore.errors import BlockLayoutError, BlockNotFoundError, KVTransferError
from pdcluster.kvstore.transport.base import (FetchRequest, KVReceiver, KVTransferBackend,
                                             TransferState)
from pdcluster.kvstore.transport.dest import CallbackDest


class FakeTransferBackend(KVTransferBackend):
    """Holds the fake's blocks and counts receivers for ``fail_on_calls``.

    Attributes:
        blocks: key -> block tensor [*block_shape] (what a KV store would hold).
        tails: handle -> (tail block tensor, num_tokens); taken on success.
        calls: receivers created so far (the n-th one is call ``n``, from 1).
    """

    name = "fake"

    def __init__(self, config: KVTransferConfig | None = None,
                 kv_config: KVStoreConfig | None = None, *,
                 blocks: MutableMapping[bytes, torch.Tensor] | None = None,
                 tails: MutableMapping[str, tuple[torch.Tensor, int]] | None = None,
                 fail_on_calls: Collection[int] = (), fail_after_bytes: int | None = None,
                 delay_s: float = 0.0):
        super().__init__(config or KVTransferConfig(), kv_config)
        self.blocks = {} if blocks is None else blocks
        self.tails = {} if tails is None else tails
        self.fail_on_calls = set(fail_on_calls)
        self.fail_after_bytes = fail_after_bytes
        self.delay_s = delay_s
        self.calls = 0

    def create_receiver(self) -> FakeReceiver:
        self.calls += 1
        return FakeReceiver(self.blocks, self.tails, fail=self.calls in self.fail_on_calls,
                            fail_after_bytes=self.fail_after_bytes, delay_s=self.delay_s,
                            default_deadline_s=self.config.timeout_s)


class FakeReceiver(KVReceiver):
    """One fake transfer; see the module docstring.

    Args:
        blocks, tails: the source (see FakeTransferBackend).
        fail: fail without writing anything (with KVTransferError).
        fail_after_bytes: fail once this many bytes have been written.
        delay_s: seconds after ``start`` before the transfer completes.
        default_deadline_s: deadline when the request has none.
    """

    def __init__(self, blocks: MutableMapping[bytes, torch.Tensor],
                 tails: MutableMapping[str, tuple[torch.Tensor, int]] | None = None, *,
                 fail: bool = False, fail_after_bytes: int | None = None, delay_s: float = 0.0,
                 default_deadline_s: float = 10.0):
        super().__init__()
        self._blocks, self._tails = blocks, tails if tails is not None else {}
        self._fail_now, self._fail_after_bytes = fail, fail_after_bytes
        self._delay_s, self._default_deadline_s = delay_s, default_deadline_s
        self._ready_at = 0.0
        self._dest: CallbackDest | None = None

    def start(self, request: FetchRequest, dest: CallbackDest) -> None:
        self._dest = self._accept(request, dest, self._default_deadline_s)
        self._ready_at = time.monotonic() + self._delay_s

    def poll(self) -> TransferState:
        state = super().poll()
        if state is TransferState.TRANSFERRING and time.monotonic() >= self._ready_at:
            if self._guarded(self._transfer):
                self._succeed()
            state = self._state
        return state

    def _transfer(self) -> None:
        request, dest = self.request, self._dest
        if self._fail_now:
            raise KVTransferError(f"{self._describe()}: injected failure",
                                  address=request.address)
        missing = [k for k in request.keys if k not in self._blocks]
        if missing:
            raise BlockNotFoundError(f"{request.address}: missing {len(missing)} block(s)",
                                     missing=missing)
        blocks = [self._blocks[k] for k in request.keys]
        if request.tail_handle is not None:
            tail = self._tails.get(request.tail_handle)
            if tail is None:
                raise BlockNotFoundError(f"{request.address}: tail {request.tail_handle!r} "
                                         f"is absent", handle=request.tail_handle)
            if tail[1] != request.num_tail_tokens:
                raise BlockLayoutError(f"tail {request.tail_handle!r} holds {tail[1]} tokens, "
                                       f"expected {request.num_tail_tokens}")
            blocks.append(tail[0])
        for i, block in enumerate(blocks):
            if self._fail_after_bytes is not None and self._nbytes >= self._fail_after_bytes:
                raise KVTransferError(f"{self._describe()}: injected failure after "
                                      f"{self._nbytes} bytes", address=request.address)
            self._write(dest.write_tensor, i, block.unsqueeze(0))
            self._add_bytes(dest.block_nbytes)
        if request.tail_handle is not None:
            self._tails.pop(request.tail_handle, None)
