"""Starts (or joins) a Ray cluster and brings up the KV stores and worker actors.

Used by `pdcluster serve` and by the integration tests, so both run the same start-up path.
"""

from __future__ import annotations

import logging

import ray

from decode_worker.actor import DecodeWorker
from deploy.config import ServeConfig
from kvstore.actor import start_kvstore_actors
from prefill_worker.actor import PrefillWorker
from router.conductor import Conductor, Instance, InstanceRegistry
from router.pipeline import Pipeline

log = logging.getLogger(__name__)

# Calls a prefill actor answers at once; its engine lock serializes the forwards themselves.
PREFILL_MAX_CONCURRENCY = 8


class Cluster:
    """The running actors of one deployment. Use as a context manager or call shutdown()."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.registry = InstanceRegistry()
        self.conductor = Conductor(self.registry, config.policy)
        self.pipeline = Pipeline(self.conductor)
        self.kvstores: dict = {}
        self.prefill: list[Instance] = []
        self.decode: list[Instance] = []
        self._started_ray = False

    def start(self) -> "Cluster":
        cfg = self.config
        if not ray.is_initialized():
            if cfg.address is None:
                ray.init(num_cpus=cfg.local_ray_num_cpus(), namespace=cfg.ray_namespace,
                         include_dashboard=False, log_to_driver=True)
            else:
                ray.init(address=cfg.address, namespace=cfg.ray_namespace)
            self._started_ray = True
        self.kvstores = start_kvstore_actors(cfg.kvstore, cfg.ray_namespace)
        timeout = cfg.kvstore.transfer_timeout_s
        for i in range(cfg.prefill_instances):
            handle = PrefillWorker.options(
                num_cpus=cfg.actor_num_cpus, max_concurrency=PREFILL_MAX_CONCURRENCY,
            ).remote(f"prefill-{i}", cfg.engine, timeout, cfg.ray_namespace)
            self.prefill.append(Instance(f"prefill-{i}", "prefill", handle))
        for i in range(cfg.decode_instances):
            handle = DecodeWorker.options(num_cpus=cfg.actor_num_cpus).remote(
                f"decode-{i}", cfg.engine, timeout)
            self.decode.append(Instance(f"decode-{i}", "decode", handle))
        infos = ray.get([i.handle.info.remote() for i in self.prefill + self.decode])
        for instance, info in zip(self.prefill + self.decode, infos):
            log.info("%s ready: pid %s on node %s", instance.worker_id, info["pid"],
                     info["node_id"])
            self.registry.add(instance)
        return self

    def shutdown(self) -> None:
        for instance in self.prefill + self.decode:
            ray.kill(instance.handle, no_restart=True)
        for handle in self.kvstores.values():
            ray.kill(handle, no_restart=True)
        self.prefill, self.decode, self.kvstores = [], [], {}
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()
