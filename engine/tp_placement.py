"""Where each rank of a tensor-parallel instance runs: one bundle of the instance's STRICT_PACK
placement group per rank (DESIGN.md "Tensor parallelism"), so all k ranks share one node.

The group itself is made by whoever deploys the instance (deploy.placement.tp_placement_group),
with the restart policy of its actors; the engine only schedules a rank into its bundle.
"""

from __future__ import annotations

from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


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
