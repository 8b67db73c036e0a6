"""A request the Conductor's admission refuses gets HTTP 429 with Retry-After, and is counted
by reason in /metrics (no Ray: the rejection comes before any worker is called)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from pdcluster.engine.config import BUNDLED_MODEL
from pdcluster.engine.tokenizer import Tokenizer
from pdcluster.router.admission import SLO
from pdcluster.router.chat_template import ChatTemplate
from pdcluster.router.conductor import Conductor, Instance, InstanceRegistry
from pdcluster.router.cost_model import MOONCAKE_70B
from pdcluster.router.gateway import build_app
from pdcluster.router.pipeline import Pipeline


def refusing_gateway(priority_scheduling: bool = False) -> TestClient:
    reg = InstanceRegistry()
    reg.add(Instance("prefill-0", "prefill", None))
    reg.add(Instance("decode-0", "decode", None))
    # every prefill under mooncake-70b takes >= 50 ms: a 10 ms TTFT SLO refuses everything
    conductor = Conductor(reg, "least_loaded", cost_model=MOONCAKE_70B, admission="arrival",
                          slo=SLO(ttft_s=0.01, tbt_s=0.1))
    app = build_app(Pipeline(conductor), Tokenizer.from_pretrained(BUNDLED_MODEL),
                    "stories260K", 512, ChatTemplate.from_model_dir(BUNDLED_MODEL),
                    priority_scheduling=priority_scheduling)
    return TestClient(app)


@pytest.fixture
def client():
    return refusing_gateway()


@pytest.mark.parametrize("stream", [False, True])
def test_rejected_request_gets_429_with_retry_after(client, stream):
    r = client.post("/v1/completions", json={"model": "stories260K", "prompt": "Once upon",
                                             "max_tokens": 5, "stream": stream})
    assert r.status_code == 429
    assert int(r.headers["retry-after"]) >= 1
    error = r.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "ttft_slo"
    assert "TTFT" in error["message"]


def test_rejections_are_counted_by_reason(client):
    for _ in range(2):
        client.post("/v1/chat/completions", json={
            "model": "stories260K", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3, "n": 2})
    metrics = client.get("/metrics").text
    assert 'pdcluster_requests_rejected_total{reason="ttft_slo"} 2.0' in metrics


@pytest.mark.parametrize("priority_scheduling", [False, True])
def test_a_priority_needs_the_priority_policy(priority_scheduling):
    """vLLM refuses a priority other than 0 unless it schedules by priority; 0 and null are
    always served (here: refused later, by admission, as every request is)."""
    client = refusing_gateway(priority_scheduling)
    body = {"model": "stories260K", "prompt": "Once upon", "max_tokens": 5}
    for priority in (0, None):
        assert client.post("/v1/completions", json={**body, "priority": priority}
                           ).status_code == 429
    r = client.post("/v1/completions", json={**body, "priority": -4})
    if priority_scheduling:
        assert r.status_code == 429
    else:
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
