"""`pdcluster serve` as a real subprocess, for the tests that run it as a user does."""

from __future__ import annotations

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
    ``timeout_s``."""
    port = free_port()
    exe = Path(sys.executable).parent / "pdcluster"
    with log.open("w") as out:
        proc = subprocess.Popen([str(exe), "serve", "--port", str(port), *flags],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"pdcluster serve exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    pytest.fail(f"server not healthy in {timeout_s:.0f} s:\n{log.read_text()}")
