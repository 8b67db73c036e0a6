"""Placement on a multi-node Ray cluster on one machine (`ray.cluster_utils.Cluster`): a head
and three raylets advertising the role resources of deploy/placement.py.

    head      no role           driver, KV index actor
    prefill   {"prefill": 1}    prefill-0 and its node's KV store
    decode-a  {"decode": 1}     decode-0 or the TP=2 group, and a KV store
    decode-b  {"decode": 1}     the other, and a KV store

It shows that: each actor lands on a node offering its role; a TP=2 decode group
(tp_placement_group, STRICT_PACK) lands on a single decode node; a request crosses nodes (KV
pulled over gRPC from the prefill node's store) and yields HF's greedy tokens through the real
router Pipeline; after decode-0's node is removed, Ray re-places decode-0 (and the TP group if it
was there) on the other decode node, and the cluster keeps serving the same tokens.

The scenario runs in a child Python process (this file run as a script): it needs a Ray
cluster of its own shape that it can take nodes away from, which cannot share a process with any
other Ray a fixture of tests/multinode may hold. The tests below assert on the JSON report it
writes.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

# ray: every test here uses `scenario`, which runs this file as a script that starts a
# multi-node Ray (a script: no tests.* imports at module level)
pytestmark = [pytest.mark.slow, pytest.mark.ray]

NS = "pdc-placement"
MAX_TOKENS = 16
PROMPTS = ("Once upon a time, there was a little girl named Lily. She loved to play outside "
           "in the park with her friends. One day, she saw a big red ball",
           "The little dog ran to the tree and")


# ---- the scenario (child process) --------------------------------------------------------

def _node_of(handle, not_on: str | None = None, timeout_s: float = 120.0) -> str:
    """The node id an actor runs on, once it answers info() from a node other than `not_on`
    (an actor of a removed node may still answer for a moment before Ray restarts it)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            node_id = ray.get(handle.info.remote(), timeout=10)["node_id"]
            if node_id != not_on:
                return node_id
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"actor not re-placed off node {not_on} in {timeout_s} s")
        time.sleep(0.5)


def _generate(pipeline, request_id: str, prompt: list[int]) -> list[int]:
    from pdcluster.engine.protocol import SamplingParams

    async def run() -> list[int]:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
        tokens: list[int] = []
        async for delta in pipeline.generate(request_id, prompt, params):
            if delta.error:
                raise RuntimeError(f"{request_id}: {delta.error}")
            tokens += delta.token_ids
        return tokens

    return asyncio.run(run())


def run_scenario(prompts: list[list[int]]) -> dict:
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from pdcluster.decode_worker.actor import decode_actor
    from pdcluster.deploy import placement
    from pdcluster.deploy.launcher import block_layout
    from pdcluster.engine.config import EngineConfig
    from pdcluster.kvstore.actor import start_kvstore_actor
    from pdcluster.kvstore.config import KVStoreConfig
    from pdcluster.kvstore.index.actor import DEFAULT_INDEX_ACTOR_NAME, IndexActor
    from pdcluster.kvstore.pool_config import KVPoolConfig
    from pdcluster.prefill_worker.actor import prefill_actor
    from pdcluster.router.conductor import Conductor, Instance, InstanceRegistry
    from pdcluster.router.pipeline import Pipeline

    @ray.remote
    class TPRank:
        """Stands in for one rank of a TP decode instance: reports where it runs."""

        def info(self) -> dict:
            return {"node_id": ray.get_runtime_context().get_node_id()}

    report: dict = {}
    small = {"object_store_memory": 80 << 20}
    # fast node-death detection: GCS health checks every 0.5 s, dead after 3 misses
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, **small,
        "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3}})
    nodes = {"prefill": cluster.add_node(num_cpus=2, resources={"prefill": 1}, **small),
             "decode-a": cluster.add_node(num_cpus=3, resources={"decode": 1}, **small),
             "decode-b": cluster.add_node(num_cpus=3, resources={"decode": 1}, **small)}
    try:
        ray.init(address=cluster.address, namespace=NS, log_to_driver=False)
        cluster.wait_for_nodes()
        name_of = {node.node_id: name for name, node in nodes.items()}
        name_of[cluster.head_node.node_id] = "head"
        report["node_names"] = name_of
        report["node_ips"] = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        resources = ray.cluster_resources()
        head_id = cluster.head_node.node_id

        # the embedded index on the head, so removing a worker node never takes it away
        IndexActor.options(name=DEFAULT_INDEX_ACTOR_NAME, namespace=NS, get_if_exists=True,
                           scheduling_strategy=NodeAffinitySchedulingStrategy(head_id, False)
                           ).remote()
        engine = EngineConfig(num_kv_blocks=128)
        kv = KVStoreConfig(token="placement-test-token", rpc_timeout_s=5)
        pool = KVPoolConfig(dram_cache_bytes=64 * 20480, node_lease_s=3.0)
        demands = [placement.role_resources(r, "resources", resources) for r in placement.ROLES]
        store_nodes = placement.worker_node_ids(ray.nodes(), demands)
        report["kvstore_nodes"] = store_nodes
        stores = {n: start_kvstore_actor(n, kv, pool, block_layout(engine), NS)
                  for n in store_nodes}
        ray.get([s.address.remote() for s in stores.values()], timeout=60)

        # what deploy/launcher.py does for each worker, with placement "resources"
        prefill = prefill_actor().options(
            max_concurrency=4, **placement.worker_options("prefill", "resources", resources, 1)
        ).remote("prefill-0", engine, kv, pool, NS)
        decode = decode_actor().options(
            **placement.worker_options("decode", "resources", resources, 1)
        ).remote("decode-0", engine, kv, NS)
        pg = placement.tp_placement_group(2, "decode", 1, name="decode-tp")
        ray.get(pg.ready(), timeout=60)
        ranks = [TPRank.options(**placement.tp_rank_options(pg, i)).remote() for i in range(2)]

        def where(removed: str | None = None) -> dict:
            return {"prefill": _node_of(prefill, removed), "decode": _node_of(decode, removed),
                    "tp": [_node_of(r, removed) for r in ranks]}

        registry = InstanceRegistry()
        registry.add(Instance("prefill-0", "prefill", prefill))
        registry.add(Instance("decode-0", "decode", decode))
        pipeline = Pipeline(Conductor(registry))

        report["before"] = where()
        fetched = ray.get(decode.stats.remote()).kv_connector_stats["kv_bytes_fetched_total"]
        report["tokens_before"] = [_generate(pipeline, f"before-{i}", p)
                                   for i, p in enumerate(prompts)]
        report["kv_bytes_fetched_before"] = (
            ray.get(decode.stats.remote()).kv_connector_stats["kv_bytes_fetched_total"] - fetched)

        # a decode node fails: the one running decode-0
        victim_id = report["before"]["decode"]
        report["removed"] = victim = name_of[victim_id]
        cluster.remove_node(nodes[victim], allow_graceful=False)
        t0 = time.monotonic()
        report["after"] = where(victim_id)
        report["replace_s"] = time.monotonic() - t0
        report["tokens_after"] = [_generate(pipeline, f"after-{i}", p)
                                  for i, p in enumerate(prompts)]
        report["alive_nodes"] = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        ray.util.remove_placement_group(pg)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return report


