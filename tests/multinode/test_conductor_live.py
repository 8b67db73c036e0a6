"""The Conductor live: `pdcluster serve`'s gateway over 2 prefill instances and 1 decode
instance, routed by kvcache_centric with the global index and load ledger.

  * requests sharing a long prefix go to the prefill instance that holds it in G1;
  * a burst of unrelated requests spreads over both instances;
  * under overload, admission answers 429 with Retry-After, counted by reason in /metrics, and
    the requests it admits are those whose predicted TTFT meets the SLO (how well measured TTFT
    then meets it is a performance figure: benchmarks/RESULTS.md, "Conductor live admission")

Runs on a local Ray of its own in its own pytest process (see tests/conftest.py); reuses a Ray
another fixture of tests/multinode already started, and then leaves it running.
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from pdcluster.deploy.config import ServeConfig
from pdcluster.deploy.launcher import Cluster
from pdcluster.engine.model_config import ModelConfig
from pdcluster.engine.tokenizer import Tokenizer
from pdcluster.router.admission import SLO, make_admission
from pdcluster.router.chat_template import ChatTemplate
from pdcluster.router.conductor import build_live_conductor
from pdcluster.router.gateway import build_app
from pdcluster.router.pipeline import Pipeline

pytestmark = pytest.mark.slow

MODEL = "stories260K"


@pytest.fixture(scope="module")
def cluster(local_cluster):
    config = ServeConfig(pd_decider="always",
                         prefill_instances=2, decode_instances=1, ray_namespace="pdc-conductor",
                         engine={"num_kv_blocks": 2048})
    with local_cluster(config) as c:
        yield c


class Gateway:
    """The gateway app over `conductor`, served by uvicorn on a free port in a thread."""

    def __init__(self, cluster: Cluster, conductor) -> None:
        cfg = cluster.config
        model_dir = cfg.engine.model
        app = build_app(Pipeline(conductor), Tokenizer.from_pretrained(model_dir),
                        cfg.model_name(),
                        cfg.engine.resolved_max_model_len(ModelConfig.from_pretrained(model_dir)),
                        ChatTemplate.from_model_dir(model_dir))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                                    log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "gateway did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def live(cluster: Cluster, admission: str = "none", slo: SLO = SLO()):
    """(conductor, poller, decisions): decisions maps request id -> (prefill instance, predicted
    TTFT s) for each admitted request."""
    cfg = cluster.config
    conductor, poller = build_live_conductor(
        cluster.registry, policy="kvcache_centric", admission=admission, slo=slo,
        cost_model="stories260k-cpu", block_size=cfg.engine.block_size,
        model_name=cfg.model_name(), index_url=cfg.kvpool.index_url)
    decisions: dict[str, str] = {}
    decide = conductor.decide

    def recording(request, prefill_ids, decode_ids):
        decision = decide(request, prefill_ids, decode_ids)
        decisions[request.request_id] = (decision.prefill.instance_id, decision.prefill.ttft_s)
        return decision

    conductor.decide = recording
    return conductor, poller, decisions


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


async def complete(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int = 4
                   ) -> tuple[int, float, dict, httpx.Headers]:
    """(status, TTFT s or -1, body or last chunk, headers) of a streamed completion."""
    began = time.perf_counter()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, -1.0, (await r.aread()) and r.json(), r.headers
        ttft = -1.0
        async for line in r.aiter_lines():
            if line.startswith("data: ") and ttft < 0:
                ttft = time.perf_counter() - began
        return 200, ttft, {}, r.headers


def rejected_total(metrics: str, reason: str = "ttft_slo") -> float:
    prefix = f'pdcluster_requests_rejected_total{{reason="{reason}"}} '
    return sum(float(line[len(prefix):]) for line in metrics.splitlines()
               if line.startswith(prefix))


def run(coro):
    return asyncio.run(coro)


@pytest.mark.server
def test_shared_prefix_follows_its_holder_and_a_burst_spreads(cluster):
    conductor, poller, decisions = live(cluster)
    gateway = Gateway(cluster, conductor)
    try:
        prefix = tokens(1, 320)

        async def scenario():
            async with httpx.AsyncClient(timeout=60) as client:
                for i in range(5):  # one after the other: the prefix is cached after the first
                    status, *_ = await complete(client, gateway.url, prefix + tokens(100 + i, 8))
                    assert status == 200
                    await asyncio.sleep(0.3)  # the worker's G1 events reach the index
                burst = [complete(client, gateway.url, tokens(200 + i, 200)) for i in range(8)]
                return await asyncio.gather(*burst)

        burst = run(scenario())
        assert all(status == 200 for status, *_ in burst)
        routed = [instance for instance, _ in decisions.values()]
        holder = routed[0]
        assert routed[1:5] == [holder] * 4, routed
        spread = routed[5:]
        assert len(spread) == 8 and {p: spread.count(p) >= 2 for p in set(spread)} == \
            {"prefill-0": True, "prefill-1": True}, spread
    finally:
        gateway.stop()
        poller.stop()


@pytest.mark.server
def test_overload_gets_429_with_retry_after_and_admits_only_predicted_slo_hits(cluster):
    conductor, poller, decisions = live(cluster)  # admission switched on after calibration
    gateway = Gateway(cluster, conductor)
    try:
        async def scenario():
            async with httpx.AsyncClient(timeout=120) as client:
                async def at(delay_s: float, seed: int):
                    await asyncio.sleep(delay_s)
                    return await complete(client, gateway.url, tokens(seed, 400))

                solo = [(await at(0.0, 200 + i))[1] for i in range(4)]
                # calibrates the ledger's scale and guard under a burst's contention (the
                # client, the gateway and the workers share this VM's cores)
                calibration = []
                for r in range(2):
                    calibration += await asyncio.gather(*(at(0.002 * i, 300 + 100 * r + i)
                                                          for i in range(40)))
                # the SLO in units of this machine's service time (at least 1 s: the gateway's
                # own work under a burst must stay small against it)
                service_s = sorted(solo)[1]
                slo = SLO(ttft_s=max(1.0, 6 * service_s), tbt_s=1.0)
                conductor.admission, conductor.slo = make_admission("arrival", slo), slo
                before = rejected_total((await client.get(f"{gateway.url}/metrics")).text)
                decisions.clear()
                # a burst needing ~3 SLOs of work on the 2 instances: most must be refused
                burst = min(240, max(60, int(2 * 3 * slo.ttft_s / service_s)))
                results = await asyncio.gather(*(at(0.002 * i, 400 + i) for i in range(burst)))
                after = rejected_total((await client.get(f"{gateway.url}/metrics")).text)
                return results, after - before, slo

        results, counted, slo = run(scenario())
        rejected = [(body, headers) for status, _, body, headers in results if status == 429]
        admitted = [ttft for status, ttft, _, _ in results if status == 200]
        assert rejected and admitted, [r[0] for r in results]
        for body, headers in rejected:
            assert int(headers["retry-after"]) >= 1
            assert body["error"]["type"] == "rate_limit_error"
            assert body["error"]["code"] == "ttft_slo"
        assert counted == len(rejected)
        # admitted exactly when the prediction meets the SLO; each was served
        assert len(decisions) == len(admitted)
        assert all(ttft_s <= slo.ttft_s for _, ttft_s in decisions.values()), decisions
        assert all(t > 0 for t in admitted)
        # NOTE measured TTFT vs the SLO is printed, not asserted: on this VM's 2 shared cores it
        # is a noisy performance figure (the simulator measures attainment: RESULTS.md)
        within = sum(t <= slo.ttft_s for t in admitted) / len(admitted)
        print(f"SLO {slo.ttft_s:.2f} s: admitted {len(admitted)}, rejected {len(rejected)}, "
              f"within SLO {within:.0%}, "
              f"max TTFT {max(admitted):.2f} s")
        assert len(results) == len(rejected) + len(admitted)
    finally:
        gateway.stop()
        poller.stop()
