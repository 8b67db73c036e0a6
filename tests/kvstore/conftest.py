"""Shared kvstore fixtures: real KV store gRPC servers (``make_server``), a local Ray cluster
per module (``ray_cluster``), and a real ``redis-server`` per test session (and fresh ones on
demand) for the index tests.

Started on a free port with persistence off (``--save "" --appendonly no``), bound to 127.0.0.1,
killed at teardown. Tests needing it are skipped when the ``redis-server`` binary or redis-py
is missing (``scripts/setup.sh --dev`` installs both), and fail then under ``CI=true``
(tests/real_parts.py).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.markers import starts
from tests.real_parts import import_real_part, require_real_part


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_process(proc: subprocess.Popen, kill: bool = False) -> None:
    """Terminate (or SIGKILL) a server subprocess and wait for it; SIGKILL after 10 s."""
    if proc.poll() is None:
        proc.kill() if kill else proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class RedisServer:
    """One ``redis-server`` subprocess on a fixed port; ``restart`` keeps the port."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        import redis

        log = open(self.workdir / f"redis-{self.port}.log", "ab")
        self.proc = subprocess.Popen(
            [shutil.which("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with redis.Redis(port=self.port, socket_connect_timeout=0.5) as client:
                    client.ping()
                return
            except redis.exceptions.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on port {self.port}; "
                                       f"see {self.workdir}")
                time.sleep(0.05)

    def stop(self, kill: bool = False) -> None:
        """Terminate (or SIGKILL, like a crash) the server and wait for it."""
        if self.proc is not None:
            stop_process(self.proc, kill)
        self.proc = None

    def restart(self, kill: bool = True) -> None:
        self.stop(kill=kill)
        self.start()


def _need_redis() -> None:
    import_real_part("redis", "redis-py", "scripts/setup.sh --dev installs it")
    require_real_part("redis-server", shutil.which("redis-server") is not None,
                      "not on PATH (scripts/setup.sh --dev installs it)")


@pytest.fixture(scope="session")
@starts("server")
def redis_server(tmp_path_factory):
    """A server shared by the session; tests isolate themselves with a key namespace."""
    _need_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
@starts("server")
def fresh_redis_server(tmp_path):
    """A server of the test's own, for tests that kill or restart it."""
    _need_redis()
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
@starts("server")
def make_server():
    """Start real KV store gRPC servers on port 0: ``make(config, store, max_workers)``
    (store: an LRUBlockStore sized by ``config`` unless given); all stopped at teardown."""
    from pdcluster.kvstore.config import KVStoreConfig
    from pdcluster.kvstore.server import KVStoreServer
    from tests.kvstore.lru_block_store import LRUBlockStore

    servers = []

    def make(config: KVStoreConfig | None = None, store=None, max_workers: int = 64):
        config = config or KVStoreConfig()
        store = store if store is not None else LRUBlockStore.for_config(config)
        server = KVStoreServer(config, store, max_workers=max_workers)
        server.start()
        servers.append(server)
        return server

    yield make
    for s in servers:
        s.stop(grace=0)


@pytest.fixture(scope="module")
@starts("ray")
def ray_cluster():
    """A local Ray for the module's actors (or the one a session fixture already runs)."""
    ray = import_real_part("ray", "Ray")
    if ray.is_initialized():
        yield
        return
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
