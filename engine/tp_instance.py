"""A tensor-parallel instance as Ray actors: rank 0 is the worker actor (DecodeWorker or
PrefillWorker, which schedules, samples and talks to the rest of the cluster); ranks 1..k-1 are
TPFollower actors it creates, in the other bundles of its STRICT_PACK placement group
(made by the deployment, e.g. deploy.placement.tp_placement_group, with the restart policy of
its actors; each rank in its bundle: bundle_options), so the whole group is on one node.

Bootstrap (no fixed port): rank 0 binds a TCPStore on a free port of its
node's IP, creates the followers with host:port as arguments (Ray RPC: trusted control plane),
and all k processes form the default torch.distributed group (gloo on CPU, NCCL on CUDA).

Failure: the instance restarts as a whole, because a gloo group cannot be rejoined.
- rank 0 dies: its followers die with it (Ray kills the actors an actor owns), and Ray restarts
  rank 0 (deployed restartable: deploy.placement.WORKER_MAX_RESTARTS) in the same placement
  group, which re-creates the followers and forms a new group;
- a follower dies: its `follow` call errors, rank 0's monitor thread sees it and exits the
  rank 0 process, which then restarts as above (a collective rank 0 was in fails at once, as
  the dead peer's connections close: the runner turns that into TPError).
Followers are never restarted alone (max_restarts 0).
"""

from __future__ import annotations

import logging
import os
import threading

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdcluster.engine import ray_calls
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.parallel import TPError, TPGroup, create_master_store, init_tp_group
from pdcluster.engine.runner import ModelRunner

log = logging.getLogger(__name__)

#: How long the k ranks have to find each other (and load nothing yet) when forming the group.
JOIN_TIMEOUT_S = 300.0


def bundle_options(pg: PlacementGroup, rank: int) -> dict:
    """``ActorClass.options(**...)`` for rank `rank` of the group: exactly the resources of
    bundle `rank` (CPUs, GPUs, custom resources), scheduled into that bundle, with the tasks and
    actors it creates captured by the group. Carries no ``max_restarts``: the caller adds it.
    """
    spec = dict(pg.bundle_specs[rank])
    options: dict = {
        "num_cpus": spec.pop("CPU", 0.0),
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=rank, placement_group_capture_child_tasks=True),
    }
    if "GPU" in spec:
        options["num_gpus"] = spec.pop("GPU")
    spec.pop("memory", None)
    if spec:
        options["resources"] = spec
    return options


def _rank_info(runner: ModelRunner) -> dict:
    """This process's pid, rank, node and KV heads."""
    return {"pid": os.getpid(), "rank": runner.tp.rank,
            "node_id": ray.get_runtime_context().get_node_id(),
            "kv_heads": int(runner.kv_cache.k[0].shape[2])}


@ray.remote(max_concurrency=2)  # `info` answers while `follow` runs
class TPFollower:
    """Rank `rank` (>= 1) of a TP instance: loads its shard of the weights, holds its KV heads,
    and runs rank 0's commands (ModelRunner.follow) until told to stop."""

    def __init__(self, engine_config: EngineConfig, rank: int, host: str, port: int,
                 join_timeout_s: float = JOIN_TIMEOUT_S) -> None:
        group = init_tp_group(rank, engine_config.tensor_parallel_size, host, port,
                              engine_config.device, timeout_s=join_timeout_s)
        self.runner = ModelRunner(engine_config, tp=group)

    def follow(self) -> None:
        """Returns when rank 0 sends STOP; on a failed collective this process exits."""
        try:
            self.runner.follow()
        except TPError as exc:
            log.error("TP follower leaves: %s", exc)
            os._exit(1)

    def info(self) -> dict:
        return _rank_info(self.runner)


class TPInstance:
    """Rank 0's side of its TP instance. At tensor_parallel_size 1: group is TPGroup() and
    every method a no-op (no placement group needed).

    Construct in rank 0's actor (it blocks until every rank joined the group), build the
    ModelRunner with `group`, then `start(runner)`. Raises RuntimeError when rank 0 does not
    run in a placement group of tensor_parallel_size bundles, TPError when the ranks do not
    join within join_timeout_s.
    """

    def __init__(self, engine_config: EngineConfig, join_timeout_s: float = JOIN_TIMEOUT_S,
                 runtime_env: dict | None = None) -> None:
        self.size = engine_config.tensor_parallel_size
        self.followers: list = []
        self._runner: ModelRunner | None = None
        if self.size == 1:
            self.group = TPGroup()
            return
        pg = ray.util.get_current_placement_group()
        if pg is None or len(pg.bundle_specs) != self.size:
            raise RuntimeError(f"rank 0 of a TP={self.size} instance must run in its STRICT_PACK "
                               "placement group of as many bundles")
        host = ray.util.get_node_ip_address()
        store = create_master_store(host, self.size, join_timeout_s)
        for rank in range(1, self.size):
            options = {**bundle_options(pg, rank), "max_restarts": 0}
            if runtime_env:
                options["runtime_env"] = runtime_env
            self.followers.append(TPFollower.options(**options).remote(
                engine_config, rank, host, store.port, join_timeout_s))
        self.group = init_tp_group(0, self.size, host, store.port, engine_config.device,
                                   timeout_s=join_timeout_s, store=store)
        self._store = store  # rank 0 hosts the store for the group's lifetime

    def start(self, runner: ModelRunner) -> None:
        """Start the followers' command loops and the monitor that takes rank 0 down (so the
        instance restarts as a whole) when one of them ends unasked."""
        self._runner = runner
        if not self.followers:
            return
        runner.on_tp_failure = self._collective_failed
        refs = [f.follow.remote() for f in self.followers]
        threading.Thread(target=self._monitor, args=(refs,), name="tp-monitor",
                         daemon=True).start()

    def info(self) -> dict:
        """{"ranks": (pid, rank, node, KV heads) of rank 0 then of each follower,
        "num_all_reduces": the all-reduces rank 0 has issued}. Call after `start`; blocks on
        the followers' answers."""
        followers = ray_calls.results([f.info.remote() for f in self.followers])
        return {"ranks": [_rank_info(self._runner)] + followers,
                "num_all_reduces": self._runner.tp.num_all_reduces}

    def _collective_failed(self, exc: TPError) -> None:
        log.error("TP instance of %d ranks: %s; rank 0 exits so the instance restarts as a "
                  "whole", self.size, exc)
        os._exit(1)

    def _monitor(self, refs: list) -> None:
        ready, _ = ray.wait(refs, num_returns=1, timeout=None)
        try:
            ray_calls.result(ready[0])
            reason = "a follower stopped"
        except Exception as exc:  # noqa: BLE001 — RayActorError and the like
            reason = f"a follower died: {exc}"
        log.error("TP instance of %d ranks: %s; rank 0 exits so the instance restarts as "
                  "a whole (a gloo group cannot be rejoined)", self.size, reason)
        os._exit(1)