# ---- the tests (parent process) ----------------------------------------------------------

@pytest.fixture(scope="module")
def scenario(hf, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("placement") / "report.json"
    prompts = [hf.encode(p) for p in PROMPTS]
    cmd = [sys.executable, str(Path(__file__).resolve()), str(out), json.dumps(prompts)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    if proc.returncode != 0:
        pytest.fail(f"placement scenario failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    report = json.loads(out.read_text())
    report["expected"] = [hf.greedy(p, MAX_TOKENS) for p in prompts]
    return report


def names(report: dict, node_ids) -> list[str]:
    return [report["node_names"][n] for n in node_ids]


def test_nodes_are_told_apart_by_node_id_not_ip(scenario):
    ips = scenario["node_ips"]
    assert len(ips) == 4 and len(set(ips.values())) == 1  # one machine: one IP, four nodes
    assert sorted(names(scenario, scenario["kvstore_nodes"])) == ["decode-a", "decode-b",
                                                                   "prefill"]


def test_prefill_and_decode_land_on_nodes_offering_their_role(scenario):
    before = scenario["before"]
    assert names(scenario, [before["prefill"]]) == ["prefill"]
    assert names(scenario, [before["decode"]])[0] in ("decode-a", "decode-b")


def test_tp2_decode_group_is_packed_on_one_decode_node(scenario):
    for phase in ("before", "after"):
        tp = names(scenario, scenario[phase]["tp"])
        assert len(tp) == 2 and tp[0] == tp[1] and tp[0].startswith("decode-"), (phase, tp)


def test_request_crosses_nodes_over_grpc_with_greedy_output(scenario):
    before = scenario["before"]
    assert before["prefill"] != before["decode"]
    assert scenario["kv_bytes_fetched_before"] > 0  # pulled from the prefill node's store
    assert scenario["tokens_before"] == scenario["expected"]


def test_removed_node_actors_are_re_placed_and_serving_continues(scenario):
    removed, after = scenario["removed"], scenario["after"]
    survivor = {"decode-a": "decode-b", "decode-b": "decode-a"}[removed]
    assert removed not in names(scenario, scenario["alive_nodes"])
    assert names(scenario, [after["decode"]]) == [survivor]
    assert names(scenario, [after["prefill"]]) == ["prefill"]
    assert names(scenario, after["tp"]) == [survivor, survivor]
    assert scenario["tokens_after"] == scenario["expected"]


if __name__ == "__main__":  # the child: python test_placement.py REPORT_PATH PROMPTS_JSON
    Path(sys.argv[1]).write_text(json.dumps(run_scenario(json.loads(sys.argv[2]))))
