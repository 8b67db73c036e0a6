"""Starts (or joins) a Ray cluster and brings up the KV stores and worker actors.

Used by `pdcluster serve` and by the integration tests, so both run the same start-up path.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import ray
from pydantic import SecretStr

from pdcluster import kernels

from pdcluster.decode_worker.actor import DecodeWorker, decode_actor
from pdcluster.deploy.cluster_record import ClusterManifest, record_actor
from pdcluster.deploy.membership import MembershipWatch
from pdcluster.deploy.config import ServeConfig
from pdcluster.deploy import placement
from pdcluster.deploy.ray_session import RaySession
from pdcluster.deploy.preload import worker_huge_pages, worker_preload
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.model_config import ModelConfig
from pdcluster.engine.models.base import check_tensor_parallel
from pdcluster.engine.quantization import check_quantization
from pdcluster.kvstore.actor import (KVSTORE_ACTOR_PREFIX, KVStoreActor, start_kvstore_actor,
                                     start_kvstore_actors, wait_kvstore_actors)
from pdcluster.kvstore.index import ActorIndex, open_index
from pdcluster.kvstore.index.actor import DEFAULT_INDEX_ACTOR_NAME
from pdcluster.kvstore.layout import BlockLayout
from pdcluster.prefill_worker.actor import PrefillWorker, prefill_actor
from pdcluster.router.admission import SLO
from pdcluster.router.conductor import Conductor, Instance, InstanceRegistry, build_live_conductor
from pdcluster.router.cost_model import CostModel, load_cost_model
from pdcluster.engine.logs import worker_env_vars
from pdcluster.router.decision_board import BOARD_ACTOR_NAME
from pdcluster.router.pipeline import ColocatedPipeline, Pipeline
from pdcluster.router.stall_watch import StallWatch

log = logging.getLogger(__name__)

# Calls a prefill actor answers at once; its engine lock serializes the forwards themselves.
PREFILL_MAX_CONCURRENCY = 8
# How long a TP instance's placement group may take to be placed.
TP_PLACEMENT_TIMEOUT_S = 120
# How long a worker an autoscaler adds may take to answer: a new pod (image pull, start).
ADD_INSTANCE_TIMEOUT_S = 600
# How long a call to the cluster record (deploy.cluster_record) may take.
RECORD_TIMEOUT_S = 30
# How long a gateway attaching to a running cluster waits for each worker's first answer.
ATTACH_TIMEOUT_S = 30


def block_layout(engine: EngineConfig) -> BlockLayout:
    """The one KV block layout of this deployment: the bytes of one block of the served
    model's KV cache spec (ModelConfig.kv_cache_spec, every KV head, as at TP=1), uint8
    [block_nbytes]: the bytes per token the model really caches."""
    model = ModelConfig.from_pretrained(engine.model)
    spec = model.kv_cache_spec(engine.block_size, engine.torch_dtype())
    return BlockLayout("uint8", (spec.block_nbytes,))


def conductor_cost_model(cfg: ServeConfig) -> CostModel:
    """The cost model the Conductor predicts with: `cfg.cost_model` with the figures measured
    for this deployment's connector and pool, and the served model's own bytes per token."""
    return (load_cost_model(cfg.cost_model).for_connector(cfg.transfer.backend)
            .for_pool(cfg.kvpool.backend)
            .for_kv_bytes_per_token(block_layout(cfg.engine).nbytes // cfg.engine.block_size))


@dataclass(frozen=True)
class ActorClasses:
    """The classes a cluster's actors run: the serving ones, or subclasses (tests break theirs
    on purpose: tests/faults.py)."""

    prefill: type[PrefillWorker] = PrefillWorker
    decode: type[DecodeWorker] = DecodeWorker
    kvstore: type[KVStoreActor] = KVStoreActor


class Cluster:
    """The running actors of one deployment, and a gateway's view of them (registry, Conductor,
    request pipeline, stall watch). Use as a context manager or call shutdown().

    Three ways to have one: :meth:`start` brings the workers up, owned by this process, so
    they stop with it (`pdcluster serve`, the tests); with ``detached=True`` they are
    detached named actors that outlive it (`pdcluster cluster up`, then :meth:`manifest`);
    :meth:`attach` joins such a cluster as one more gateway (`pdcluster gateway`), and its
    shutdown leaves the workers running.
    """

    def __init__(self, config: ServeConfig, ray_session: RaySession | None = None,
                 actors: ActorClasses = ActorClasses(), detached: bool = False) -> None:
        """`ray_session`: the Ray to run on, opened already (this cluster closes it at
        shutdown); None: :meth:`start` opens one (deploy.ray_session.RaySession.open).
        `actors`: the classes its actors run. `detached`: start the actors detached and
        named in config.ray_namespace (deploy.cluster_record)."""
        self.config = config
        self.actors = actors
        self.detached = detached
        self.owns_workers = True  # False once attached: shutdown leaves them running
        self.registry = InstanceRegistry()
        # replaced in start() by the live Conductor (global index, load reports, admission)
        self.conductor = Conductor(self.registry, config.policy)
        self.pipeline = (ColocatedPipeline if config.colocated else Pipeline)(self.conductor)
        self.kvstores: dict = {}
        self.prefill: list[Instance] = []
        self.decode: list[Instance] = []
        self.placement_groups: list = []
        self._worker_pgs: dict = {}  # worker id -> its TP placement group
        self._worker_args: dict = {}  # what start_workers resolved, for add_instance
        self._next_index: dict[str, int] = {}  # role -> index of the next added worker
        self._pg_names: list[str] = []  # of the detached ones
        self._resources: dict[str, float] = {}  # ray.cluster_resources() at start
        self._role_demand: dict[str, dict[str, float]] = {}
        self._ray_session = ray_session
        self._stats_poller = None
        self.stall_watch: StallWatch | None = None
        self._membership: MembershipWatch | None = None  # attached: follows the record
        self._index = None

    def start(self) -> "Cluster":
        """Bring the KV stores, the index and the workers up, then the gateway's view."""
        self.start_workers()
        for instance in self.wait_ready():
            self.registry.add(instance)
        self._start_routing()
        return self

    def wait_ready(self) -> list[Instance]:
        """Wait until every worker started answers (its model loaded); returns them."""
        workers = self.prefill + self.decode
        infos = ray.get([i.handle.info.remote() for i in workers])
        for instance, info in zip(workers, infos):
            log.info("%s ready: pid %s on node %s", instance.worker_id, info["pid"],
                     info["node_id"])
        return workers

    @classmethod
    def attach(cls, config: ServeConfig, manifest: ClusterManifest,
               ray_session: RaySession) -> "Cluster":
        """A gateway's view of the running cluster `manifest` describes (read from its
        record, deploy.cluster_record), on `ray_session` (joined already). `config`: the
        cluster's ServeConfig with this gateway's own settings over it. A worker that does not
        answer is added as dead: the registry probes it until it does."""
        cluster = cls.of_manifest(config, manifest, ray_session)
        cluster.owns_workers = False
        for instance in cluster.prefill + cluster.decode:
            try:
                ray.get(instance.handle.info.remote(), timeout=ATTACH_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 — restarting, or gone: probed
                log.warning("%s does not answer (%s): marked dead", instance.worker_id, exc)
                cluster.registry.mark_dead(instance.worker_id)
        cluster._start_routing()
        cluster._membership = MembershipWatch(cluster).start()
        return cluster

    @classmethod
    def of_manifest(cls, config: ServeConfig, manifest: ClusterManifest,
                    ray_session: RaySession | None = None) -> "Cluster":
        """The detached actors `manifest` lists, found by name (those gone are left out), in
        the registry; nothing routes yet. `pdcluster cluster down` calls shutdown_workers()
        on it."""
        cluster = cls(config, ray_session, detached=True)
        ns = config.ray_namespace

        def found(name: str):
            try:
                return ray.get_actor(name, namespace=ns)
            except ValueError:
                return None

        for node_id, name in manifest.kvstores.items():
            if (handle := found(name)) is not None:
                cluster.kvstores[node_id] = handle
                cluster.registry.add(Instance(f"kvstore-{node_id[:12]}", "kvstore", handle))
        for role, names in (("prefill", manifest.prefill), ("decode", manifest.decode)):
            for name in names:
                if (handle := found(name)) is not None:
                    instance = Instance(name, role, handle)
                    getattr(cluster, role).append(instance)
                    cluster.registry.add(instance)
        for name in manifest.placement_groups:
            try:
                pg = ray.util.get_placement_group(name)
            except ValueError:
                continue
            cluster.placement_groups.append(pg)
            cluster._pg_names.append(name)
            cluster._worker_pgs[name.removeprefix("pg-")] = pg
        for name in manifest.draining:
            cluster.registry.drain(name)
        return cluster

    def manifest(self) -> ClusterManifest:
        """What a gateway needs to attach to this cluster (deploy.cluster_record)."""
        index_url = urlsplit(self.config.kvpool.index_url)
        return ClusterManifest(
            self.config.model_dump_json(),
            tuple(i.worker_id for i in self.prefill), tuple(i.worker_id for i in self.decode),
            {node: KVSTORE_ACTOR_PREFIX + node for node in self.kvstores},
            (index_url.netloc or DEFAULT_INDEX_ACTOR_NAME) if index_url.scheme == "ray"
            else None,
            tuple(self._pg_names),
            next_index={"prefill": len(self.prefill), "decode": len(self.decode)})

    def _actor_options(self, name: str) -> dict:
        """Detached: named in the namespace and outliving this process."""
        if not self.detached:
            return {}
        return {"name": name, "namespace": self.config.ray_namespace, "lifetime": "detached"}

    def start_workers(self) -> None:
        """Bring the KV stores, the index and the workers up (detached when the cluster is);
        they are not in the registry yet: :meth:`start` adds them once they answer."""
        if self.config.kvstore.token is None:  # a local cluster gets a random KV-plane token
            kvstore = self.config.kvstore.model_copy(
                update={"token": SecretStr(secrets.token_hex(16))})
            self.config = self.config.model_copy(update={"kvstore": kvstore})
        cfg = self.config
        if self._ray_session is None:
            self._ray_session = RaySession.open(cfg)
        self._prepare_workers(cfg)
        # the driver opens the global index first: an index actor (ray://) lives as long as the
        # process that created it (detached: the cluster), and a KV store may die (Ray
        # restarts it)
        detached_index = self.detached and urlsplit(cfg.kvpool.index_url).scheme == "ray"
        self._index = open_index(cfg.kvpool.index_url,
                                 **({"detached": True} if detached_index else {}))
        # the stores start alongside the workers, which find theirs by name
        self.kvstores = start_kvstore_actors(
            cfg.kvstore, cfg.kvpool, block_layout(cfg.engine), cfg.ray_namespace,
            node_ids=placement.worker_node_ids(ray.nodes(), self._role_demand.values()),
            wait=False, actor_cls=self.actors.kvstore, detached=self.detached)
        for node_id, handle in self.kvstores.items():  # for /metrics: tiers G2/G3 per node
            self.registry.add(Instance(f"kvstore-{node_id[:12]}", "kvstore", handle))
        for i in range(0 if cfg.colocated else self.initial_count("prefill")):
            self.prefill.append(self._start_worker("prefill", f"prefill-{i}"))
        for i in range(self.initial_count("decode")):
            self.decode.append(self._start_worker("decode", f"decode-{i}"))
        wait_kvstore_actors(self.kvstores, cfg.kvstore.rpc_timeout_s * 6)

    def _prepare_workers(self, cfg: ServeConfig) -> None:
        """What every worker of `cfg` starts with (its engine per role, runtime env) and where
        each role goes (placement); a clear error for a TP size the model cannot take."""
        worker_cpu_bind = self._ray_session.worker_cpu_bind
        prefill_engine, decode_engine = (
            e.model_copy(update={"cpu_bind": worker_cpu_bind})
            for e in (cfg.prefill_engine(), cfg.decode_engine()))
        model = ModelConfig.from_pretrained(cfg.engine.model)
        for tp in {prefill_engine.tensor_parallel_size, decode_engine.tensor_parallel_size}:
            check_tensor_parallel(model, tp)  # a clear error before any actor starts
        check_quantization(model.quantization, cfg.engine.quantization)
        # each role's Ray custom resource (deploy/placement.py); KV stores only where workers go
        self._resources = ray.cluster_resources()
        roles = (placement.DECODE,) if cfg.colocated else placement.ROLES
        self._role_demand = {r: placement.role_resources(r, cfg.placement, self._resources)
                             for r in roles}
        # Triton on CPU runs interpreted: actors need TRITON_INTERPRET=1 before importing triton
        # and they log like the gateway (level, text|json, request ids): engine.logs
        runtime_env = {"env_vars": {**worker_env_vars(cfg.log_level, cfg.log_format),
                                    **kernels.runtime_env_vars(cfg.engine.kernel_backend,
                                                               cfg.engine.device),
                                    **worker_preload(cfg.worker_preload),
                                    **worker_huge_pages(cfg.worker_huge_pages)}}
        self._worker_args = {"runtime_env": runtime_env, "prefill": prefill_engine,
                             "decode": decode_engine, "config": cfg}

    def worker_config_json(self) -> str:
        """The workers' ServeConfig as JSON with the KV-plane token in the clear (for the
        cluster record: a scaling gateway starts more workers with it); no API keys."""
        data = json.loads(self.config.model_dump_json())
        token = self.config.kvstore.token
        data["kvstore"]["token"] = token.get_secret_value() if token is not None else None
        data.pop("api_keys", None)
        return json.dumps(data)

    def initial_count(self, role: str) -> int:
        """Instances of `role` at start: the configured count, within --autoscale's range."""
        n = getattr(self.config, f"{role}_instances")
        scale = self.config.autoscale_range()
        return n if scale is None else min(max(n, scale.of(role).minimum), scale.of(role).maximum)

    def _start_worker(self, role: str, name: str) -> Instance:
        """Start worker actor `name` of `role` (rank 0 of its TP instance); returns at once."""
        args = self._worker_args
        cfg, engine = args["config"], args[role]
        options = {"runtime_env": args["runtime_env"],
                   **self._rank0_options(engine.tensor_parallel_size, role, name),
                   **self._actor_options(name)}
        if role == "prefill":
            handle = prefill_actor(self.actors.prefill).options(
                max_concurrency=PREFILL_MAX_CONCURRENCY, **options,
            ).remote(name, engine, cfg.kvstore, cfg.kvpool, cfg.ray_namespace, cfg.transfer)
        else:
            # colocated, nothing loads prefixes from the pool: what a decode published would
            # only take arena space
            transfer = (cfg.transfer.model_copy(update={"decode_publish": False})
                        if cfg.colocated else cfg.transfer)
            handle = decode_actor(self.actors.decode).options(**options).remote(
                name, engine, cfg.kvstore, cfg.ray_namespace, transfer, cfg.kvpool)
        return Instance(name, role, handle)

    def add_instance(self, role: str, timeout_s: float = ADD_INSTANCE_TIMEOUT_S) -> Instance:
        """Start one more worker of `role` (a name no worker had), wait until it answers
        (its model loaded) and route to it: an autoscaler's scale-up. A detached cluster's
        record lists it then, so every gateway routes to it (deploy.membership). Raises what
        the actor's start raised (it is killed then), or GetTimeoutError."""
        if not self._worker_args:  # attached: the workers' own config is in the record
            self._prepare_workers(ServeConfig.model_validate_json(
                ray.get(self._record().worker_config.remote(), timeout=RECORD_TIMEOUT_S)))
        if self.detached:
            name = ray.get(self._record().next_name.remote(role), timeout=RECORD_TIMEOUT_S)
        else:
            self._next_index[role] = self._next_index.get(role, len(getattr(self, role)))
            name = f"{role}-{self._next_index[role]}"
            self._next_index[role] += 1
        instance = self._start_worker(role, name)
        ready = instance.handle.info.remote()
        deadline = time.monotonic() + timeout_s
        try:
            # a worker that fits no running node waits for Ray's autoscaler (KubeRay) to add
            # one, and on it for its node's KV store: started here once the node is up
            while not ray.wait([ready], timeout=1.0)[0]:
                self._start_missing_kvstores()
                if time.monotonic() > deadline:
                    raise ray.exceptions.GetTimeoutError(
                        f"{instance.worker_id} not up within {timeout_s:g} s")
            ray.get(ready)
        except BaseException:
            self._stop_worker(instance)
            raise
        if self.detached:  # first: the membership watch drops what the record lacks
            pg = f"pg-{instance.worker_id}" if instance.worker_id in self._worker_pgs else None
            ray.get(self._record().add_worker.remote(role, instance.worker_id, pg),
                    timeout=RECORD_TIMEOUT_S)
        if instance.worker_id not in {i.worker_id for i in getattr(self, role)}:
            getattr(self, role).append(instance)  # (unless the watch added it meanwhile)
        self.registry.add(instance)
        return instance

    def _start_missing_kvstores(self) -> None:
        """A KV store on every worker node that has none (a node added since start)."""
        cfg = self._worker_args["config"]
        for node_id in placement.worker_node_ids(ray.nodes(), self._role_demand.values()):
            if node_id in self.kvstores:
                continue
            handle = start_kvstore_actor(node_id, cfg.kvstore, cfg.kvpool,
                                         block_layout(cfg.engine), cfg.ray_namespace,
                                         self.actors.kvstore, self.detached)
            self.kvstores[node_id] = handle
            self.registry.add(Instance(f"kvstore-{node_id[:12]}", "kvstore", handle))
            if self.detached:
                ray.get(self._record().add_kvstore.remote(
                    node_id, KVSTORE_ACTOR_PREFIX + node_id), timeout=RECORD_TIMEOUT_S)
            log.info("KV store started on new node %s", node_id)

    def drain_instance(self, worker_id: str) -> None:
        """Route nothing new to `worker_id` (here, and through the record in every gateway of
        a detached cluster); what it holds goes on."""
        self.registry.drain(worker_id)
        if self.detached:
            ray.get(self._record().drain_worker.remote(worker_id), timeout=RECORD_TIMEOUT_S)

    def retire_instance(self, worker_id: str) -> None:
        """Stop routing to worker `worker_id` and stop it, with its placement group: the end of
        a scale-down, once its requests are done (deploy.autoscaler drains first)."""
        pg = f"pg-{worker_id}" if worker_id in self._worker_pgs else None
        if self.detached:  # first: the membership watch re-adds what the record lists
            ray.get(self._record().remove_worker.remote(worker_id, pg),
                    timeout=RECORD_TIMEOUT_S)
        self.forget_instance(worker_id, stop=True)

    def forget_instance(self, worker_id: str, stop: bool = False) -> None:
        """Take `worker_id` out of this gateway's view (and stop it when `stop`)."""
        self.registry.remove(worker_id)
        for role in ("prefill", "decode"):
            for instance in [i for i in getattr(self, role) if i.worker_id == worker_id]:
                getattr(self, role).remove(instance)
                if stop:
                    self._stop_worker(instance)

    def _record(self):
        return record_actor(self.config.ray_namespace)

    def _stop_worker(self, instance: Instance) -> None:
        ray.kill(instance.handle, no_restart=True)
        pg = self._worker_pgs.pop(instance.worker_id, None)
        if pg is not None:
            ray.util.remove_placement_group(pg)
            self.placement_groups.remove(pg)
            if f"pg-{instance.worker_id}" in self._pg_names:
                self._pg_names.remove(f"pg-{instance.worker_id}")

    def _start_routing(self) -> None:
        """The gateway's view over the registry: the live Conductor (index, load reports,
        admission), the pipeline on it, the stall watch."""
        cfg = self.config
        self.conductor, self._stats_poller = build_live_conductor(
            self.registry, policy=cfg.policy, admission=cfg.admission,
            slo=SLO(cfg.slo_ttft_s, cfg.slo_tbt_ms / 1000),
            cost_model=conductor_cost_model(cfg),
            block_size=cfg.engine.block_size, model_name=cfg.model_name(),
            index_url=cfg.kvpool.index_url, pd_decider=cfg.pd_decider)
        self.pipeline.conductor = self.conductor
        if cfg.worker_stall_timeout_s:
            outputs = self.pipeline.outputs
            self.stall_watch = StallWatch(
                self.registry, cfg.worker_stall_timeout_s,
                busy=lambda i: outputs.num_requests(i.worker_id) > 0).start()

    def worker_health(self) -> dict:
        """What /health says of the workers: those marked dead and not back, and the last
        ones declared hung (router.stall_watch)."""
        hung = self.stall_watch.hung if self.stall_watch is not None else []
        return {"dead_workers": self.registry.dead(),
                "hung_workers": [{"worker_id": h.worker_id, "role": h.role,
                                  "reason": h.reason, "at": h.at} for h in hung]}

    def _rank0_options(self, tp: int, role: str, name: str) -> dict:
        """Options of a worker actor of `role`: at TP=1 its CPUs, GPUs, role resource and
        restarts (placement.worker_options); at TP=k rank 0 of the instance, in a new
        STRICT_PACK placement group of k bundles on a node of the role (its followers take the
        others), detached and named after the instance when the actors are."""
        cfg = self.config
        gpus = cfg.worker_num_gpus()
        if tp == 1:
            return placement.worker_options(role, cfg.placement, self._resources,
                                            cfg.actor_num_cpus, gpus)
        demand = self._role_demand[role]
        pg_name = f"pg-{name}" if self.detached else ""
        pg = placement.tp_placement_group(tp, next(iter(demand), None), cfg.actor_num_cpus,
                                          gpus, name=pg_name, detached=self.detached)
        self.placement_groups.append(pg)
        self._worker_pgs[name] = pg
        if pg_name:
            self._pg_names.append(pg_name)
        ray.get(pg.ready(), timeout=TP_PLACEMENT_TIMEOUT_S)
        return placement.tp_rank_options(pg, 0)

    def shutdown(self) -> None:
        """Stop the gateway's view; then, unless attached, the workers, stores and index;
        then leave (or stop) the Ray session."""
        if self._membership is not None:
            self._membership.stop()
            self._membership = None
        if self.stall_watch is not None:
            self.stall_watch.stop()
            self.stall_watch = None
        if self._stats_poller is not None:
            self._stats_poller.stop()
            self._stats_poller = None
        self.registry.close()  # its dead-instance probes
        if self.owns_workers:
            self.shutdown_workers()
        self.prefill, self.decode, self.kvstores = [], [], {}
        if self._ray_session is not None:
            self._ray_session.close()
            self._ray_session = None

    def shutdown_workers(self) -> None:
        """Kill the workers, placement groups, KV stores (their arenas freed) and clear and
        close the index this cluster started."""
        index_actor = self.manifest().index_actor if self.detached else None
        for instance in self.prefill + self.decode:
            ray.kill(instance.handle, no_restart=True)
        for pg in self.placement_groups:
            ray.util.remove_placement_group(pg)
        self.placement_groups = []
        for handle in self.kvstores.values():
            try:
                ray.get(handle.stop.remote(), timeout=10)  # frees the node's arena
            except Exception as exc:  # noqa: BLE001 — killed below either way
                log.warning("KV store did not stop cleanly: %s", exc)
            ray.kill(handle, no_restart=True)
        self.prefill, self.decode, self.kvstores = [], [], {}
        if self._index is not None:  # opened only when the workers are ours
            try:
                if isinstance(self._index, ActorIndex):  # ours, and it outlives the stores
                    self._index.clear()
                self._index.close()
            except Exception as exc:  # noqa: BLE001 -- shutting down either way
                log.warning("global index not cleared: %s", exc)
            self._index = None
        # detached, they would outlive us: the index (when ours) and the gateways' board
        for name in filter(None, (index_actor, BOARD_ACTOR_NAME)):
            try:
                ray.kill(ray.get_actor(name, namespace=self.config.ray_namespace),
                         no_restart=True)
            except ValueError:
                pass

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()
