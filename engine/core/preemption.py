"""Preemption of a running request when the paged cache runs out of blocks, as policy objects
of the scheduler (vLLM's `--preemption-mode` names).

The scheduler preempts the newest running request (vLLM's policy: last come, first preempted)
and resumes preempted requests first, before any new one (first come, first served).

- recompute: drop the request's blocks; on resume, give it blocks for all its tokens with none
  computed (``num_computed_tokens`` 0): the scheduler then catches its prompt and output up in
  chunks under the step's token budget, beside the running batch, as vLLM v1 does.
- swap: copy the request's blocks to host memory and free them; on resume, copy them back.

Either way the request continues with identical output: sampling draws token t from the
random numbers of (seed, t).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from pdcluster.engine.core.kv_cache_manager import KVCacheManager, has_released
from pdcluster.engine.core.request import SchedulableRequest


class PreemptedRequest(SchedulableRequest, Protocol):
    """What resuming needs beyond scheduling: a slot for a swap's host copy."""

    swapped: torch.Tensor | None


class BlockCopier(Protocol):
    """The cache in the KV pool's layout (ModelRunner.wire_kv)."""

    device: torch.device

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor: ...

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None: ...


class PreemptionPolicy(abc.ABC):
    """How a preempted request gives its blocks up and gets its KV back.

    Attributes:
        num_recomputed_tokens_total: computed tokens whose KV a preemption dropped, so that
            the scheduler computes them again.
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
    def preempt(self, request: PreemptedRequest) -> None:
        self.kv.free(request.block_table)
        self.num_recomputed_tokens_total += request.num_computed_tokens
        request.num_computed_tokens = 0

    def resume(self, request: PreemptedRequest) -> bool:
        return self.kv.allocate_slots(request.block_table, request.num_tokens)


class SwapPreemption(PreemptionPolicy):
    def __init__(self, kv: KVCacheManager, cache: BlockCopier) -> None:
        super().__init__(kv)
        self.cache = cache

    def preempt(self, request: PreemptedRequest) -> None:
        if has_released(request.block_table):  # a sliding window's: recompute
            RecomputePreemption.preempt(self, request)
            return
        request.swapped = self.cache.read_blocks(request.block_table).cpu()
        self.kv.free(request.block_table)

    def resume(self, request: PreemptedRequest) -> bool:
        swapped = request.swapped
        if swapped is None:
            return RecomputePreemption.resume(self, request)
        needed = max(self.kv.blocks_for(request.num_tokens), swapped.shape[0])
        if needed > self.kv.num_free_blocks:
            return False
        self.kv.allocate_slots(request.block_table, needed * self.kv.block_size)
        self.cache.write_blocks(request.block_table[: swapped.shape[0]],
                                swapped.to(self.cache.device))
        request.swapped = None
        return True


#: `--preemption-mode` name -> the policy, built from the cache manager and the cache's block
#: copier (each policy takes what it uses).
PREEMPTION_MODES: dict[str, Callable[[KVCacheManager, BlockCopier], PreemptionPolicy]] = {
    "recompute": lambda kv, cache: RecomputePreemption(kv),
    "swap": lambda kv, cache: SwapPreemption(kv, cache),
}
