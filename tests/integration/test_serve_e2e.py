"""`pdcluster serve` as a user runs it: a real subprocess, real HTTP, the real openai client."""

from __future__ import annotations

import signal
import socket

import httpx
import psutil
import pytest
from openai import OpenAI

pytestmark = pytest.mark.slow

MODEL = "stories260K"
KEY = "e2e-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def port_is_free(port: int) -> bool:
    """A new server can bind it: nothing listens there. SO_REUSEADDR, as uvicorn and every
    server sets, so closed connections still in TIME_WAIT do not count."""
    if any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
           for c in psutil.net_connections("tcp")):
        return False
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.fixture(scope="module")
def server(serve_process):
    return serve_process("--api-key", KEY)


def test_streamed_greedy_completion_matches_hf(server, hf):
    _, port, _ = server
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY)
    prompt = "Once upon a time"
    prompt_ids = hf.encode(prompt)
    expected = hf.greedy(prompt_ids, 64)

    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=64,
                                       temperature=0, stream=True,
                                       extra_body={"return_token_ids": True})
    text, ids, finish = "", [], None
    for chunk in stream:
        choice = chunk.choices[0]
        text += choice.text
        ids += choice.model_extra["token_ids"]
        finish = choice.finish_reason or finish
    assert ids == expected
    tok = hf.tokenizer
    prompt_text = tok.decode(prompt_ids, skip_special_tokens=True)
    assert text == tok.decode(prompt_ids + ids, skip_special_tokens=True)[len(prompt_text):]
    assert finish in ("length", "stop")


def test_non_streamed_completion_and_models(server, hf):
    _, port, _ = server
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY)
    assert [m.id for m in client.models.list().data] == [MODEL]
    prompt_ids = hf.encode("The little dog")
    out = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=20,
                                    temperature=0, extra_body={"return_token_ids": True})
    expected = hf.greedy(prompt_ids, 20)
    assert out.choices[0].model_extra["token_ids"] == expected
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == len(expected)


def test_bad_requests_get_openai_errors(server):
    _, port, _ = server
    base = f"http://127.0.0.1:{port}/v1/completions"
    r = httpx.post(base, json={"model": MODEL, "prompt": "hi"})  # no key
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200  # probes need none
    r = httpx.post(base, json={"model": "nope", "prompt": "hi"}, headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(base, json={"model": MODEL, "prompt": "hi", "max_tokens": 0}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(base, json={"model": MODEL, "prompt": "hi", "max_tokens": 600}, headers=AUTH)
    assert r.status_code == 400 and "over the limit" in r.json()["error"]["message"]


def test_sigterm_leaves_no_process_and_frees_the_port(server):
    proc, port, log = server
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    assert len(tree) >= 4, "expected Ray processes and worker actors under pdcluster serve"
    proc.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(tree, timeout=30)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"survivors: {[(p.pid, p.name()) for p in alive]}\n{log.read_text()[-3000:]}"
    assert proc.wait(timeout=5) == 0
    assert port_is_free(port)
