"""The cluster KV pool across two Ray nodes (`ray.cluster_utils.Cluster`): cross-node prefix
reuse, G1 → G2 → G3 → G1 round trips, corrupt SSD blocks, transfer faults, a dead node.

Node A runs prefill A and its KV store; node B runs prefill B, the decode worker and its KV
store; the embedded index actor holds the global index. Outputs are checked against HF.
"""

from __future__ import annotations

import asyncio
import glob
import time

import pytest
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pdcluster.decode_worker.actor import decode_actor
from pdcluster.deploy.launcher import block_layout
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.core.stats import SchedulerStats
from pdcluster.engine.protocol import DecodeRequest, FinishReason, PrefillRequest, SamplingParams
from pdcluster.kvstore.actor import start_kvstore_actor
from pdcluster.kvstore.config import KVStoreConfig
from pdcluster.kvstore.index import Location, open_index
from pdcluster.kvstore.pool_config import KVPoolConfig
from pdcluster.prefill_worker.actor import prefill_actor
from pdcluster.router.decode_outputs import DecodeOutputs
from pdcluster.router.pipeline import _stream_decode
from pdcluster.router.registry import Instance
from tests.faults import FaultyKVStoreActor
from tests.handoffs import handoff
from tests.markers import starts

pytestmark = pytest.mark.slow

NS = "pdc-multinode"
LEASE_S = 2.0
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the "
         "park with her friends. One day, she saw a big red ball under a tree. She ran to get it, "
         "but a small dog got there first. The dog wagged its tail and looked at Lily. Lily "
         "laughed and said, \"Can we play together?\" The dog barked and they played all day. ")


def two_node_cluster(namespace: str):
    """A `ray.cluster_utils.Cluster` of nodes with resources node_a and node_b (3 CPUs each),
    this process connected to it in `namespace`; returns (cluster, resource -> node id)."""
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized(), "run tests/multinode in its own pytest process"
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 3, "resources": {"node_a": 10}, "object_store_memory": 80 << 20})
    cluster.add_node(num_cpus=3, resources={"node_b": 10}, object_store_memory=80 << 20)
    ray.init(address=cluster.address, namespace=namespace)
    cluster.wait_for_nodes()
    node_of = {r: next(n["NodeID"] for n in ray.nodes() if n["Alive"] and r in n["Resources"])
               for r in ("node_a", "node_b")}
    return cluster, node_of


@pytest.fixture(scope="module")
@starts("ray")
def nodes(tmp_path_factory):
    cluster, node_of = two_node_cluster(NS)
    engine = EngineConfig(num_kv_blocks=256)
    kv = KVStoreConfig(token="multinode-test-token", rpc_timeout_s=3)
    pool = KVPoolConfig(dram_cache_bytes=16 * 20480, node_lease_s=LEASE_S,
                        ssd_cache_dir=str(tmp_path_factory.mktemp("ssd")),
                        ssd_cache_bytes=256 * 20480)
    layout = block_layout(engine)
    # stores that take faults: the tests below stop one's gRPC plane and its heartbeat
    stores = {r: start_kvstore_actor(n, kv, pool, layout, NS, FaultyKVStoreActor)
              for r, n in node_of.items()}
    ray.get([s.address.remote() for s in stores.values()])

    def pinned(actor_cls, resource, *args, **opts):
        return actor_cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            node_of[resource], soft=False), num_cpus=1, **opts).remote(*args)

    env = {
        "node_of": node_of, "stores": stores, "pool": pool, "engine": engine,
        "prefill_a": pinned(prefill_actor(), "node_a", "prefill-a", engine, kv, pool, NS,
                            max_concurrency=4),
        "prefill_b": pinned(prefill_actor(), "node_b", "prefill-b", engine, kv, pool, NS,
                            max_concurrency=4),
        "decode": pinned(decode_actor(), "node_b", "decode-b", engine, kv, NS),
        "index": open_index(pool.index_url),
    }
    ray.get([env[k].stats.remote() for k in ("prefill_a", "prefill_b", "decode")])
    yield env
    ray.shutdown()
    cluster.shutdown()


def prefill(worker, request_id: str, prompt: list[int], max_tokens: int = 12):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=1)
    first, result = worker.prefill.options(num_returns=2).remote(
        PrefillRequest(request_id, tuple(prompt), params))
    return ray.get(result)


