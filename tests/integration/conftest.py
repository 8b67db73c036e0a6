"""Fixtures for tests that run the real cluster: one local Ray cluster per test session with
the gateway served over real HTTP by uvicorn."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn

from deploy.config import ServeConfig
from deploy.launcher import Cluster
from deploy.serve import gateway_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def cluster():
    """Local Ray with one KV store, one prefill and one decode actor (default ServeConfig)."""
    with Cluster(ServeConfig(ray_num_cpus=4)) as c:
        yield c


@pytest.fixture(scope="session")
def api_base(cluster) -> str:
    """Base URL (http://127.0.0.1:PORT/v1) of the gateway `pdcluster serve` would run."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(gateway_app(cluster.config, cluster),
                                           host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, name="gateway", daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("gateway did not start")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(timeout=10)
