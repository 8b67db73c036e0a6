"""API keys on the gateway, through real HTTP (uvicorn) and the real openai client."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI

from pdcluster.router.auth import APIKeyAuth, load_api_keys
from tests.markers import starts


@pytest.fixture(scope="module")
@starts("server")
def base_url():
    app = FastAPI()
    app.add_middleware(APIKeyAuth, keys=["key-one", "key-two"])

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "x",
                                            "created": 0}]}

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)


def test_missing_or_wrong_key_gets_401_openai_body(base_url):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "key-one"},
                    {"Authorization": "Basic key-one"}):
        r = httpx.get(f"{base_url}/v1/models", headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["type"] == "authentication_error"
        assert "key-one" not in r.text


def test_valid_keys_pass_and_health_stays_open(base_url):
    assert httpx.get(f"{base_url}/health").status_code == 200
    for key in ("key-one", "key-two"):
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0)
        assert [m.id for m in client.models.list().data] == ["m"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base_url}/v1", api_key="bad", max_retries=0).models.list()


def test_key_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team keys\nalpha\n\n  beta  \n")
    assert load_api_keys(["gamma", " "], path) == ["gamma", "alpha", "beta"]
    with pytest.raises(ValueError):
        APIKeyAuth(FastAPI(), [])
