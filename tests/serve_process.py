"""`pdcluster serve` as a real subprocess, for the tests that run it as a user does."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(log: Path, *flags: str, timeout_s: float = 180
                ) -> tuple[subprocess.Popen, int]:
    """Start `pdcluster serve --port P *flags` (own session, output in ``log``) and wait for
    /health; returns (Popen, port). Fails the test when it exits or is not healthy in
    ``timeout_s``. A free port can be taken by another process (Ray's own among them) before
    the server binds it: a start that fails so is tried again on another port, twice."""
    for attempt in range(3):
        port = free_port()
        exe = Path(sys.executable).parent / "pdcluster"
        with log.open("w") as out:
            proc = subprocess.Popen([str(exe), "serve", "--port", str(port), *flags],
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if proc.poll() is not None:
                if "address already in use" in log.read_text() and attempt < 2:
                    with contextlib.suppress(ProcessLookupError):  # what it left running
                        os.killpg(proc.pid, signal.SIGKILL)
                    break
                pytest.fail(f"pdcluster serve exited with {proc.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return proc, port
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            proc.kill()
            pytest.fail(f"server not healthy in {timeout_s:.0f} s:\n{log.read_text()}")
    raise AssertionError("unreachable")
