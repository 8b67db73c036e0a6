"""`--kv-transfer torch` through the launcher: the prefill actor pushes each request's KV to the
decode actor the Conductor picked, over their own two-rank gloo group (two Ray actor processes,
never the default group), and the decode generates from it. Outputs against HF.

Runs on a local one-node Ray of its own (or the Ray already initialized in this process), so
it lives here, in its own pytest process, next to the multi-node tests (tests/conftest.py):
the session cluster of tests/integration has the default config. Its module fixture shuts the
Ray it started down again, so the modules of this directory run one after the other.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from pdcluster.deploy.config import ServeConfig
from pdcluster.deploy.launcher import Cluster
from pdcluster.engine.core.stats import SchedulerStats
from pdcluster.engine.protocol import FinishReason, SamplingParams
from pdcluster.kvstore.config import KVTransferConfig
from tests.faults import FAULTY

pytestmark = pytest.mark.slow

STORY = ("Once upon a time, there was a little boy named Tim. Tim had a big red ball. He liked "
         "to play with it in the park every day with his friend Sue.")


@pytest.fixture(scope="module")
def cluster(local_cluster):
    config = ServeConfig(pd_decider="always",
                         transfer=KVTransferConfig(backend="torch"), ray_num_cpus=4,
                         ray_namespace="pdc-kv-torch")
    with local_cluster(config, FAULTY) as c:
        yield c


def run(cluster: Cluster, request_id: str, prompt: list[int], max_tokens: int, **sampling):
    async def collect():
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling)
        return [d async for d in cluster.pipeline.generate(request_id, prompt, params)]

    return asyncio.run(collect())


def tokens_of(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def stats(instance) -> SchedulerStats:
    return ray.get(instance.handle.stats.remote())


def settled_decode(cluster: Cluster) -> SchedulerStats:
    deadline = time.monotonic() + 10
    while True:
        s = stats(cluster.decode[0])
        if s.num_free_blocks == s.num_blocks and s.num_active == 0:
            return s
        assert time.monotonic() < deadline, s
        time.sleep(0.05)


def test_kv_comes_over_the_pair_and_output_matches_hf(cluster, hf):
    prompt = hf.encode(STORY)
    assert len(prompt) > 32 and len(prompt) % 16  # full blocks and a tail
    expected = hf.greedy(prompt, 32)
    deltas = run(cluster, "torch-1", prompt, 32)
    assert tokens_of(deltas) == expected
    prefill_pid = ray.get(cluster.prefill[0].handle.info.remote())["pid"]
    assert deltas[0].extra["prefill_pid"] == prefill_pid
    assert {d.decode_pid for d in deltas[1:]} - {prefill_pid, 0}
    assert deltas[-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    decode = settled_decode(cluster)
    block_nbytes = decode.kv_connector_stats["kv_bytes_fetched_total"] // -(-len(prompt) // 16)
    assert (decode.kv_connector_stats["kv_bytes_fetched_by_backend"]
            == {"torch": decode.kv_connector_stats["kv_bytes_fetched_total"]})
    assert (block_nbytes > 0 and decode.kv_connector_stats["kv_bytes_fetched_total"] % block_nbytes
            == 0)
    prefill = stats(cluster.prefill[0])
    assert (prefill.kv_connector_stats["kv_pairs_opened_total"]
            == 1 and prefill.kv_connector_stats["kv_pushes_total"] == 1)


def check_output_depends_on_received_kv(cluster: Cluster, hf, backend: str) -> None:
    """With V perturbed as it arrives, the decode's tokens after the first change; without,
    they match HF; every byte came over ``backend``."""
    prompt = hf.encode("Lily and Ben went to the park. " + STORY)
    expected = hf.greedy(prompt, 24)
    decode = cluster.decode[0].handle
    try:
        ray.get(decode.inject_fault.remote("perturb_v", 3.0))
        perturbed = tokens_of(run(cluster, f"{backend}-perturbed", prompt, 24,
                                  ignore_eos=True))
    finally:
        ray.get(decode.inject_fault.remote("perturb_v", 0.0))
    assert perturbed[0] == expected[0] and perturbed[1:] != expected[1:]
    assert tokens_of(run(cluster, f"{backend}-clean", prompt, 24)) == expected
    assert (set(settled_decode(cluster).kv_connector_stats["kv_bytes_fetched_by_backend"])
            == {backend})


def run_concurrently(cluster: Cluster, prefix: str, prompts: list[list[int]],
                     lengths: list[int]) -> list[list[int]]:
    """The greedy outputs of all prompts, generated at once."""
    async def all_requests():
        async def one(i):
            params = SamplingParams(max_tokens=lengths[i], temperature=0.0)
            return [d async for d in cluster.pipeline.generate(f"{prefix}-{i}", prompts[i],
                                                                params)]
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    return [tokens_of(deltas) for deltas in asyncio.run(all_requests())]


def test_decode_output_depends_on_kv_received_over_the_pair(cluster, hf):
    check_output_depends_on_received_kv(cluster, hf, "torch")


def test_concurrent_requests_share_one_pair(cluster, hf):
    prompts = [hf.encode(t) for t in ("Once upon a time", "The cat", STORY,
                                      "One day, a big dog")]
    lengths = [40, 8, 24, 16]
    expected = [hf.greedy(p, n) for p, n in zip(prompts, lengths)]
    pushes = stats(cluster.prefill[0]).kv_connector_stats["kv_pushes_total"]

    for tokens, want in zip(run_concurrently(cluster, "torch-batch", prompts, lengths),
                            expected):
        assert tokens == want
    prefill = stats(cluster.prefill[0])
    assert prefill.kv_connector_stats["kv_pushes_total"] - pushes == len(prompts)
    assert prefill.kv_connector_stats["kv_pairs_opened_total"] == 1  # no failure tore the pair down
    assert (set(settled_decode(cluster).kv_connector_stats["kv_bytes_fetched_by_backend"])
            == {"torch"})
