"""`--kv-transfer mooncake` through the launcher: the prefill actor offers each request's KV in
memory its Transfer Engine registered, the decode actor the Conductor picked reads it with TE
over TCP (two Ray actor processes), and generates from it. Outputs against HF. (TE's
listeners: tests/security/test_ray_listeners.py.)

Runs on a local one-node Ray of its own, in its own pytest process (see
tests/multinode/test_kv_transfer_torch.py for why).
"""

from __future__ import annotations

import pytest

from pdcluster.deploy.config import ServeConfig
from pdcluster.kvstore.config import KVTransferConfig
from tests.multinode.test_kv_transfer_torch import (STORY, check_output_depends_on_received_kv,
                                                    run, run_concurrently, settled_decode,
                                                    stats, tokens_of)

from tests.faults import FAULTY
from tests.real_parts import MOONCAKE_HINT, import_real_part

import_real_part("mooncake.engine", "Mooncake's Transfer Engine", MOONCAKE_HINT)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(local_cluster):
    config = ServeConfig(pd_decider="always",
                         transfer=KVTransferConfig(backend="mooncake"), ray_num_cpus=4,
                         ray_namespace="pdc-kv-mooncake")
    with local_cluster(config, FAULTY) as c:
        yield c


def test_kv_comes_over_te_and_output_matches_hf(cluster, hf):
    prompt = hf.encode(STORY)
    expected = hf.greedy(prompt, 32)
    assert tokens_of(run(cluster, "mc-1", prompt, 32)) == expected
    decode = settled_decode(cluster)
    assert (decode.kv_connector_stats["kv_bytes_fetched_by_backend"]
            == {"mooncake": decode.kv_connector_stats["kv_bytes_fetched_total"]})
    assert decode.kv_connector_stats["kv_bytes_fetched_total"] > 0
    prefill = stats(cluster.prefill[0])
    assert prefill.kv_connector_stats["kv_mooncake_regions_offered_total"] == 1


def test_decode_output_depends_on_kv_read_over_te(cluster, hf):
    check_output_depends_on_received_kv(cluster, hf, "mooncake")


def test_concurrent_requests_and_regions_come_back(cluster, hf):
    prompts = [hf.encode(t) for t in ("Once upon a time", "The cat", STORY, "One day, a dog")]
    lengths = [40, 8, 24, 16]
    expected = [hf.greedy(p, n) for p, n in zip(prompts, lengths)]
    assert run_concurrently(cluster, "mc-batch", prompts, lengths) == expected
    settled_decode(cluster)
    prefill = stats(cluster.prefill[0])
    assert prefill.kv_connector_stats["kv_mooncake_regions_leased"] == 0
    assert prefill.kv_connector_stats["kv_mooncake_regions_released_total"] == \
        prefill.kv_connector_stats["kv_mooncake_regions_offered_total"]

