"""Where pdcluster's actors run in a Ray cluster: a custom resource per role, a STRICT_PACK
placement group per tensor-parallel group.

A Ray node offers a role by advertising the custom resource of that name:
``ray start --resources='{"prefill": 1}'``, KubeRay's ``rayStartParams.resources``, or a node
type's ``resources`` in the cluster launcher. A worker actor of that role asks for a sliver of
it (``ROLE_RESOURCE_PER_ACTOR``), so the resource works as a node label; how many actors a node
holds is still governed by its CPUs and GPUs.

A node is known by its Ray node id, never by its IP: on one machine every node of a
``ray.cluster_utils.Cluster`` is 127.0.0.1, and on Kubernetes a pod's IP is reused.

    mode        an actor of role R asks for {R: ROLE_RESOURCE_PER_ACTOR} ...
    "auto"      ... when some node advertises R (the default; a local `pdcluster serve`
                advertises every role, see local_node_resources)
    "resources" ... always; PlacementError if no alive node advertises R (it would pend forever)
    "none"      ... never: Ray's default placement
"""

from __future__ import annotations

from typing import Iterable, Literal, Mapping

from ray.util.placement_group import PlacementGroup, placement_group

PREFILL = "prefill"
DECODE = "decode"
ROLES = (PREFILL, DECODE)

#: What one worker actor takes of its role's resource: a node advertising 1 holds up to 1000.
ROLE_RESOURCE_PER_ACTOR = 0.001

#: Worker actors are restarted by Ray without limit: after their node dies, Ray re-creates
#: them (same handle, same constructor arguments) on another node offering their role.
#: Method calls are never retried (Ray's default max_task_retries=0): a retried call would
#: replay a token stream the client has partly seen, so calls are not idempotent.
WORKER_MAX_RESTARTS = -1

PlacementMode = Literal["auto", "resources", "none"]


class PlacementError(RuntimeError):
    """The cluster cannot place an actor as asked (no node offers its role)."""


def local_node_resources() -> dict[str, float]:
    """Custom resources of the single-machine Ray that `pdcluster serve` starts: every role, so
    a local deployment takes the same placement path as a cluster."""
    return {role: 1.0 for role in ROLES}


def role_resources(role: str, mode: PlacementMode,
                   cluster_resources: Mapping[str, float]) -> dict[str, float]:
    """The custom-resource demand of one actor of `role` (``{}`` = no constraint).

    cluster_resources: ``ray.cluster_resources()`` (totals over alive nodes).
    Raises PlacementError in mode "resources" when no node advertises `role`.
    """
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; roles: {ROLES}")
    if mode == "none":
        return {}
    if cluster_resources.get(role, 0) > 0:
        return {role: ROLE_RESOURCE_PER_ACTOR}
    if mode == "resources":
        raise PlacementError(f"placement 'resources': no alive Ray node advertises the custom "
                             f"resource {role!r}; start nodes with --resources='{{\"{role}\": 1}}'")
    return {}


def worker_options(role: str, mode: PlacementMode, cluster_resources: Mapping[str, float],
                   num_cpus: float, num_gpus: float = 0.0) -> dict:
    """``ActorClass.options(**...)`` for a prefill or decode worker actor: its CPUs and GPUs,
    its role resource (role_resources) and WORKER_MAX_RESTARTS."""
    options: dict = {"num_cpus": num_cpus, "max_restarts": WORKER_MAX_RESTARTS}
    if num_gpus:
        options["num_gpus"] = num_gpus
    resources = role_resources(role, mode, cluster_resources)
    if resources:
        options["resources"] = resources
    return options


def worker_node_ids(nodes: Iterable[Mapping], demands: Iterable[Mapping[str, float]]) -> list[str]:
    """Ids of the alive nodes that may run a worker, so need a KV store.

    nodes: ``ray.nodes()``. demands: the role_resources of every worker role deployed.
    If any demand is empty (that role may land anywhere), every alive node; otherwise the
    nodes advertising at least one demanded resource (not the head, gateway or other nodes).
    """
    alive = [n for n in nodes if n.get("Alive")]
    demands = list(demands)
    if not demands or any(not d for d in demands):
        return [n["NodeID"] for n in alive]
    wanted = {name for d in demands for name in d}
    return [n["NodeID"] for n in alive if wanted & {k for k, v in n["Resources"].items() if v > 0}]


def tp_placement_group(tp: int, resource: str | None, num_cpus_per_rank: float,
                       num_gpus_per_rank: float = 0.0, name: str = "",
                       detached: bool = False) -> PlacementGroup:
    """A STRICT_PACK placement group of `tp` bundles: every rank of one tensor-parallel group
    on one node, since its all-reduces run every layer and must not cross the network; on a
    node advertising `resource` if given.

    Bundle i: ``{"CPU": num_cpus_per_rank, "GPU": num_gpus_per_rank (if > 0),
    resource: ROLE_RESOURCE_PER_ACTOR (if resource)}``. Not waited for: ``ray.get(pg.ready(),
    timeout=...)`` before relying on it; ``ray.util.remove_placement_group(pg)`` when done. If
    its node dies, Ray re-places the whole group on another node that fits it, and restartable
    actors in it (tp_rank_options with max_restarts) come back there, all on that one node.
    ``detached``: it outlives the process that made it (named `name`, removed by name).
    """
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    bundle: dict[str, float] = {"CPU": float(num_cpus_per_rank)}
    if num_gpus_per_rank:
        bundle["GPU"] = float(num_gpus_per_rank)
    if resource:
        bundle[resource] = ROLE_RESOURCE_PER_ACTOR
    return placement_group([dict(bundle) for _ in range(tp)], strategy="STRICT_PACK", name=name,
                           lifetime="detached" if detached else None)


def tp_rank_options(pg: PlacementGroup, rank: int,
                    max_restarts: int = WORKER_MAX_RESTARTS) -> dict:
    """``ActorClass.options(**...)`` for rank `rank` of the group: exactly its bundle's
    resources, scheduled into that bundle (engine.tp_instance.bundle_options).

    max_restarts: a TP instance restarts as a whole, because a gloo group cannot be rejoined:
    rank 0 restarts (the default) and re-creates its followers, which pass 0, since a rank
    restarted alone would wait for peers that are gone.
    """
    # imported here: engine.tp_instance loads torch, and a gateway starts Ray before torch
    from pdcluster.engine.tp_instance import bundle_options

    return {**bundle_options(pg, rank), "max_restarts": max_restarts}
