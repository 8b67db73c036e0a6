"""Prefill engine: compute a prompt's KV, sample the first token, publish the KV blocks.

Lifecycle of a request on a prefill worker:

1. blocks for the prompt are allocated in this worker's paged cache;
2. the whole prompt runs through the model in one chunk (chunked prefill and prefix reuse
   arrive with the full-strength workers and the tiered pool), and output token 0 is sampled;
3. the prompt's full blocks are published to this node's KV store under their chained sha256
   keys; the partial tail block goes there under a per-request handle, never keyed or indexed;
4. the worker's blocks are released — on success and on every error path.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict

from engine.protocol import PrefillRequest, PrefillResult
from engine.runner import ModelRunner, SequenceChunk
from engine.sampler import draw_seed, sample
from kvstore.block_pool import BlockPool
from kvstore.client import KVStoreClient
from kvstore.hashing import block_keys, make_namespace


MAX_TRACKED_ABORTS = 4096


class PrefillRejected(ValueError):
    """The request cannot be prefilled here (empty or too long prompt, or no free blocks)."""


class RequestAborted(RuntimeError):
    """The request was aborted before its prefill ran."""


class PrefillEngine:
    """Runs prefills one at a time (a lock serializes the model) and publishes their KV."""

    def __init__(self, runner: ModelRunner, kv_client: KVStoreClient, kv_address: str,
                 worker_id: str, pid: int) -> None:
        self.runner = runner
        self.kv_client = kv_client
        self.kv_address = kv_address
        self.worker_id = worker_id
        self.pid = pid
        cfg = runner.engine_config
        self.block_size = cfg.block_size
        self.max_model_len = cfg.resolved_max_model_len(runner.model_config)
        self.model_id = runner.model_config.name
        self.pool = BlockPool(cfg.num_kv_blocks)
        self._lock = threading.Lock()
        # ids aborted before their prefill ran; bounded, as aborts may name finished requests
        self._aborted: OrderedDict[str, None] = OrderedDict()
        self._abort_lock = threading.Lock()
        self.num_prefill_tokens_total = 0
        self.num_requests_total = 0

    def abort(self, request_id: str) -> None:
        """Idempotent: a request not yet started is skipped when its turn comes."""
        with self._abort_lock:
            self._aborted[request_id] = None
            while len(self._aborted) > MAX_TRACKED_ABORTS:
                self._aborted.popitem(last=False)

    def prefill(self, request: PrefillRequest) -> PrefillResult:
        """Run one request's prefill. Raises PrefillRejected, RequestAborted or KVStoreError."""
        prompt = list(request.prompt_token_ids)
        if not prompt:
            raise PrefillRejected("prompt is empty")
        if len(prompt) > self.max_model_len:
            raise PrefillRejected(f"prompt has {len(prompt)} tokens, max_model_len is "
                                  f"{self.max_model_len}")
        seed = request.sampling.seed if request.sampling.seed is not None else draw_seed()
        with self._lock:
            with self._abort_lock:
                aborted = self._aborted.pop(request.request_id, False) is None
            if aborted:
                raise RequestAborted(request.request_id)
            num_blocks = math.ceil(len(prompt) / self.block_size)
            if num_blocks > self.pool.num_free_blocks:
                raise PrefillRejected(f"prompt needs {num_blocks} KV blocks, "
                                      f"{self.pool.num_free_blocks} free")
            blocks = self.pool.allocate(num_blocks)
            try:
                logits = self.runner.execute([SequenceChunk(tuple(prompt), 0, blocks)])
                first_token = sample(logits, [request.sampling], [seed], [0])[0]
                keys, tail_handle, num_tail = self._publish(request, prompt, blocks)
            finally:
                self.pool.free(blocks)
            self.num_prefill_tokens_total += len(prompt)
            self.num_requests_total += 1
        return PrefillResult(request.request_id, first_token, self.kv_address, tuple(keys),
                             tail_handle, num_tail, len(prompt), self.worker_id, self.pid)

    def _publish(self, request: PrefillRequest, prompt: list[int],
                 blocks: list[int]) -> tuple[list[bytes], str | None, int]:
        namespace = make_namespace(self.model_id, request.cache_salt)
        keys = block_keys(prompt, self.block_size, namespace)
        data = self.runner.kv_cache.read_blocks(blocks)
        if keys:
            self.kv_client.put_blocks(keys, data[: len(keys)])
        num_tail = len(prompt) - len(keys) * self.block_size
        if num_tail == 0:
            return keys, None, 0
        handle = f"tail:{request.request_id}"
        self.kv_client.put_tail(handle, data[len(keys)], num_tail)
        return keys, handle, num_tail

    def stats(self) -> dict:
        return {"worker_id": self.worker_id, "pid": self.pid,
                "num_free_blocks": self.pool.num_free_blocks,
                "num_prefill_tokens_total": self.num_prefill_tokens_total,
                "num_requests_total": self.num_requests_total}