def decode(env, result, prompt: list[int], max_tokens: int = 12):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=1)

    async def run():  # the gateway's way: its output stream from the decode actor
        instance = Instance("decode", "decode", env["decode"])
        request = DecodeRequest(result.request_id, tuple(prompt), params, result)
        return [d async for d in _stream_decode(instance, request, DecodeOutputs())]

    deltas = asyncio.run(run())
    return [result.first_token] + [t for d in deltas for t in d.token_ids], deltas[-1]


def hits(worker) -> dict:
    return ray.get(worker.stats.remote()).prefix_cache_hit_tokens_total


def check_baseline(env, settle_s: float = 10.0) -> None:
    """Every block a request held is back: G1 pools and decode cache free, no arena pins or
    leases. A worker frees a request's blocks just after its last delta went out, and a
    prefill publishes its blocks after the first token, so a store's write leases can outlast
    the request by that publish: each gets `settle_s` to reach its baseline (a leak never
    does)."""
    def settled(what: str, probe) -> None:
        deadline = time.monotonic() + settle_s
        while not (ok := probe()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ok, f"{what} not back at its baseline within {settle_s:g} s"

    def stats(name: str) -> SchedulerStats:
        return ray.get(env[name].stats.remote(), timeout=5)

    for name in ("prefill_a", "prefill_b"):
        settled(name, lambda: stats(name).num_used_blocks == 0)
    settled("decode", lambda: (d := stats("decode")).num_free_blocks == d.num_blocks
            and d.num_active == 0)
    for node, store in env["stores"].items():
        try:
            settled(f"store {node}", lambda: ray.get(
                store.stats.remote(), timeout=5)["tiers"]["host"]["used"] == 0)
        except ray.exceptions.RayActorError:
            pass  # a store a test took down


def story_prompt(hf, variant: str, min_tokens: int = 300) -> list[int]:
    ids = hf.encode(variant + " " + STORY)
    while len(ids) < min_tokens:
        ids += hf.encode(STORY, add_special_tokens=False)
    return ids[:min_tokens + 5]


def prefill_then_push_to_ssd(env, hf, tag: str, prompt: list[int]):
    """Prefill on A, then prefill 3 other prompts there: the first prompt's blocks leave the
    16-block G2 arena for node A's SSD. Returns the first prefill's result."""
    result = prefill(env["prefill_a"], f"{tag}-cold", prompt)
    for i in range(3):
        prefill(env["prefill_a"], f"{tag}-filler-{i}", story_prompt(hf, f"{tag} filler {i}."))
    return result


def test_cross_node_reuse_computes_only_the_rest(nodes, hf):
    env, prompt = nodes, story_prompt(hf, "Cross node.")
    want = hf.greedy(prompt, 12)
    on_a = prefill(env["prefill_a"], "x-a", prompt)
    assert on_a.num_cached_tokens == 0 and on_a.first_token == want[0]
    before = hits(env["prefill_b"]).get("remote", 0)
    on_b = prefill(env["prefill_b"], "x-b", prompt)
    shared = (len(prompt) - 1) // 16 * 16
    assert on_b.num_cached_tokens == shared and len(prompt) - shared >= 1
    assert hits(env["prefill_b"])["remote"] - before == shared  # fetched from node A
    # same token; the logprob to fp32 rounding: B runs the prompt's last token over the
    # fetched prefix (masked attention kernel), A the whole prompt (causal kernel), and their
    # sums differ in the last bits; a wrong or partial prefix would move it far more
    assert on_b.first_token == on_a.first_token
    assert abs(on_b.first_logprob.logprob - on_a.first_logprob.logprob) < 1e-5
    tokens, last = decode(env, on_b, prompt)
    assert tokens == want and last.finish_reason is FinishReason.LENGTH
    check_baseline(env)


def test_tier_round_trip_through_ssd(nodes, hf):
    env = nodes
    prompt = story_prompt(hf, "Round trip.")
    want = hf.greedy(prompt, 12)
    cold = prefill_then_push_to_ssd(env, hf, "rt", prompt)
    locations = env["index"].lookup(list(handoff(cold).block_keys))
    assert all(any(loc.tier == "ssd" for loc in locs) for locs in locations[:8])
    assert ray.get(env["prefill_a"].reset_prefix_cache.remote())
    before = hits(env["prefill_a"]).get("ssd", 0)
    warm = prefill(env["prefill_a"], "rt-warm", prompt)
    assert hits(env["prefill_a"])["ssd"] - before > 0  # served from this node's G3
    assert warm.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    # same token; the logprob to fp32 rounding (a cached prefix runs the masked attention
    # kernel, a cold prompt the causal one: their sums differ in the last bits)
    assert warm.first_token == cold.first_token
    assert abs(warm.first_logprob.logprob - cold.first_logprob.logprob) < 1e-5
    tokens, _ = decode(env, warm, prompt)
    assert tokens == want
    check_baseline(env)


def test_corrupt_ssd_block_is_recomputed(nodes, hf, tmp_path):
    env = nodes
    prompt = story_prompt(hf, "Corrupt me.")
    want = hf.greedy(prompt, 12)
    prefill_then_push_to_ssd(env, hf, "c", prompt)
    ssd_dir = f"{env['pool'].ssd_cache_dir}/{env['node_of']['node_a'][:16]}"
    for slab in glob.glob(f"{ssd_dir}/slab-*.bin"):
        with open(slab, "r+b") as f:
            data = bytearray(f.read())
            for off in range(64, len(data), 1009):
                data[off] ^= 0x5A
            f.seek(0)
            f.write(data)
    assert ray.get(env["prefill_a"].reset_prefix_cache.remote())
    corruptions = ray.get(env["stores"]["node_a"].stats.remote())["tiers"]["ssd"]["corruptions"]
    warm = prefill(env["prefill_a"], "c-warm", prompt)
    after = ray.get(env["stores"]["node_a"].stats.remote())["tiers"]["ssd"]["corruptions"]
    assert after > corruptions
    assert warm.num_cached_tokens < (len(prompt) - 1) // 16 * 16  # cut at the corrupt block
    tokens, _ = decode(env, warm, prompt)
    assert tokens == want
    check_baseline(env)


def test_failed_transfers_recompute(nodes, hf):
    env = nodes
    prompt = story_prompt(hf, "Faults.")
    want = hf.greedy(prompt, 12)
    on_a = prefill(env["prefill_a"], "f-a", prompt)
    ray.get(env["stores"]["node_a"].inject_fault.remote("stop_serving"))  # A's gRPC is gone
    # recoverable: B's prefix fetch from A fails → B recomputes, output unchanged
    on_b = prefill(env["prefill_b"], "f-b", prompt)
    assert on_b.num_cached_tokens == 0 and on_b.first_token == want[0]
    tokens, _ = decode(env, on_b, prompt)
    assert tokens == want
    # A's result points at A's store, which cannot serve its blocks any more: the decode
    # retries once, then recomputes the prompt itself, output unchanged.
    # (Faults nothing can recover from end with a clear error: tests/chaos, KV store killed.)
    recomputes = ray.get(env["decode"].stats.remote()).num_fetch_recomputes_total
    tokens, last = decode(env, on_a, prompt)
    assert tokens == want and last.finish_reason is FinishReason.LENGTH
    assert ray.get(env["decode"].stats.remote()).num_fetch_recomputes_total == recomputes + 1
    check_baseline(env)


def test_dead_node_leaves_the_index_within_the_lease(nodes, hf):
    env = nodes
    node_a = env["node_of"]["node_a"]
    probe, probe_at = [bytes(32)], Location(node_a, "device", "liveness-probe")
    env["index"].add(probe, probe_at)  # looked up while node A's lease runs
    ray.get(env["stores"]["node_a"].inject_fault.remote("stop_heartbeat"))
    # its 2 s lease ran out, not the default 10 s one: gone before the default would end (a
    # generous margin over the configured lease, still telling the two apart)
    deadline = time.monotonic() + KVPoolConfig.model_fields["node_lease_s"].default
    while env["index"].lookup(probe) != [[]]:
        assert time.monotonic() < deadline, "node A still alive in the index past its lease"
        time.sleep(0.2)
    env["index"].remove(probe, probe_at)
    prompt = story_prompt(hf, "Cross node.")  # cached on A by the first test, and on B
    assert all(loc.node_id != node_a for locs in env["index"].lookup(
        list(handoff(prefill(env["prefill_b"], "d-b", prompt)).block_keys)) for loc in locs)
    check_baseline(env)
