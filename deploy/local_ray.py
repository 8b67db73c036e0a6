"""The local Ray cluster `pdcluster serve` starts when it joins none: loopback only, and
fate-shared with this process (deploy/fate_share.py).

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
import logging
import os
from collections.abc import Iterator

import ray

from deploy import fate_share
from deploy.fate_share import Guardian

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
        with marked, _loopback_node_ip(), _affinity(cpus):
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
def _loopback_node_ip() -> Iterator[None]:
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
