"""Every gateway of a detached cluster follows its record (deploy.cluster_record): workers a
scaling gateway added are routed to, drained ones get nothing new, removed ones are let go.

A daemon thread reads the record every `interval_s` and, when its version moved, reconciles
the gateway's Cluster with it: a new name is found by name (ray.get_actor) and added to the
registry; a draining one is drained (InstanceRegistry.drain); a name gone from the record
leaves the registry (its actor was stopped by the gateway that retired it).
"""

from __future__ import annotations

import logging
import threading

import ray

from pdcluster.deploy.cluster_record import ClusterManifest, read_record
from pdcluster.router.registry import Instance

log = logging.getLogger(__name__)

#: seconds between two reads of the record
REFRESH_S = 2.0


class MembershipWatch:
    def __init__(self, cluster, interval_s: float = REFRESH_S) -> None:
        """`cluster`: a deploy.launcher.Cluster attached to a detached cluster."""
        self.cluster = cluster
        self.interval_s = interval_s
        self.version: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="membership", daemon=True)

    def start(self) -> MembershipWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.refresh()
            except Exception as exc:  # noqa: BLE001 -- the record restarts; read it next time
                log.warning("cluster record not read: %s", exc)

    def refresh(self) -> None:
        """Read the record once; reconcile when it changed."""
        manifest = read_record(self.cluster.config.ray_namespace, timeout_s=self.interval_s * 5)
        if manifest.version != self.version:
            self.apply(manifest)
            self.version = manifest.version

    def apply(self, manifest: ClusterManifest) -> None:
        cluster, ns = self.cluster, self.cluster.config.ray_namespace
        listed = {"prefill": set(manifest.prefill), "decode": set(manifest.decode)}
        for role, names in listed.items():
            known = {i.worker_id for i in getattr(cluster, role)}
            for name in sorted(names - known):
                try:
                    handle = ray.get_actor(name, namespace=ns)
                except ValueError:
                    continue  # listed before it registered, or gone again: next time
                instance = Instance(name, role, handle)
                getattr(cluster, role).append(instance)
                cluster.registry.add(instance)
                log.info("worker %s joined the cluster: routing to it", name)
            for name in sorted(known - names):
                cluster.forget_instance(name)
                log.info("worker %s left the cluster", name)
        for name in manifest.draining:
            cluster.registry.drain(name)
