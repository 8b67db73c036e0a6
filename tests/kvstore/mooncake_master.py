"""A real `mooncake_master` (the binary in the `mooncake` wheel) on free loopback ports, for
the `--kv-pool mooncake-store` tests."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

from tests.kvstore.conftest import _free_port, stop_process


class MooncakeMaster:
    """`mooncake_master` bound to 127.0.0.1 (RPC and metrics); `address` is "host:port"."""

    def __init__(self, workdir: Path, lease_ms: int = 5000) -> None:
        import mooncake

        self.binary = Path(os.path.dirname(mooncake.__file__)) / "mooncake_master"
        self.port, self.metrics_port = _free_port(), _free_port()
        self.workdir, self.lease_ms = workdir, lease_ms
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        with open(self.workdir / f"mooncake-master-{self.port}.log", "ab") as log:
            self.proc = subprocess.Popen(
                [str(self.binary), "-rpc_address=127.0.0.1", f"-rpc_port={self.port}",
                 "-metrics_host=127.0.0.1", f"-metrics_port={self.metrics_port}",
                 "-enable_metric_reporting=false", f"-default_kv_lease_ttl={self.lease_ms}"],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"mooncake_master did not start on port {self.port}")
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
        self.proc = None
