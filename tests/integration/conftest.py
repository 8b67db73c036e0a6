"""Fixtures for tests that run the real cluster: one local Ray cluster per test session with
the gateway served over real HTTP by uvicorn."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
from pathlib import Path

import psutil
import pytest

from pdcluster.deploy.config import ServeConfig
from pdcluster.deploy.launcher import Cluster
from pdcluster.deploy.serve import gateway_app
from pdcluster.engine.tokenizer import Tokenizer
from pdcluster.router.chat_template import ChatTemplate
from pdcluster.router.gateway import build_app
from pdcluster.router.reasoning import ReasoningParser
from tests.background_server import BackgroundServer
from tests.faults import FAULTY
from tests.markers import starts
from tests.serve_process import start_serve


@pytest.fixture
def stalled_address():
    """A TCP server that accepts connections and never says a word (a hung KV store or
    Transfer Engine peer)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held + [listener]:
        conn.close()


@pytest.fixture(scope="session")
@starts("ray")
def cluster():
    """Local Ray with one KV store, one prefill and one decode actor (default ServeConfig, with
    the workers' fault injection on for the tests that use it, no core pinning: this
    cluster lives for the whole session, and its claims would leave no core to the served
    clusters of tests/deploy that check pinning; and every request disaggregated, as the
    tests of the transfer path need: tests/integration/test_pd_decider.py runs the others)."""
    with Cluster(ServeConfig(ray_num_cpus=4, cpu_bind="none", pd_decider="always"),
                 actors=FAULTY) as c:
        yield c


@pytest.fixture(scope="session")
@starts("server")
def api_base(cluster) -> str:
    """Base URL (http://127.0.0.1:PORT/v1) of the gateway `pdcluster serve` would run."""
    with BackgroundServer(gateway_app(cluster.config, cluster)) as server:
        yield f"{server.url}/v1"


@pytest.fixture(scope="session")
@starts("server")
def reasoning_api_base(cluster) -> str:
    """Base URL of a gateway over the session cluster with `--reasoning-parser qwen3`."""
    model_dir = cluster.config.engine.model
    app = build_app(cluster.pipeline, Tokenizer.from_pretrained(model_dir), "stories260K", 512,
                    ChatTemplate.from_model_dir(model_dir), reasoning=ReasoningParser("qwen3"))
    with BackgroundServer(app) as server:
        yield f"{server.url}/v1"


@pytest.fixture(scope="session")
@starts("ray", "server")
def serve_process(tmp_path_factory):
    """Factory: `serve_process(*flags)` starts `pdcluster serve --port P *flags` as a real
    subprocess (own session, output in a log file), waits for /health, and returns
    (Popen, port, log path). Whatever is still running at session end is killed."""
    started: list[subprocess.Popen] = []

    def start(*flags: str) -> tuple[subprocess.Popen, int, Path]:
        log = tmp_path_factory.mktemp("serve") / "serve.log"
        proc, port = start_serve(log, *flags)
        started.append(proc)
        return proc, port, log

    yield start
    for proc in started:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):  # it may exit meanwhile
                    child.kill()
            proc.kill()
