"""Preemption of a running request when the paged cache runs out of blocks, as policy objects
of the scheduler (vLLM's `--preemption-mode` names).

The scheduler preempts the newest running request (vLLM's policy: last come, first preempted)
and resumes preempted requests first, before any new one (first come, first served).

- recompute: drop the request's blocks; on resume, re-prefill prompt + generated tokens on this
  worker (chunked by max_num_batched_tokens) and continue.
- swap: copy the request's blocks to host memory and free them; on resume, copy them back.

Either way the request continues with identical output: its KV is rebuilt bit for bit (same
kernels, same positions) and sampling draws token t from the (seed, t) stream.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import SchedulableRequest


class PreemptedRequest(SchedulableRequest, Protocol):
    """What resuming needs beyond scheduling: the tokens whose KV the request holds (prompt
    plus every output token but the last, which the next step feeds), and a slot for a swap."""

    swapped: torch.Tensor | None

    def kv_token_ids(self) -> list[int]: ...


class LocalPrefill(Protocol):
    """Runs `tokens` through the model from position 0 into `block_table`, in chunks (their
    KV only)."""

    def __call__(self, tokens: Sequence[int], block_table: Sequence[int]) -> None: ...


class BlockCopier(Protocol):
    """The cache in the KV pool's layout (ModelRunner.wire_kv)."""

    device: torch.device

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor: ...

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None: ...


class PreemptionPolicy(abc.ABC):
    """How a preempted request gives its blocks up and gets its KV back.

    Attributes:
        num_recomputed_tokens_total: tokens run through the model again on resume.
    """

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.num_recomputed_tokens_total = 0

    @abc.abstractmethod
    def preempt(self, request: PreemptedRequest) -> None:
        """Release the request's blocks (keeping whatever resume needs)."""

    @abc.abstractmethod
    def resume(self, request: PreemptedRequest) -> bool:
        """Give the request blocks again and restore its KV; False (nothing taken) if they do
        not fit."""


class RecomputePreemption(PreemptionPolicy):
    def __init__(self, kv: KVCacheManager, prefill: LocalPrefill) -> None:
        super().__init__(kv)
        self.prefill = prefill

    def preempt(self, request: PreemptedRequest) -> None:
        self.kv.free(request.block_table)

    def resume(self, request: PreemptedRequest) -> bool:
        if not self.kv.allocate_slots(request.block_table, request.num_tokens):
            return False
        tokens = request.kv_token_ids()
        self.prefill(tokens, request.block_table)
        self.num_recomputed_tokens_total += len(tokens)
        return True


class SwapPreemption(PreemptionPolicy):
    def __init__(self, kv: KVCacheManager, cache: BlockCopier) -> None:
        super().__init__(kv)
        self.cache = cache

    def preempt(self, request: PreemptedRequest) -> None:
        request.swapped = self.cache.read_blocks(request.block_table).cpu()
        self.kv.free(request.block_table)

    def resume(self, request: PreemptedRequest) -> bool:
        swapped = request.swapped
        needed = max(self.kv.blocks_for(request.num_tokens), swapped.shape[0])
        if needed > self.kv.num_free_blocks:
            return False
        self.kv.allocate_slots(request.block_table, needed * self.kv.block_size)
        self.cache.write_blocks(request.block_table[: swapped.shape[0]],
                                swapped.to(self.cache.device))
        request.swapped = None
        return True


#: `--preemption-mode` name -> the policy, built from the cache manager, a local prefill and
#: the cache's block copier (each policy takes what it uses).
PREEMPTION_MODES: dict[str, Callable[[KVCacheManager, LocalPrefill, BlockCopier],
                                     PreemptionPolicy]] = {
    "recompute": lambda kv, prefill, cache: RecomputePreemption(kv, prefill),
    "swap": lambda kv, prefill, cache: SwapPreemption(kv, cache),
}
