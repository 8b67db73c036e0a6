"""Runs multi-turn conversations (loadtest.conversations) against an endpoint.

Every conversation runs as its own task: it sends a turn, waits for the whole reply, waits the
turn's think time, then sends the next turn with the reply's token ids appended (so the run
asks for `return_token_ids`). At most `max_concurrency` requests are in flight over all
conversations. A turn that fails ends its conversation; its later turns count as abandoned.

The result has the headline metrics of a plain run (loadtest.metrics, over every turn) plus:

    turns             one row per turn number k and one for all turns ≥ 2: requests, TTFT
                      (mean, median, p90), prompt tokens, cached tokens as the server reported
                      them per request (`usage.prompt_tokens_details.cached_tokens`), the
                      measured hit ratio (cached / prompt tokens), the same over full-block
                      prompt tokens (B·⌊L/B⌋), the offline bound and measured / bound
    offline bound     loadtest.prefix.conversation_prefix_hits: what an infinite cache holding
                      every earlier prompt and every finished request's prompt + reply could
                      serve (block size `--block-size`, last prompt token computed)
    kv_transfer_bytes Δ pdcluster_kv_transfer_bytes_total over the run, and per request
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import time
from dataclasses import dataclass, replace

import aiohttp
import numpy as np
from tqdm import tqdm

from pdcluster.loadtest.client import ClientConfig, RequestRecord, send_request
from pdcluster.loadtest.conversations import Conversation, ConversationSet
from pdcluster.loadtest.metrics import compute_metrics
from pdcluster.loadtest.prefix import SentRequest, conversation_prefix_hits
from pdcluster.loadtest.runner import RunConfig, measured_run
from pdcluster.loadtest.scrape import hit_ratios, transfer_bytes
from pdcluster.loadtest.workload import BenchRequest


@dataclass
class _Sent:
    conversation: int
    turn: int  # 1-based
    prompt: list[int]
    record: RequestRecord


async def run_conversations(conversations: ConversationSet, client: ClientConfig,
                            run: RunConfig, metadata: dict | None = None) -> dict:
    """Run every conversation and return the result dict (see the module docstring)."""
    client = replace(client, return_token_ids=True)
    measured = await measured_run(run, lambda session, t0: _converse_all(
        session, conversations, client, run, t0))
    return _result(conversations, client, run, measured.value, measured.duration,
                   measured.before, measured.after, measured.samples, metadata or {})


async def _converse_all(session: aiohttp.ClientSession, conversations: ConversationSet,
                        client: ClientConfig, run: RunConfig, t0: float) -> list[_Sent]:
    limiter = (asyncio.Semaphore(run.max_concurrency) if run.max_concurrency
               else contextlib.nullcontext())
    bar = tqdm(total=conversations.num_turns, disable=not run.progress, unit="req",
               dynamic_ncols=True)
    sent: list[_Sent] = []

    async def converse(conversation: Conversation) -> None:
        history: list[int] = []
        reply_end = 0.0
        for k, turn in enumerate(conversation.turns, 1):
            send_at = max(turn.not_before_s, reply_end + turn.think_s)
            delay = t0 + send_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            prompt = history + turn.user_ids
            request = BenchRequest(len(sent), prompt, turn.output_len, send_at)
            entry = _Sent(conversation.id, k, prompt, RequestRecord(
                request.index, len(prompt), turn.output_len, send_at))
            sent.append(entry)
            async with limiter:
                entry.record = await send_request(session, client, request, t0)
            bar.update(1)
            record = entry.record
            if record.success and not record.output_token_ids:
                record.success = False
                record.error = "the reply has no token ids (the server ignored return_token_ids)"
            if not record.success:
                bar.set_postfix_str(f"last error: {record.error[:60]}", refresh=False)
                return
            history = prompt + record.output_token_ids
            reply_end = time.perf_counter() - t0

    tasks = [asyncio.create_task(converse(c)) for c in conversations.conversations]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        bar.close()
    return sent


def _result(conversations: ConversationSet, client: ClientConfig, run: RunConfig,
            sent: list[_Sent], duration: float, before, after, samples, metadata: dict) -> dict:
    records = [s.record for s in sent]
    metrics = compute_metrics(records, duration, run.goodput_slos_ms or None, run.percentiles)
    bound = conversation_prefix_hits(
        [SentRequest(s.prompt, (s.prompt + s.record.output_token_ids[:-1])
                     if s.record.success else None,
                     s.record.start_s, s.record.start_s + s.record.e2el_s) for s in sent],
        run.block_size, run.hit_cap_last_token)
    measured = hit_ratios(before, after)
    moved = transfer_bytes(before, after)
    requests = []
    for s, hit in zip(sent, bound.hit):
        row = s.record.to_json()
        row.update(conversation=s.conversation, turn=s.turn, offline_prefix_hit_tokens=hit,
                   offline_prefix_queried_tokens=len(s.prompt))
        requests.append(row)
    ok = [r for r in records if r.success]
    return {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai",
        "api_url": client.api_url,
        "model_id": client.model,
        "workload": conversations.description,
        "workload_params": conversations.params,
        "num_prompts": len(sent),
        "num_conversations": len(conversations.conversations),
        "max_concurrency": run.max_concurrency,
        "goodput_slos_ms": run.goodput_slos_ms or None,
        **metadata,
        **metrics,
        "dropped": conversations.dropped_turns,
        "abandoned_turns": conversations.num_turns - len(sent),
        "prefix_cache_hit_ratio": measured["overall"],
        "prefix_cache_hit_ratio_by_tier": measured["by_tier"],
        "prefix_cache_queried_tokens": measured["queried_tokens"],
        "prefix_cache_hit_tokens": measured["hit_tokens"],
        "offline_prefix_hit_ratio": bound.ratio,
        "offline_prefix_hit_definition": {"block_size": run.block_size,
                                          "denominator": "prompt",
                                          "cap_last_token": run.hit_cap_last_token,
                                          "replies_cached": True},
        "kv_transfer_bytes": moved,
        "kv_transfer_bytes_per_request": moved / len(ok) if moved is not None and ok else None,
        "turns": turn_rows(requests, run.block_size),
        "prefix_cache_timeline": [s.to_json() for s in samples] if samples else None,
        "requests": requests,
    }


def turn_rows(requests: list[dict], block_size: int) -> list[dict]:
    """Per-turn rows of the result (see the module docstring) from its request rows: one per
    turn number, then one with turn "2+" over every later turn."""
    numbers = sorted({r["turn"] for r in requests})
    groups = [(k, [r for r in requests if r["turn"] == k]) for k in numbers]
    groups.append(("2+", [r for r in requests if r["turn"] >= 2]))
    return [_turn_row(turn, rows, block_size) for turn, rows in groups]


def _turn_row(turn, rows: list[dict], block_size: int) -> dict:
    ok = [r for r in rows if r["success"]]
    ttft = np.asarray([r["ttft_s"] for r in ok] or [0.0]) * 1000
    prompt = sum(r["prompt_len"] for r in ok)
    full = sum(block_size * (r["prompt_len"] // block_size) for r in ok)
    reported = all(r.get("cached_tokens") is not None for r in ok) and ok
    cached = sum(r["cached_tokens"] for r in ok) if reported else None
    bound = sum(r["offline_prefix_hit_tokens"] for r in ok)
    return {
        "turn": turn, "requests": len(rows), "completed": len(ok),
        "mean_ttft_ms": float(ttft.mean()), "median_ttft_ms": float(np.median(ttft)),
        "p90_ttft_ms": float(np.percentile(ttft, 90)),
        "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_ratio": cached / prompt if cached is not None and prompt else None,
        "hit_ratio_full_blocks": cached / full if cached is not None and full else None,
        "offline_bound_hit_ratio": bound / prompt if prompt else None,
        "hit_vs_bound": cached / bound if cached is not None and bound else None,
    }
