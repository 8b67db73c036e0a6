"""`--kv-streaming layer` through real Ray actors: a cluster of its own (one
prefill, one decode, its own Ray namespace, chunked prefill at 16 tokens per step) streams
each layer's KV while the prefill computes; its outputs are compared with the session cluster,
which transfers whole requests (the default), and with HF.

Both clusters share the session's Ray; this module's cluster has its own namespace (own KV
store actor, arena and peer entries) and is shut down at the module's end.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import ray
from ray.exceptions import RayTaskError

from pdcluster.deploy.config import ServeConfig
from pdcluster.deploy.launcher import Cluster
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.core.stats import SchedulerStats
from pdcluster.engine.protocol import PrefillRequest, SamplingParams
from pdcluster.kvstore.client import KVStoreClient
from pdcluster.kvstore.config import KVTransferConfig
from pdcluster.kvstore.pool_config import KVPoolConfig
from tests.faults import FAULTY
from tests.markers import starts

pytestmark = pytest.mark.slow

STORY = ("Once upon a time, there was a little boy named Tim. Tim had a big red ball. He liked "
         "to play with it in the park every day with his friend Sue. One day, Sue said, \"Tim, "
         "can I play with your ball?\" Tim did not want to share. He said, \"No, it is my "
         "ball.\" Sue was sad and went home. The next day, Tim went to the park alone. ")
BUDGET = 16  # tokens per prefill step: a long prompt runs in many chunks


@pytest.fixture(scope="module")
@starts("ray")
def layer_cluster(cluster):
    """The session cluster first (it owns the session's Ray), then ours beside it."""
    config = ServeConfig(pd_decider="always",
                         ray_num_cpus=4, ray_namespace=f"pdc-layer-{os.getpid()}",
                         # an index of its own: the session cluster's is on the same node
                         kvpool=KVPoolConfig(index_url=f"ray://pdc-layer-index-{os.getpid()}"),
                         transfer=KVTransferConfig(streaming="layer", timeout_s=10),
                         engine=EngineConfig(max_num_batched_tokens=BUDGET))
    with Cluster(config, actors=FAULTY) as c:
        yield c


def run(cluster: Cluster, request_id: str, prompt: list[int], **sampling) -> list[int]:
    async def collect():
        params = SamplingParams(**sampling)
        return [t async for d in cluster.pipeline.generate(request_id, prompt, params)
                for t in d.token_ids]

    return asyncio.run(collect())


def handle_stats(instance) -> SchedulerStats:
    return ray.get(instance.handle.stats.remote())


def kv_timings(cluster: Cluster, request_id: str) -> dict:
    return ray.get(cluster.decode[0].handle.kv_timings.remote(request_id))


def assert_settled(cluster: Cluster, timeout_s: float = 10.0) -> None:
    """Every decode block free, no stream reserved, no tail or piece left in the store, no
    prefill block held by a request."""
    address = ray.get(cluster.prefill[0].handle.info.remote())["kv_address"]
    deadline = time.monotonic() + timeout_s
    with KVStoreClient(address, token=cluster.config.kvstore.token) as client:
        while True:
            decode, prefill = handle_stats(cluster.decode[0]), handle_stats(cluster.prefill[0])
            state = (decode.num_free_blocks == decode.num_blocks,
                     decode.num_prealloc_requests == 0, decode.num_active == 0,
                     prefill.num_free_blocks == prefill.num_blocks,
                     client.stats()["num_tails"] == 0)
            if all(state):
                return
            assert time.monotonic() < deadline, (state, decode, prefill)
            time.sleep(0.05)


def test_layer_stream_output_matches_whole_request_transfer(layer_cluster, cluster, hf):
    prompt = hf.encode(STORY * 3)
    assert len(prompt) > 10 * BUDGET and len(prompt) % 16  # many chunks, blocks and a tail
    greedy = run(layer_cluster, "ls-greedy", prompt, max_tokens=24, temperature=0)
    assert greedy == run(cluster, "rq-greedy", prompt, max_tokens=24, temperature=0)
    assert greedy == hf.greedy(prompt, 24)
    timings = kv_timings(layer_cluster, "ls-greedy")
    assert timings["paths"] == ["layer"] and "failed" not in timings
    num_chunks = -(-len(prompt) // BUDGET)
    layers = {layer for _, layer, _ in timings["arrivals"]}
    assert layers == set(range(5)) and len(timings["arrivals"]) >= num_chunks * 5

    seeded = dict(max_tokens=32, temperature=0.9, top_k=40, seed=1234, ignore_eos=True)
    sampled = run(layer_cluster, "ls-seeded", prompt, **seeded)
    assert sampled == run(cluster, "rq-seeded", prompt, **seeded)
    assert sampled != greedy[:len(sampled)]  # really sampled
    assert kv_timings(layer_cluster, "ls-seeded")["paths"] == ["layer"]
    assert_settled(layer_cluster)


def test_cached_prefix_streams_as_whole_blocks(layer_cluster, cluster, hf):
    base = hf.encode(STORY * 2)
    run(layer_cluster, "ls-prefix-warm", base, max_tokens=2, temperature=0)
    hits = handle_stats(layer_cluster.prefill[0]).prefix_cache_hit_tokens_total
    prompt = base[:160] + hf.encode("Then a big dog came and barked at the ball.",
                                    add_special_tokens=False)
    out = run(layer_cluster, "ls-prefix", prompt, max_tokens=20, temperature=0)
    assert out == run(cluster, "rq-prefix", prompt, max_tokens=20, temperature=0)
    assert out == hf.greedy(prompt, 20)
    after = handle_stats(layer_cluster.prefill[0]).prefix_cache_hit_tokens_total
    assert after.get("device", 0) - hits.get("device", 0) == 160  # 10 blocks from G1
    arrivals = kv_timings(layer_cluster, "ls-prefix")["arrivals"]
    assert arrivals[0][1] == -1  # the cached prefix went first, every layer at once
    assert {layer for _, layer, _ in arrivals[1:]} == set(range(5))
    assert_settled(layer_cluster)


def test_layer_zero_lands_before_the_last_layer_is_computed(layer_cluster, hf):
    prompt = hf.encode(STORY * 4)[:480]
    prefill = layer_cluster.prefill[0].handle
    # the bundled model computes a chunk's layers in well under a millisecond each: on a busy
    # machine the whole prefill could end before the first piece's fetch is scheduled, so each
    # layer is given a few milliseconds, as a larger model's would take
    ray.get(prefill.inject_fault.remote("layer_delay", 0.005))
    try:
        out = run(layer_cluster, "ls-timing", prompt, max_tokens=4, temperature=0)
    finally:
        ray.get(prefill.inject_fault.remote("layer_delay", 0))
    assert out == hf.greedy(prompt, 4)
    timings = kv_timings(layer_cluster, "ls-timing")
    compute_end = timings["prefill_extra"]["layer_compute_end_s"]  # the last chunk's layers
    assert len(compute_end) == 5 and compute_end == sorted(compute_end)
    first_layer0 = min(t for _, layer, t in timings["arrivals"] if layer == 0)
    last_arrival = max(t for _, _, t in timings["arrivals"])
    print(f"layer 0 landed {1000 * (compute_end[-1] - first_layer0):.1f} ms before the last "
          f"layer's compute ended; the last piece {1000 * (last_arrival - compute_end[-1]):.1f} "
          f"ms after it; admitted {1000 * (timings['admitted_s'] - last_arrival):.1f} ms later")
    assert first_layer0 < compute_end[-1]
    assert timings["admitted_s"] >= last_arrival  # admitted once the last layer landed
    assert_settled(layer_cluster)


def test_prefill_abort_mid_stream_frees_both_sides(layer_cluster, hf):
    """The prefill is aborted while its layers stream: it stops at the next layer, drops what
    it put, tells the decode, which frees the blocks it reserved on the announce."""
    prompt = hf.encode(STORY * 4)[:500]
    prefill, decode = layer_cluster.prefill[0].handle, layer_cluster.decode[0]
    params = SamplingParams(max_tokens=8, temperature=0)
    # ~8 s of compute: the abort lands mid-stream even when a loaded machine delays it
    ray.get(prefill.inject_fault.remote("layer_delay", 0.05))
    try:
        first, result = prefill.prefill.options(num_returns=2).remote(
            PrefillRequest("ls-abort", tuple(prompt), params,
                           kv_transfer_params={"decode_peer": decode.worker_id}))
        deadline = time.monotonic() + 10
        while not (timings := kv_timings(layer_cluster, "ls-abort")) \
                or not timings["num_taken"]:  # announced, reserved, a first piece landed
            assert time.monotonic() < deadline
            time.sleep(0.01)
        prefill.abort.remote("ls-abort")
        for ref in (first, result):
            with pytest.raises(RayTaskError, match="RequestAborted"):
                ray.get(ref, timeout=30)
    finally:
        ray.get(prefill.inject_fault.remote("layer_delay", 0))
    assert 0 < timings["num_taken"] < timings["num_pieces"]  # it was mid-stream
    assert_settled(layer_cluster)
    # the cluster serves on
    assert run(layer_cluster, "ls-after-abort", prompt[:100], max_tokens=6,
               temperature=0) == hf.greedy(prompt[:100], 6)
    assert_settled(layer_cluster)
