"""The local Ray cluster `pdcluster serve` starts when it joins none: loopback only, and
fate-shared with this process (deploy/fate_share.py); and the one `pdcluster cluster up`
starts, loopback only too, which outlives it (`LocalHead`).

Loopback. Ray binds its gRPC servers (GCS, raylet, object manager, every core worker), the
runtime-env and dashboard agents and the autoscaler's Prometheus metrics server to 127.0.0.1
only when the node's IP is loopback; otherwise to every interface (``*``, ``0.0.0.0``) or to
the node's routable IP. There is no bind-address option, and ``ray.init(_node_ip_address=
"127.0.0.1")`` turns loopback into the routable IP on purpose
(``ray._private.services.resolve_ip_for_localhost``). Ray's one switch for a loopback node IP
is ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` ("no multi-node clusters"), read once at import
into ``ray._private.ray_constants.ENABLE_RAY_CLUSTER``; it is set False around ``ray.init``
only, so joining a cluster (``--address``) keeps its routable IP. Every process of the local
cluster learns the node IP from the command line Ray gives it. No other machine can join such
a cluster: for several nodes start Ray with ``ray start`` and pass ``--address``.

Priority. Ray starts its worker processes at niceness 15 (``worker_niceness``), so that a
node's own daemons win over user tasks. Here the workers are the engines: at nice 15 every
wake-up of the gateway or of a load client preempts one of an engine's compute threads, and
its OpenMP team then waits at the next barrier; the local cluster runs them at niceness 0, as
the gateway runs. A cluster started with ``ray start`` takes the same setting from
``RAY_worker_niceness=0`` in its environment.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import ray

from pdcluster.deploy import fate_share
from pdcluster.deploy.fate_share import Guardian

log = logging.getLogger(__name__)


class LocalRay:
    """A Ray cluster this process started (and its guardian, where the platform has one)."""

    def __init__(self, node_ip: str, guardian: Guardian | None) -> None:
        self.node_ip = node_ip
        self.guardian = guardian

    def shutdown(self) -> None:
        """Stop Ray's processes, then let the guardian kill any straggler and reclaim the
        arenas of dead owners."""
        try:
            ray.shutdown()
        finally:
            if self.guardian is not None:
                self.guardian.close()
                self.guardian = None


def start_local_ray(num_cpus: int, namespace: str, resources: dict[str, float],
                    cpus: list[int] | None = None) -> LocalRay:
    """Start a new single-node Ray (never a stray one already running on this machine) bound
    to loopback, dashboard off, with a guardian that cleans it up if this process dies.

    Args:
        num_cpus: logical CPUs the node advertises.
        namespace: Ray namespace of this driver.
        resources: custom resources the node advertises (role labels).
        cpus: cores Ray's processes start on (they inherit this thread's affinity, set only
            while Ray starts): GCS, raylet, agents and every worker process, which a worker
            engine then re-pins to its own cores (engine.cpu_binding). None: all of them.

    Raises:
        fate_share.GuardianError: the guardian process could not be started.
        Exception from ``ray.init``: Ray did not start; the guardian has swept what it left.
    """
    guardian = Guardian.start() if fate_share.supported() else None
    marked = guardian.marked_environment() if guardian else contextlib.nullcontext()
    try:
        with marked, loopback_node_ip(), _affinity(cpus):
            context = ray.init(address="local", num_cpus=num_cpus, namespace=namespace,
                               resources=resources, include_dashboard=False, log_to_driver=True,
                               _system_config=_system_config())
    except BaseException:
        if guardian is not None:
            guardian.close()
        raise
    node_ip = context.address_info["node_ip_address"]
    if guardian is not None:
        guardian.watch_session(context.address_info["session_dir"])
    if not ipaddress.ip_address(node_ip).is_loopback:
        log.warning("local Ray runs on node IP %s, not loopback: its ports listen on every "
                    "interface; keep them behind a firewall", node_ip)
    return LocalRay(node_ip, guardian)


def _system_config() -> dict:
    """Ray settings of the local cluster: workers at niceness 0 (module docstring), unless
    the environment sets Ray's own variable for it."""
    return {} if "RAY_worker_niceness" in os.environ else {"worker_niceness": 0}


@contextlib.contextmanager
def _affinity(cpus: list[int] | None) -> Iterator[None]:
    """While inside, this thread (and every process it starts) runs on `cpus` only."""
    if cpus is None:
        yield
        return
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


@contextlib.contextmanager
def loopback_node_ip() -> Iterator[None]:
    """While inside, Ray picks 127.0.0.1 as a new node's IP (module docstring)."""
    from ray._private import ray_constants

    if not hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):  # a Ray without the switch
        yield
        return
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


@dataclass(frozen=True)
class LocalHead:
    """A single-node Ray that outlives the process that started it (`pdcluster cluster up`):
    `ray start --head --block` in a session of its own, loopback only (module docstring),
    with token authentication. Ray's own supervision: that process stops its daemons when it
    gets SIGTERM, and its reaper does when it dies. address: the GCS address; pid: that
    process."""

    address: str
    pid: int
    temp_dir: str


def start_local_head(num_cpus: int, resources: dict[str, float], log_path: str,
                     cpus: list[int] | None = None, timeout_s: float = 90.0) -> LocalHead:
    """Start a `LocalHead` advertising `num_cpus` and `resources`, in this process's
    environment, which must set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (loopback) and
    RAY_AUTH_MODE=token with its RAY_AUTH_TOKEN; its output goes to `log_path`. Raises
    RuntimeError when it has not started within `timeout_s`."""
    port = _free_port()
    env = dict(os.environ)
    env.setdefault("RAY_worker_niceness", "0")
    # a temp dir of its own: Ray writes its address file there, where a plain ray.init() of
    # another program on this machine does not look (it would join this cluster); short,
    # for Ray's unix socket paths
    temp_dir = tempfile.mkdtemp(prefix="pdc-ray-", dir="/tmp")
    command = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head",
               "--block", f"--port={port}", "--node-ip-address=127.0.0.1",
               f"--num-cpus={num_cpus}", f"--resources={json.dumps(resources)}",
               "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}"]
    with open(log_path, "wb") as out, _affinity(cpus):
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while not _started(log_path):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_local_head(proc.pid, temp_dir)
            raise RuntimeError(f"ray start --head did not start (see {log_path})")
        time.sleep(0.25)
    return LocalHead(f"127.0.0.1:{port}", proc.pid, temp_dir)


def stop_local_head(pid: int, temp_dir: str | None = None, timeout_s: float = 30.0) -> None:
    """SIGTERM a LocalHead's `ray start` process (it stops its daemons), SIGKILL its process
    group if it is still there after `timeout_s`; then remove its temp dir."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            os.kill(pid, 0)  # ProcessLookupError once it is gone
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)  # ours: reap it
            time.sleep(0.2)
        os.killpg(pid, signal.SIGKILL)
    if temp_dir:
        shutil.rmtree(temp_dir, ignore_errors=True)


def _started(log_path: str) -> bool:
    with open(log_path, "rb") as f:
        return b"Ray runtime started" in f.read()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
