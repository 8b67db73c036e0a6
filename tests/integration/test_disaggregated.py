"""The request path really is disaggregated: prefill actor → KV over gRPC → decode actor.

Runs a real local Ray cluster with one KV store, one prefill and one decode actor, each in its
own process, and drives requests through the same Pipeline the gateway uses.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import ray

from pdcluster.deploy.launcher import Cluster
from pdcluster.engine.core.stats import SchedulerStats
from pdcluster.engine.protocol import FinishReason, SamplingParams
from pdcluster.kvstore.client import KVStoreClient

pytestmark = pytest.mark.slow

LONG_PROMPT = ("Once upon a time, there was a little boy named Tim. Tim had a big red ball. "
               "He liked to play with it in the park every day with his friend Sue.")


def run(cluster: Cluster, request_id: str, prompt_ids: list[int], max_tokens: int,
        cache_salt: str | None = None, **sampling) -> list:
    async def collect():
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling)
        return [d async for d in cluster.pipeline.generate(request_id, prompt_ids, params,
                                                           cache_salt)]

    return asyncio.run(collect())


def tokens_of(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def decode_stats(cluster: Cluster) -> SchedulerStats:
    return ray.get(cluster.decode[0].handle.stats.remote())


def settled_decode_stats(cluster: Cluster, timeout_s: float = 10.0
                         ) -> SchedulerStats:
    """The decode's stats once every block is back in its pool (it frees a request's blocks
    just after the last delta went out), or as they are at the timeout."""
    deadline = time.monotonic() + timeout_s
    while (stats := decode_stats(cluster)).num_free_blocks != stats.num_blocks \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    return stats


def test_prefill_makes_token_one_and_decode_the_rest_without_recompute(cluster, hf):
    prompt = hf.encode("Once upon a time")
    expected = hf.greedy(prompt, 64)
    before = decode_stats(cluster)
    deltas = run(cluster, "req-split", prompt, 64)

    assert tokens_of(deltas) == expected
    prefill_pid = ray.get(cluster.prefill[0].handle.info.remote())["pid"]
    first, rest = deltas[0], deltas[1:]
    assert first.token_ids == (expected[0],) and first.extra["prefill_pid"] == prefill_pid
    decode_pids = {d.decode_pid for d in rest}
    assert len(decode_pids) == 1
    decode_pid = decode_pids.pop()
    assert decode_pid not in (prefill_pid, os.getpid())
    assert tokens_of(rest) == expected[1:]
    last = deltas[-1]
    assert last.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert last.num_forward_tokens == len(expected) - 1
    after = settled_decode_stats(cluster)
    assert after.num_forward_tokens_total - before.num_forward_tokens_total == \
        len(expected) - 1
    assert after.num_free_blocks == after.num_blocks


def test_decode_output_depends_on_kv_received_over_grpc(cluster, hf):
    prompt = hf.encode(LONG_PROMPT)
    block_size = cluster.config.engine.block_size
    assert len(prompt) > 2 * block_size and len(prompt) % block_size  # full blocks and a tail
    expected = hf.greedy(prompt, 24)
    decode = cluster.decode[0].handle
    bytes_before = decode_stats(cluster).kv_connector_stats["kv_bytes_fetched_total"]
    try:
        ray.get(decode.inject_fault.remote("perturb_v", 3.0))
        # under a salt of its own: the decode publishes the blocks it holds when the request
        # ends, and these hold perturbed V, which no later request of the session may load
        perturbed = tokens_of(run(cluster, "req-perturbed", prompt, 24, "perturbed",
                                  ignore_eos=True))
    finally:
        ray.get(decode.inject_fault.remote("perturb_v", 0.0))
    assert perturbed[0] == expected[0]  # token 1 comes from prefill, untouched
    assert perturbed[1:] != expected[1:]

    bytes_mid = decode_stats(cluster).kv_connector_stats["kv_bytes_fetched_total"]
    # a salt no other test uses: the decode's prefix cache holds none of it, so every block
    # comes over the wire whatever ran on this session's cluster before
    assert tokens_of(run(cluster, "req-clean", prompt, 24, "clean")) == expected
    num_blocks = -(-len(prompt) // block_size)
    fetched = decode_stats(cluster).kv_connector_stats["kv_bytes_fetched_total"] - bytes_mid
    assert fetched == bytes_mid - bytes_before > 0
    assert fetched % num_blocks == 0

    # the tail went to decode under a one-shot handle: it is gone from the store now
    kv_address = ray.get(cluster.prefill[0].handle.info.remote())["kv_address"]
    with KVStoreClient(kv_address, token=cluster.config.kvstore.token) as client:
        assert client.stats()["num_tails"] == 0


def test_requests_join_and_leave_the_decode_batch(cluster, hf):
    prompts = [hf.encode(t) for t in ("Once upon a time", "The cat", "Lily and Ben went",
                                      "One day, a big dog")]
    lengths = [40, 8, 24, 16]
    expected = [hf.greedy(p, n) for p, n in zip(prompts, lengths)]
    before = decode_stats(cluster)

    async def all_requests():
        async def one(i):
            params = SamplingParams(max_tokens=lengths[i], temperature=0.0)
            return [d async for d in cluster.pipeline.generate(f"req-batch-{i}", prompts[i],
                                                                params)]
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    results = asyncio.run(all_requests())
    for deltas, want in zip(results, expected):
        assert tokens_of(deltas) == want
    after = settled_decode_stats(cluster)
    forward = after.num_forward_tokens_total - before.num_forward_tokens_total
    steps = after.num_steps_total - before.num_steps_total
    assert forward == sum(len(e) - 1 for e in expected)
    assert steps < forward  # some steps ran several requests together
    assert after.num_free_blocks == after.num_blocks


def test_serve_routes_with_the_live_conductor(cluster, hf):
    """`pdcluster serve`'s Cluster runs the live Conductor: kvcache_centric over the
    global index, a prefill ledger the pipeline feeds back into (prefill_done), decode loads
    polled from the workers."""
    conductor = cluster.conductor
    assert cluster.pipeline.conductor is conductor
    assert conductor.policy_name == "kvcache_centric" and conductor.index is not None
    ids = hf.encode(LONG_PROMPT)
    scale = conductor.loads.scale
    run(cluster, "live-conductor-0", ids, 3)
    assert conductor.loads.scale != scale  # the measured prefill calibrated the cost model
    assert conductor.loads.decode_load(cluster.decode[0].worker_id).capacity_tokens
