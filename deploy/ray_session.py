"""The Ray a deployment runs on: a local one started here, a cluster joined at ``--address``,
or the Ray this process already runs; and the node's CPU plan, which must be known before a
local Ray starts.

Nothing here imports torch, so that `pdcluster serve` can start Ray while the gateway's own
imports (torch, the actor classes) load on another thread (deploy/cli.py).
"""

from __future__ import annotations

import logging
import os

import ray

from pdcluster.deploy import placement
from pdcluster.deploy.config import ServeConfig
from pdcluster.deploy.local_ray import LocalRay, start_local_ray
from pdcluster.engine import cpu_binding

log = logging.getLogger(__name__)


def cpu_plan(config: ServeConfig) -> tuple[str, list[int] | None]:
    """(each worker's engine.cpu_bind, the cores a local Ray's own processes start on, or
    None for all): ServeConfig.cpu_bind resolved for this node when the deployment is one
    node, this one."""
    if config.cpu_bind != cpu_binding.AUTO or config.address is not None \
            or not hasattr(os, "sched_getaffinity"):
        return config.cpu_bind, None
    cores = sorted(os.sched_getaffinity(0))
    threads = config.local_worker_threads()
    if threads > len(cores):
        log.info("cpu binding off: the workers' %d torch threads outnumber the %d cores",
                 threads, len(cores))
        return cpu_binding.NONE, None
    split = cpu_binding.split_node_cores(threads, cores)
    if split is None:
        return cpu_binding.format_cpu_list(cores), None
    workers, rest = split
    log.info("cores %s for the workers, %s for Ray's own processes",
             cpu_binding.format_cpu_list(workers), cpu_binding.format_cpu_list(rest))
    return cpu_binding.format_cpu_list(workers), rest


class RaySession:
    """Ray as one deployment found or made it. Use :meth:`open`, then :meth:`close` once.

    Attributes:
        worker_cpu_bind: each worker's engine.cpu_bind (:func:`cpu_plan`).
    """

    def __init__(self, worker_cpu_bind: str, local: LocalRay | None, started: bool) -> None:
        self.worker_cpu_bind = worker_cpu_bind
        self._local = local  # the Ray this process started, None when it joined one
        self._started = started  # this process called ray.init (started or joined)

    @classmethod
    def open(cls, config: ServeConfig) -> "RaySession":
        """Plan the node's cores, then start a local Ray (no ``address``: loopback only, swept
        up if this process dies) or join ``config.address``; use the Ray this process runs
        already, if any, and leave it running at :meth:`close`.

        Raises:
            Exception from ``ray.init`` or deploy.local_ray.start_local_ray: Ray did not start.
        """
        worker_cpu_bind, ray_cpus = cpu_plan(config)
        if ray.is_initialized():
            return cls(worker_cpu_bind, None, started=False)
        if config.address is None:
            local = start_local_ray(config.local_ray_num_cpus(), config.ray_namespace,
                                    placement.local_node_resources(), ray_cpus)
            return cls(worker_cpu_bind, local, started=True)
        # someone else's cluster: neither bound nor cleaned up by us
        ray.init(address=config.address, namespace=config.ray_namespace)
        return cls(worker_cpu_bind, None, started=True)

    @classmethod
    def joined(cls, config: ServeConfig) -> "RaySession":
        """The Ray this process has joined already (ray.init on a running cluster): left, not
        stopped, at :meth:`close`."""
        return cls(cpu_plan(config)[0], None, started=True)

    def close(self) -> None:
        """Stop the Ray this process started (its guardian sweeps whatever Ray left running),
        or leave the cluster it joined; a Ray found running stays."""
        if self._local is not None:
            self._local.shutdown()
        elif self._started:
            ray.shutdown()
        self._local, self._started = None, False
