"""The stall watch over fake stats calls: a worker running requests whose step count stops is
declared hung once the timeout passes, one that stops answering while it runs requests too;
idle workers and workers that step are left alone."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest
import ray

from pdcluster.engine.core.stats import SchedulerStats
from pdcluster.router.registry import Instance, InstanceRegistry
from pdcluster.router.stall_watch import StallWatch
from tests.kvstore.conftest import ray_cluster  # noqa: F401 — the module's Ray


@ray.remote(num_cpus=0)
class Worker:
    """A worker's stats() as the engine reports them, set by the test; `stop` makes the call
    hang (a stopped process)."""

    def __init__(self) -> None:
        self.stats_ = SchedulerStats("worker", os.getpid())
        self.stopped = False

    def set(self, **stats) -> None:
        self.stats_ = replace(self.stats_, **stats)

    def stop(self) -> None:
        self.stopped = True

    async def stats(self) -> SchedulerStats:
        import asyncio

        while self.stopped:
            await asyncio.sleep(0.05)
        return self.stats_


@pytest.mark.usefixtures("ray_cluster")
def test_running_without_steps_or_answers_is_hung_idle_and_stepping_are_not():
    registry = InstanceRegistry(probe=lambda i: lambda: None)
    workers = {name: Worker.remote() for name in ("idle", "stepping", "stuck", "stopped")}
    for name, handle in workers.items():
        registry.add(Instance(name, "decode", handle))
    killed = []
    watch = StallWatch(registry, stall_timeout_s=5,
                       kill=lambda i, pid: killed.append(i.worker_id))
    for name in ("stepping", "stuck", "stopped"):
        ray.get(workers[name].set.remote(num_running=2, num_steps_total=10))
    found = []
    for t in range(12):  # one round a (pretend) second
        if t == 3:
            ray.get(workers["stopped"].stop.remote())
        ray.get(workers["stepping"].set.remote(num_steps_total=10 + t))
        found += watch.check_once(now=t)
        time.sleep(0.05)  # the stats calls answer between rounds
    assert sorted(h.worker_id for h in found) == ["stopped", "stuck"] == sorted(killed)
    assert registry.dead() == ["stopped", "stuck"] and watch.hung_total == 2
    assert "no step" in next(h.reason for h in found if h.worker_id == "stuck")
    assert "no answer" in next(h.reason for h in found if h.worker_id == "stopped")
    registry.close()
    for handle in workers.values():
        ray.kill(handle)
