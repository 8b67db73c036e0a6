"""`pdcluster serve --address HOST:PORT` joins a Ray cluster someone else started
(docs/deployment.md, "A Ray cluster on VMs"): here `ray start --head --block` in its own process group, advertising
the role resources of deploy/placement.py. The gateway answers with HF's greedy tokens, starts
no Ray of its own, and leaves the cluster running when it stops.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest

from pdcluster.deploy.placement import local_node_resources
from tests.markers import starts

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(proc: subprocess.Popen, grace_s: float = 15) -> None:
    """SIGTERM the process group `proc` leads (started with start_new_session), then SIGKILL."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def ray_env() -> dict:
    """Ray token authentication, as docs/deployment.md asks of every node and of `pdcluster
    serve`: RAY_AUTH_MODE=token and one shared RAY_AUTH_TOKEN (not ~/.ray/auth_token: test isolation)."""
    return {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}


@pytest.fixture(scope="module")
@starts("ray")
def ray_head(tmp_path_factory, ray_env):
    """A Ray head started as an operator would: `ray start --head`, prefill and decode roles."""
    import ray._private.services

    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="pdc-ray-", dir="/tmp")  # short: unix socket paths
    log = tmp_path_factory.mktemp("ray-head") / "ray-start.log"
    cmd = [str(BIN / "ray"), "start", "--head", f"--port={port}", "--num-cpus=4",
           f"--resources={json.dumps(local_node_resources())}", "--include-dashboard=false",
           "--disable-usage-stats", f"--temp-dir={temp_dir}", "--block"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=ray_env,
                                start_new_session=True)
    try:
        deadline = time.time() + 90
        while "Ray runtime started" not in log.read_text():
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"ray start --head failed:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield proc, f"{ray._private.services.get_node_ip_address()}:{port}"
    finally:
        # `ray start --block` is not gone 15 s after a SIGTERM; its shutdown is Ray's, not
        # under test: the group is killed soon after
        stop_group(proc, grace_s=2)


@pytest.mark.server
def test_serve_joins_an_existing_cluster(ray_head, ray_env, hf, tmp_path):
    head, address = ray_head
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        serve = subprocess.Popen([str(BIN / "pdcluster"), "serve", "--address", address,
                                  "--port", str(port)],
                                 stdout=out, stderr=subprocess.STDOUT, env=ray_env,
                                 start_new_session=True)
    try:
        deadline = time.time() + 180
        while True:
            if serve.poll() is not None:
                pytest.fail(f"pdcluster serve exited {serve.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                pytest.fail(f"not healthy in 180 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        # it joined: no Ray processes of its own under it
        names = {p.name() for p in psutil.Process(serve.pid).children(recursive=True)}
        assert not names & {"raylet", "gcs_server"}, names

        prompt_ids = hf.encode("Once upon a time")
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
            "model": "stories260K", "prompt": prompt_ids, "max_tokens": 24, "temperature": 0,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == hf.greedy(prompt_ids, 24)

        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        stop_group(serve)
    assert head.poll() is None, "stopping the gateway must leave the existing cluster running"
    host, gcs_port = address.rsplit(":", 1)
    with socket.create_connection((host, int(gcs_port)), timeout=5):
        pass
