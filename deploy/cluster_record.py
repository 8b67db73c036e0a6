"""What a running cluster is, kept in the cluster itself, so that gateways started later (and
`pdcluster cluster status|down`) find it: a detached named Ray actor in the deployment's
namespace holding the deployment's ServeConfig and the names of its actors.

`pdcluster cluster up` writes it after the workers are up; `pdcluster gateway` reads it and
attaches to the named actors; `pdcluster cluster down` reads it, stops what it lists and
removes it. A gateway that scales (`--autoscale`, deploy.autoscaler) adds, drains and removes
workers here, and every gateway follows the record (deploy.membership).

The ServeConfig gateways read has its secrets masked; the record also keeps the one the
workers were started with (KV-plane token included) for a scaling gateway to start more of
them: a process that joined the cluster's Ray (token auth) can reach every actor anyway. The actors it names are detached too (Ray's `lifetime="detached"`): they outlive
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
    #: workers being scaled down: routed nothing new, stopped once they hold nothing
    draining: tuple[str, ...] = ()
    #: bumped by every membership change
    version: int = 0
    #: role -> the index of its next worker's name (never reused: a gateway's old handle
    #: to a stopped worker must not name a new one)
    next_index: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ClusterManifest":
        return cls(**{**data, "prefill": tuple(data["prefill"]), "decode": tuple(data["decode"]),
                      "placement_groups": tuple(data.get("placement_groups", ())),
                      "draining": tuple(data.get("draining", ()))})


class ClusterRecord:
    """The actor: holds one ClusterManifest (as a dict: plain data across Ray) and the
    workers' own config JSON. Its methods run one at a time (a Ray actor's), so membership
    changes from one scaling gateway and reads from all never interleave."""

    def __init__(self, manifest: dict, worker_config_json: str | None = None) -> None:
        self._manifest = manifest
        self._worker_config_json = worker_config_json
        self._scaler: tuple[str, float] | None = None  # (holder, lease end, time.monotonic())

    def scaler_lease(self, holder: str, ttl_s: float) -> bool:
        """Whether `holder` is the one gateway that scales for the next `ttl_s` seconds:
        True when the lease is free, lapsed or its own (renewed), False while another holds
        it. Several gateways may run --autoscale; one acts, another takes over within
        `ttl_s` of its death."""
        now = time.monotonic()
        if self._scaler is None or self._scaler[0] == holder or self._scaler[1] < now:
            self._scaler = (holder, now + ttl_s)
            return True
        return False

    def manifest(self) -> dict:
        return self._manifest

    def worker_config(self) -> str | None:
        """The ServeConfig JSON the workers run with, secrets included."""
        return self._worker_config_json

    def _change(self, **fields) -> dict:
        self._manifest = {**self._manifest, **fields,
                          "version": self._manifest.get("version", 0) + 1}
        return self._manifest

    def add_worker(self, role: str, name: str, placement_group: str | None = None) -> dict:
        m = self._manifest
        return self._change(**{role: [*m[role], name]}, placement_groups=[
            *m.get("placement_groups", ()), *([placement_group] if placement_group else [])])

    def next_name(self, role: str) -> str:
        """A name for a new worker of `role` that no worker of this cluster had."""
        index = dict(self._manifest.get("next_index", {}))
        n = index.get(role, len(self._manifest[role]))
        index[role] = n + 1
        self._manifest = {**self._manifest, "next_index": index}
        return f"{role}-{n}"

    def add_kvstore(self, node_id: str, name: str) -> dict:
        return self._change(kvstores={**self._manifest["kvstores"], node_id: name})

    def drain_worker(self, name: str) -> dict:
        return self._change(draining=[*self._manifest.get("draining", ()), name])

    def remove_worker(self, name: str, placement_group: str | None = None) -> dict:
        m = self._manifest
        return self._change(
            prefill=[n for n in m["prefill"] if n != name],
            decode=[n for n in m["decode"] if n != name],
            draining=[n for n in m.get("draining", ()) if n != name],
            placement_groups=[n for n in m.get("placement_groups", ()) if n != placement_group])


class ClusterNotFoundError(RuntimeError):
    """No cluster runs in that Ray namespace (`pdcluster cluster up` first)."""


def write_record(manifest: ClusterManifest, namespace: str,
                 worker_config_json: str | None = None) -> None:
    """Create the record of a cluster just brought up (`worker_config_json`: the workers'
    ServeConfig, secrets included). Raises ValueError when one exists already (a cluster
    runs in that namespace)."""
    import ray  # here: a process joining a local head sets its environment before ray loads

    from pdcluster.kvstore.index.actor import HEAD_NODE_RESOURCE

    ray.get(ray.remote(num_cpus=0)(ClusterRecord).options(
        name=RECORD_ACTOR_NAME, namespace=namespace, lifetime="detached", max_restarts=-1,
        resources={HEAD_NODE_RESOURCE: 0.001}).remote(manifest.to_dict(), worker_config_json)
        .manifest.remote())


def record_actor(namespace: str):
    """The record's actor handle. Raises ClusterNotFoundError."""
    import ray

    try:
        return ray.get_actor(RECORD_ACTOR_NAME, namespace=namespace)
    except ValueError:
        raise ClusterNotFoundError(
            f"no pdcluster cluster in Ray namespace {namespace!r} (start one with "
            f"`pdcluster cluster up`)") from None


def read_record(namespace: str, timeout_s: float = 30.0) -> ClusterManifest:
    """The manifest of the cluster running in `namespace`. Raises ClusterNotFoundError."""
    import ray

    actor = record_actor(namespace)
    return ClusterManifest.from_dict(ray.get(actor.manifest.remote(), timeout=timeout_s))


def remove_record(namespace: str) -> None:
    import ray

    try:
        ray.kill(ray.get_actor(RECORD_ACTOR_NAME, namespace=namespace), no_restart=True)
    except ValueError:
        pass  # already gone
