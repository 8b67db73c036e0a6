"""What a worker reports of itself (vLLM v1's ``SchedulerStats``): one typed record that every
reader, the gateway's Conductor and stall watch, /metrics, the autoscaler and
``pdcluster cluster status``, reads by attribute, so renaming a field fails where it is read
instead of silently zeroing the Conductor's input.

Counters (``*_total``) count from the worker's start; the rest are gauges at the call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SchedulerStats:
    """One worker's engine core: its queues, its block pool, its steps and its connectors.

    Attributes:
        worker_id, pid: who reports.
        num_waiting: requests queued, or whose grammar compiles before they queue.
        num_active: admitted requests (holding blocks: waiting for KV or running).
        num_running: admitted requests that run steps.
        num_pending_prompt_tokens: prompt tokens not computed yet of queued and admitted
            requests: what the Conductor counts as this worker's prefill queue.
        num_blocks, num_free_blocks, num_used_blocks, num_cached_blocks: the G1 block pool
            (free blocks include cached ones a new request may evict).
        evictions: cached blocks the pool evicted.
        num_steps_total, num_forward_tokens_total: steps with decode rows, and those rows.
        num_prefill_steps_total, num_prefill_chunks_total, num_prefill_tokens_total: steps
            with prompt chunks, the chunks, and their tokens.
        max_prefill_chunks_per_step: the most chunks one step held.
        num_requests_total: prompts computed here.
        busy_s_total: wall seconds in steps that ran the model.
        num_sending: finished requests whose blocks the connector still sends.
        num_preemptions_total, num_recomputed_tokens_total: preemptions, and tokens computed
            again (preempted by recompute, or a failed load recomputed).
        num_prealloc_requests: requests whose KV started landing in blocks reserved for
            them before they arrived (PreArrivalKV; SGLang's decode prealloc queue).
        kv_load_failures_total: loads that failed for good, by what the KV load failure policy
            did ("recompute", "fail").
        prefix_cache_queried_tokens_total: prompt tokens looked up (vLLM's "queries").
        prefix_cache_hit_tokens_total: of those, the hits, by tier ("device", "host", ...).
        kv_blocks_reused_total: blocks of prompts from a prefill found here, not loaded.
        num_fetch_recomputes_total: prompts from a prefill computed here: their load failed.
        g1_reannouncements_total: times the pool's blocks were announced again to the index.
        kv_connector_stats: the KV connectors' own counters (KVConnector.stats), by name.
    """

    worker_id: str
    pid: int
    num_waiting: int = 0
    num_active: int = 0
    num_running: int = 0
    num_pending_prompt_tokens: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_used_blocks: int = 0
    num_cached_blocks: int = 0
    evictions: int = 0
    num_steps_total: int = 0
    num_forward_tokens_total: int = 0
    num_prefill_steps_total: int = 0
    num_prefill_chunks_total: int = 0
    max_prefill_chunks_per_step: int = 0
    num_prefill_tokens_total: int = 0
    num_requests_total: int = 0
    busy_s_total: float = 0.0
    num_sending: int = 0
    num_preemptions_total: int = 0
    num_recomputed_tokens_total: int = 0
    num_prealloc_requests: int = 0
    kv_load_failures_total: Mapping[str, int] = field(default_factory=dict)
    prefix_cache_queried_tokens_total: int = 0
    prefix_cache_hit_tokens_total: Mapping[str, int] = field(default_factory=dict)
    kv_blocks_reused_total: int = 0
    num_fetch_recomputes_total: int = 0
    g1_reannouncements_total: int = 0
    kv_connector_stats: Mapping[str, Any] = field(default_factory=dict)
