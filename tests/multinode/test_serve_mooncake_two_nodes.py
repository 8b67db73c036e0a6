"""`pdcluster serve --kv-transfer mooncake` as a user runs it, disaggregated over two Ray nodes
of a `ray.cluster_utils.Cluster` on this machine: the prefill on the node offering the
``prefill`` resource, the decode on the one offering ``decode`` (``--placement resources``),
each with its own Transfer Engine; greedy output through the real `openai` client against HF,
with layer streaming off (whole regions over TE) and on (each layer's piece over TE).

The serve process joins the cluster (``--address``); this process never connects to Ray.
"""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.markers import starts
from tests.serve_process import start_serve

from tests.real_parts import MOONCAKE_HINT, import_real_part

import_real_part("mooncake.engine", "Mooncake's Transfer Engine", MOONCAKE_HINT)

pytestmark = pytest.mark.slow

MODEL = "stories260K"
PROMPTS = ("Once upon a time, there was a little girl named Lily. She loved to play outside in "
           "the park with her friends. One day, she saw a big red ball",
           "The little dog ran to the tree and")
MAX_TOKENS = 24


@pytest.fixture(scope="module")
@starts("ray")
def ray_nodes():
    """A head (no role) and two worker nodes: {"prefill": 1} and {"decode": 1}; yields the
    cluster and {node id: role}."""
    import ray
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized(), "run tests/multinode in its own pytest process"
    small = {"object_store_memory": 80 << 20}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, **small})
    nodes = {role: cluster.add_node(num_cpus=2, resources={role: 1}, **small)
             for role in ("prefill", "decode")}
    cluster.wait_for_nodes()
    yield cluster, {node.node_id: role for role, node in nodes.items()}
    cluster.shutdown()


def serve(cluster, log: Path, *flags: str) -> tuple[subprocess.Popen, int]:
    return start_serve(log, "--address", cluster.address, "--placement", "resources",
                       "--kv-transfer", "mooncake", "--pd-decider", "always", *flags,
                       timeout_s=240)


def transfer_bytes(port: int) -> dict[str, float]:
    """pdcluster_kv_transfer_bytes_total by backend, from the gateway's /metrics."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {backend: float(n) for backend, n in re.findall(
        r'^pdcluster_kv_transfer_bytes_total\{backend="([^"]+)"\} (\S+)$', text, re.M)}


@pytest.mark.parametrize("streaming", ["request", "layer"])
@pytest.mark.server
def test_greedy_output_over_te_across_two_nodes_matches_hf(ray_nodes, hf, tmp_path, streaming):
    cluster, role_of = ray_nodes
    log = tmp_path / "serve.log"
    proc, port = serve(cluster, log, "--kv-streaming", streaming)
    try:
        placed = dict(re.findall(r"(prefill|decode)-0 ready: pid \d+ on node (\w+)",
                                 log.read_text()))
        assert {role: role_of.get(node) for role, node in placed.items()} == \
            {"prefill": "prefill", "decode": "decode"}, log.read_text()[-4000:]

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        for prompt in PROMPTS:
            prompt_ids = hf.encode(prompt)
            out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                            temperature=0,
                                            extra_body={"return_token_ids": True})
            assert out.choices[0].model_extra["token_ids"] == hf.greedy(prompt_ids, MAX_TOKENS)

        moved = transfer_bytes(port)
        carrier = "mooncake" if streaming == "request" else "layer-mooncake"
        assert moved.get(carrier, 0) > 0, moved
        assert all(n == 0 for backend, n in moved.items() if backend != carrier), moved
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
