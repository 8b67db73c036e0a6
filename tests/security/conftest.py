"""Fixtures of the security tests that run the real `pdcluster serve` with its local Ray: the
process tree it starts, and the shared-memory arenas those processes own."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from tests.markers import starts

SHM_DIR = Path("/dev/shm")
HEALTHY_WITHIN_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running (a zombie holds no port, lock or memory: it counts as gone).
    psutil.Process remembers its start time, so a reused pid is not mistaken for it."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def describe(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {p.name()}")
        except psutil.Error:
            out.append(f"{p.pid} ?")
    return out


def mapped_segments(procs: list[psutil.Process]) -> set[str]:
    """Names of the /dev/shm/pdc-* segments these processes map or hold open."""
    names = set()
    for p in procs:
        try:
            text = Path(f"/proc/{p.pid}/maps").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            path = line.split(maxsplit=5)[-1]
            if path.startswith(f"{SHM_DIR}/pdc-"):
                names.add(Path(path.split()[0]).name)
    return names


def pdc_segments() -> set[str]:
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith("pdc-")}


def has_live_owner(name: str) -> bool | None:
    """Whether a live process holds the segment's owner lock; None when it no longer exists or
    is still being created (empty)."""
    try:
        fd = os.open(SHM_DIR / name, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        if os.fstat(fd).st_size == 0:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False
    finally:
        os.close(fd)


@dataclass
class Served:
    """One `pdcluster serve` subprocess, leader of its own session."""

    proc: subprocess.Popen
    port: int
    log: Path
    tree: list[psutil.Process] = field(default_factory=list)

    def record_tree(self) -> list[psutil.Process]:
        """Every process under the server now (Ray's processes, workers, the guardian)."""
        self.tree = psutil.Process(self.proc.pid).children(recursive=True)
        return self.tree

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]


@contextlib.contextmanager
def serving(workdir: Path):
    """The factory of `serve` (logs in ``workdir``); on exit SIGKILLs whatever of any
    recorded tree is still running."""
    started: list[Served] = []

    def start(*flags: str) -> Served:
        port = free_port()
        log = workdir / f"serve-{len(started)}.log"
        exe = Path(sys.executable).parent / "pdcluster"
        with log.open("w") as out:
            proc = subprocess.Popen([str(exe), "serve", "--port", str(port), *flags],
                                    stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        served = Served(proc, port, log)
        started.append(served)
        deadline = time.monotonic() + HEALTHY_WITHIN_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"pdcluster serve exited with {proc.returncode}:\n{served.log_tail()}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    served.record_tree()
                    return served
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        pytest.fail(f"server not healthy in {HEALTHY_WITHIN_S} s:\n{served.log_tail()}")

    try:
        yield start
    finally:
        for served in started:
            if served.proc.poll() is None:
                served.record_tree()
                served.proc.send_signal(signal.SIGKILL)
                served.proc.wait(timeout=10)
            for p in alive(served.tree):
                try:
                    p.kill()
                except psutil.Error:
                    pass


@pytest.fixture
@starts("ray", "server")
def serve(tmp_path):
    """Factory: `serve(*flags)` starts `pdcluster serve --port P *flags`, waits for /health
    and returns a Served with its process tree recorded. Teardown SIGKILLs whatever of any
    recorded tree is still running."""
    with serving(tmp_path) as start:
        yield start


@pytest.fixture(scope="module")
@starts("ray", "server")
def module_serve(tmp_path_factory):
    """`serve` for a module whose tests only look at the servers they share."""
    with serving(tmp_path_factory.mktemp("serve")) as start:
        yield start
