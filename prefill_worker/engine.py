"""Prefill engine: compute a prompt's KV, sample the first token, publish the KV blocks.

Lifecycle of a request on a prefill worker:

1. the prompt's full blocks get chained sha256 keys; the longest prefix of them cached in this
   worker's block pool (G1) is reused as is — capped so at least one prompt token is computed,
   since the first output token needs the last position's logits (vLLM does the same);
2. blocks for the rest are allocated; the next part of the prefix that G1 lacks is loaded from
   the cluster pool (this node's G2/G3, or another node's) into them (PrefixLoader);
3. the uncached suffix runs through the model in chunks of at most max_num_batched_tokens
   (chunked prefill), and output token 0 is sampled;
4. the prompt's full blocks are published to this node's G2 under their keys, and the loaded
   and computed ones are cached in G1 (their events go to the global index); the partial tail
   block goes to the node's store under a per-request handle, never keyed or indexed;
5. the request's references on its blocks are dropped — on success and on every error path;
   cached blocks stay in G1 until evicted (LRU).
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass

from engine.protocol import PrefillRequest, PrefillResult
from engine.runner import ModelRunner, SequenceChunk
from engine.sampler import SampleInput, draw_seed, sample
from kvstore.block_pool import BlockPool
from kvstore.client import KVStoreClient
from kvstore.hashing import block_keys, make_namespace
from kvstore.index import KVIndex, Location
from kvstore.publish import BlockPublisher
from prefill_worker.prefix_loader import LoadResult, PrefixLoader

log = logging.getLogger(__name__)


MAX_TRACKED_ABORTS = 4096


class PrefillRejected(ValueError):
    """The request cannot be prefilled here (empty or too long prompt, or no free blocks)."""


class RequestAborted(RuntimeError):
    """The request was aborted before its prefill ran."""


@dataclass
class PrefillKV:
    """Where a prefill worker's KV goes and comes from.

    tail_client / address / node_id: this node's KV store (gRPC), which decode workers reach;
    publisher: puts full blocks into the node's G2; loader: cluster-wide prefix reuse beyond G1
    (None: G1 only); index: receives G1 cache events as (node, "device", worker) locations.
    """

    tail_client: KVStoreClient
    address: str
    node_id: str
    publisher: BlockPublisher
    loader: PrefixLoader | None = None
    index: KVIndex | None = None


class PrefillEngine:
    """Runs prefills one at a time (a lock serializes the model) and publishes their KV."""

    def __init__(self, runner: ModelRunner, kv: PrefillKV, worker_id: str, pid: int) -> None:
        self.runner = runner
        self.kv = kv
        self.kv_client = kv.tail_client
        self.kv_address = kv.address
        self.worker_id = worker_id
        self.pid = pid
        cfg = runner.engine_config
        self.block_size = cfg.block_size
        self.max_model_len = cfg.resolved_max_model_len(runner.model_config)
        self.model_id = runner.model_config.name
        self.eos_token_ids = frozenset(runner.model_config.eos_token_ids)
        self.pool = BlockPool(cfg.num_kv_blocks, enable_caching=cfg.enable_prefix_caching)
        self._lock = threading.Lock()
        # ids aborted before their prefill ran; bounded, as aborts may name finished requests
        self._aborted: OrderedDict[str, None] = OrderedDict()
        self._abort_lock = threading.Lock()
        self.num_prefill_tokens_total = 0  # tokens run through the model
        self.num_requests_total = 0
        self.prefix_cache_queried_tokens_total = 0  # prompt tokens looked up (vLLM's "queries")
        self.prefix_cache_hit_tokens_total: Counter[str] = Counter()  # of those, by tier

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
            keys = block_keys(prompt, self.block_size,
                              make_namespace(self.model_id, request.cache_salt))
            max_hit = (len(prompt) - 1) // self.block_size  # at least one token is computed
            hit = self.pool.longest_cached_prefix(keys[:max_hit])
            num_new = math.ceil(len(prompt) / self.block_size) - len(hit)
            self.pool.touch(hit)  # hit blocks leave the free queue: count free blocks after
            if num_new > self.pool.num_free_blocks:
                self.pool.free(hit)
                raise PrefillRejected(f"prompt needs {num_new} new KV blocks, "
                                      f"{self.pool.num_free_blocks} free")
            blocks = hit + self.pool.allocate(num_new)
            try:
                loaded = self._load_prefix(keys[len(hit):max_hit], blocks[len(hit):])
                num_cached = (len(hit) + loaded.num_blocks) * self.block_size
                logits = self._run_chunks(prompt, num_cached, blocks)
                [(first_token, first_logprob)] = sample(
                    logits, [SampleInput(request.sampling, seed, prompt, ())], self.eos_token_ids)
                tail_handle, num_tail = self._publish(request, prompt, keys, blocks)
                self.pool.cache_full_blocks(blocks[len(hit): len(keys)], keys[len(hit):],
                                            keys[len(hit) - 1] if hit else None)
            finally:
                self.pool.free(blocks)
                self._send_events()
            self.num_prefill_tokens_total += len(prompt) - num_cached
            self.num_requests_total += 1
            self.prefix_cache_queried_tokens_total += len(prompt)
            self.prefix_cache_hit_tokens_total["device"] += len(hit) * self.block_size
            self.prefix_cache_hit_tokens_total.update(loaded.tokens_by_tier)
        return PrefillResult(request.request_id, first_token, self.kv_address, tuple(keys),
                             tail_handle, num_tail, num_cached, self.worker_id, self.pid,
                             first_logprob, self.kv.node_id)

    def _publish(self, request: PrefillRequest, prompt: list[int], keys: list[bytes],
                 blocks: list[int]) -> tuple[str | None, int]:
        """Full blocks to the KV store by key (the store keeps one copy of a key), the tail by
        handle. Returns (tail handle or None, tokens in the tail)."""
        data = self.runner.kv_cache.read_blocks(blocks)
        if keys:
            self.kv.publisher.publish(keys, data[: len(keys)])
        num_tail = len(prompt) - len(keys) * self.block_size
        if num_tail == 0:
            return None, 0
        handle = f"tail:{request.request_id}"
        self.kv_client.put_tail(handle, data[len(keys)], num_tail)
        return handle, num_tail

    def _run_chunks(self, prompt: list[int], start: int, blocks: list[int]):
        """Positions start.. of the prompt through the model in chunks of at most
        max_num_batched_tokens (vLLM's chunked prefill): each chunk attends to the KV the
        earlier ones wrote. Returns the last chunk's last-token logits."""
        budget = self.runner.engine_config.max_num_batched_tokens
        while True:
            end = min(len(prompt), start + budget)
            logits = self.runner.execute([SequenceChunk(tuple(prompt[start:end]), start, blocks)])
            if end == len(prompt):
                return logits
            start = end

    def reset_prefix_cache(self) -> bool:
        """Drop every G1 key (refused while a prefill holds blocks); the index hears of it."""
        with self._lock:
            ok = self.pool.reset_prefix_cache()
            self._send_events()
            return ok

    def _load_prefix(self, keys: list[bytes], dest_blocks: list[int]):
        """Cluster-pool part of the prefix (after the G1 hits) into dest_blocks."""
        if self.kv.loader is None or not keys or not self.pool.enable_caching:
            return LoadResult()
        result = self.kv.loader.load(keys, dest_blocks)
        for failure in result.failures:
            log.warning("prefix load cut short, recomputing the rest: %s", failure)
        return result

    def _send_events(self) -> None:
        events = self.pool.take_events()
        if self.kv.index is None or not events:
            return
        try:
            self.kv.index.apply_events(Location(self.kv.node_id, "device", self.worker_id),
                                       events)
        except Exception as exc:  # noqa: BLE001 — an index outage costs hits, not requests
            log.warning("G1 events not indexed: %s", exc)

    def stats(self) -> dict:
        return {"worker_id": self.worker_id, "pid": self.pid,
                **self.pool.stats(),
                "num_prefill_tokens_total": self.num_prefill_tokens_total,
                "num_requests_total": self.num_requests_total,
                "prefix_cache_queried_tokens_total": self.prefix_cache_queried_tokens_total,
                "prefix_cache_hit_tokens_total": dict(self.prefix_cache_hit_tokens_total)}
