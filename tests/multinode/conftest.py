"""Shared fixtures of the multinode suite (its own pytest process; see tests/conftest.py)."""

from __future__ import annotations

import contextlib

import pytest
import ray

from pdcluster.deploy.config import ServeConfig
from pdcluster.deploy.launcher import ActorClasses, Cluster
from tests.markers import starts


@pytest.fixture(scope="session")
@starts("ray")
def local_cluster():
    """A context manager starting a launcher Cluster for `config` on a local Ray: reuses a Ray
    this process already runs, else starts one and shuts it down afterwards."""

    @contextlib.contextmanager
    def start(config: ServeConfig, actors: ActorClasses = ActorClasses()):
        started = not ray.is_initialized()
        if started:
            ray.init(address="local", num_cpus=config.local_ray_num_cpus(),
                     namespace=config.ray_namespace, include_dashboard=False)
        try:
            with Cluster(config, actors=actors) as c:
                yield c
        finally:
            if started:
                ray.shutdown()

    return start
