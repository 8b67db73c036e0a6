"""What a running cluster is, kept in the cluster itself, so that gateways started later (and
`pdcluster cluster status|down`) find it: a detached named Ray actor in the deployment's
namespace holding the deployment's ServeConfig and the names of its actors.

`pdcluster cluster up` writes it after the workers are up; `pdcluster gateway` reads it and
attaches to the named actors; `pdcluster cluster down` reads it, stops what it lists and
removes it. The actors it names are detached too (Ray's `lifetime="detached"`): they outlive
the process that created them, and Ray restarts them when they die, with no driver.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

#: The record's actor name, in the deployment's Ray namespace (ServeConfig.ray_namespace).
RECORD_ACTOR_NAME = "pdcluster-cluster"


@dataclass(frozen=True)
class ClusterManifest:
    """A running cluster, as its gateways need it.

    config_json: the ServeConfig it was brought up with (ServeConfig.model_dump_json: secrets
        masked, so a KV-plane token never leaves the workers); prefill / decode: the worker
        actors' names (= worker ids); kvstores: node id (hex) -> KV store actor name;
        index_actor: the index actor's name when the index is one (ray://), else None;
        placement_groups: names of the TP instances' placement groups; ray_address: the GCS
        address gateways join; started_at: Unix time. (A local Ray that `cluster up` started
        is in its state file, deploy.cluster_cli, which stops it.)
    """

    config_json: str
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    kvstores: dict[str, str]
    index_actor: str | None = None
    placement_groups: tuple[str, ...] = ()
    ray_address: str | None = None
    started_at: float = field(default_factory=time.time)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ClusterManifest":
        return cls(**{**data, "prefill": tuple(data["prefill"]), "decode": tuple(data["decode"]),
                      "placement_groups": tuple(data.get("placement_groups", ()))})


class ClusterRecord:
    """The actor: holds one ClusterManifest (as a dict: plain data across Ray)."""

    def __init__(self, manifest: dict) -> None:
        self._manifest = manifest

    def manifest(self) -> dict:
        return self._manifest


class ClusterNotFoundError(RuntimeError):
    """No cluster runs in that Ray namespace (`pdcluster cluster up` first)."""


def write_record(manifest: ClusterManifest, namespace: str) -> None:
    """Create the record of a cluster just brought up. Raises ValueError when one exists
    already (a cluster runs in that namespace)."""
    import ray  # here: a process joining a local head sets its environment before ray loads

    from kvstore.index.actor import HEAD_NODE_RESOURCE

    ray.get(ray.remote(num_cpus=0)(ClusterRecord).options(
        name=RECORD_ACTOR_NAME, namespace=namespace, lifetime="detached", max_restarts=-1,
        resources={HEAD_NODE_RESOURCE: 0.001}).remote(manifest.to_dict()).manifest.remote())


def read_record(namespace: str, timeout_s: float = 30.0) -> ClusterManifest:
    """The manifest of the cluster running in `namespace`. Raises ClusterNotFoundError."""
    import ray

    try:
        actor = ray.get_actor(RECORD_ACTOR_NAME, namespace=namespace)
    except ValueError:
        raise ClusterNotFoundError(
            f"no pdcluster cluster in Ray namespace {namespace!r} (start one with "
            f"`pdcluster cluster up`)") from None
    return ClusterManifest.from_dict(ray.get(actor.manifest.remote(), timeout=timeout_s))


def remove_record(namespace: str) -> None:
    import ray

    try:
        ray.kill(ray.get_actor(RECORD_ACTOR_NAME, namespace=namespace), no_restart=True)
    except ValueError:
        pass  # already gone
