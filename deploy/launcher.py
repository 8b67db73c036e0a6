"""Starts (or joins) a Ray cluster and brings up the KV stores and worker actors.

Used by `pdcluster serve` and by the integration tests, so both run the same start-up path.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass

import ray
from pydantic import SecretStr

import kernels

from decode_worker.actor import DecodeWorker, decode_actor
from deploy.config import ServeConfig
from deploy import placement
from deploy.ray_session import RaySession
from deploy.preload import worker_huge_pages, worker_preload
from engine.config import EngineConfig, ModelConfig
from engine.models.base import check_tensor_parallel
from kvstore.actor import KVStoreActor, start_kvstore_actors, wait_kvstore_actors
from kvstore.index import ActorIndex, open_index
from kvstore.layout import BlockLayout
from prefill_worker.actor import PrefillWorker, prefill_actor
from router.admission import SLO
from router.conductor import Conductor, Instance, InstanceRegistry, build_live_conductor
from router.cost_model import load_cost_model
from engine.logs import worker_env_vars
from router.pipeline import ColocatedPipeline, Pipeline
from router.stall_watch import StallWatch

log = logging.getLogger(__name__)

# Calls a prefill actor answers at once; its engine lock serializes the forwards themselves.
PREFILL_MAX_CONCURRENCY = 8
# How long a TP instance's placement group may take to be placed.
TP_PLACEMENT_TIMEOUT_S = 120


def block_layout(engine: EngineConfig) -> BlockLayout:
    """The one KV block layout of this deployment: [layers, K|V, block_size, kv_heads, head_dim]
    (every KV head, as at TP=1), or an MLA model's [layers, 1, block_size, 1, latent dims]
    (ModelConfig.kv_cache_dims): the bytes per token the model really caches."""
    model = ModelConfig.from_pretrained(engine.model)
    parts, heads, dim = model.kv_cache_dims()
    return BlockLayout(engine.dtype, (model.num_hidden_layers, parts, engine.block_size, heads,
                                      dim))


@dataclass(frozen=True)
class ActorClasses:
    """The classes a cluster's actors run: the serving ones, or subclasses (tests break theirs
    on purpose: tests/faults.py)."""

    prefill: type[PrefillWorker] = PrefillWorker
    decode: type[DecodeWorker] = DecodeWorker
    kvstore: type[KVStoreActor] = KVStoreActor


class Cluster:
    """The running actors of one deployment. Use as a context manager or call shutdown()."""

    def __init__(self, config: ServeConfig, ray_session: RaySession | None = None,
                 actors: ActorClasses = ActorClasses()) -> None:
        """`ray_session`: the Ray to run on, opened already (this cluster closes it at
        shutdown); None: :meth:`start` opens one (deploy.ray_session.RaySession.open).
        `actors`: the classes its actors run."""
        self.config = config
        self.actors = actors
        self.registry = InstanceRegistry()
        # replaced in start() by the live Conductor (global index, load reports, admission)
        self.conductor = Conductor(self.registry, config.policy)
        self.pipeline = (ColocatedPipeline if config.colocated else Pipeline)(self.conductor)
        self.kvstores: dict = {}
        self.prefill: list[Instance] = []
        self.decode: list[Instance] = []
        self.placement_groups: list = []
        self._resources: dict[str, float] = {}  # ray.cluster_resources() at start
        self._role_demand: dict[str, dict[str, float]] = {}
        self._ray_session = ray_session
        self._stats_poller = None
        self.stall_watch: StallWatch | None = None
        self._index = None

    def start(self) -> "Cluster":
        if self.config.kvstore.token is None:  # a local cluster gets a random KV-plane token
            kvstore = self.config.kvstore.model_copy(
                update={"token": SecretStr(secrets.token_hex(16))})
            self.config = self.config.model_copy(update={"kvstore": kvstore})
        cfg = self.config
        transfer = cfg.transfer
        if self._ray_session is None:
            self._ray_session = RaySession.open(cfg)
        worker_cpu_bind = self._ray_session.worker_cpu_bind
        prefill_engine, decode_engine = (
            e.model_copy(update={"cpu_bind": worker_cpu_bind})
            for e in (cfg.prefill_engine(), cfg.decode_engine()))
        prefill_tp = prefill_engine.tensor_parallel_size
        decode_tp = decode_engine.tensor_parallel_size
        model = ModelConfig.from_pretrained(cfg.engine.model)
        for tp in {prefill_tp, decode_tp}:
            check_tensor_parallel(model, tp)  # a clear error before any actor starts
        # each role's Ray custom resource (deploy/placement.py); KV stores only where workers go
        self._resources = ray.cluster_resources()
        roles = (placement.DECODE,) if cfg.colocated else placement.ROLES
        self._role_demand = {r: placement.role_resources(r, cfg.placement, self._resources)
                             for r in roles}
        # the driver opens the global index first: an index actor (ray://) lives as long as the
        # process that created it, and a KV store may die (Ray restarts it)
        self._index = open_index(cfg.kvpool.index_url)
        # the stores start alongside the workers, which find theirs by name
        self.kvstores = start_kvstore_actors(
            cfg.kvstore, cfg.kvpool, block_layout(cfg.engine), cfg.ray_namespace,
            node_ids=placement.worker_node_ids(ray.nodes(), self._role_demand.values()),
            wait=False, actor_cls=self.actors.kvstore)
        # Triton on CPU runs interpreted: actors need TRITON_INTERPRET=1 before importing triton
        # and they log like the gateway (level, text|json, request ids): engine.logs
        runtime_env = {"env_vars": {**worker_env_vars(cfg.log_level, cfg.log_format),
                                    **kernels.runtime_env_vars(cfg.engine.kernel_backend,
                                                               cfg.engine.device),
                                    **worker_preload(cfg.worker_preload),
                                    **worker_huge_pages(cfg.worker_huge_pages)}}
        for node_id, handle in self.kvstores.items():  # for /metrics: tiers G2/G3 per node
            self.registry.add(Instance(f"kvstore-{node_id[:12]}", "kvstore", handle))
        for i in range(0 if cfg.colocated else cfg.prefill_instances):
            handle = prefill_actor(self.actors.prefill).options(
                max_concurrency=PREFILL_MAX_CONCURRENCY, runtime_env=runtime_env,
                **self._rank0_options(prefill_tp, placement.PREFILL),
            ).remote(f"prefill-{i}", prefill_engine, cfg.kvstore, cfg.kvpool, cfg.ray_namespace,
                     transfer)
            self.prefill.append(Instance(f"prefill-{i}", "prefill", handle))
        # colocated, nothing loads prefixes from the pool: what a decode published would only
        # take arena space
        decode_transfer = (transfer.model_copy(update={"decode_publish": False})
                           if cfg.colocated else transfer)
        for i in range(cfg.decode_instances):
            handle = decode_actor(self.actors.decode).options(
                runtime_env=runtime_env, **self._rank0_options(decode_tp, placement.DECODE)
            ).remote(
                f"decode-{i}", decode_engine, cfg.kvstore, cfg.ray_namespace, decode_transfer,
                cfg.kvpool)
            self.decode.append(Instance(f"decode-{i}", "decode", handle))
        wait_kvstore_actors(self.kvstores, cfg.kvstore.rpc_timeout_s * 6)
        infos = ray.get([i.handle.info.remote() for i in self.prefill + self.decode])
        for instance, info in zip(self.prefill + self.decode, infos):
            log.info("%s ready: pid %s on node %s", instance.worker_id, info["pid"],
                     info["node_id"])
            self.registry.add(instance)
        self.conductor, self._stats_poller = build_live_conductor(
            self.registry, policy=cfg.policy, admission=cfg.admission,
            slo=SLO(cfg.slo_ttft_s, cfg.slo_tbt_ms / 1000),
            cost_model=load_cost_model(cfg.cost_model).for_connector(cfg.transfer.backend)
            .for_pool(cfg.kvpool.backend),
            block_size=cfg.engine.block_size, model_name=cfg.model_name(),
            index_url=cfg.kvpool.index_url, pd_decider=cfg.pd_decider)
        self.pipeline.conductor = self.conductor
        if cfg.worker_stall_timeout_s:
            outputs = self.pipeline.outputs
            self.stall_watch = StallWatch(
                self.registry, cfg.worker_stall_timeout_s,
                busy=lambda i: outputs.num_requests(i.worker_id) > 0).start()
        return self

    def worker_health(self) -> dict:
        """What /health says of the workers: those marked dead and not back, and the last
        ones declared hung (router.stall_watch)."""
        hung = self.stall_watch.hung if self.stall_watch is not None else []
        return {"dead_workers": self.registry.dead(),
                "hung_workers": [{"worker_id": h.worker_id, "role": h.role,
                                  "reason": h.reason, "at": h.at} for h in hung]}

    def _rank0_options(self, tp: int, role: str) -> dict:
        """Options of a worker actor of `role`: at TP=1 its CPUs, GPUs, role resource and
        restarts (placement.worker_options); at TP=k rank 0 of the instance, in a new
        STRICT_PACK placement group of k bundles on a node of the role (its followers take the
        others)."""
        cfg = self.config
        gpus = cfg.worker_num_gpus()
        if tp == 1:
            return placement.worker_options(role, cfg.placement, self._resources,
                                            cfg.actor_num_cpus, gpus)
        demand = self._role_demand[role]
        pg = placement.tp_placement_group(tp, next(iter(demand), None), cfg.actor_num_cpus,
                                          gpus)
        self.placement_groups.append(pg)
        ray.get(pg.ready(), timeout=TP_PLACEMENT_TIMEOUT_S)
        return placement.tp_rank_options(pg, 0)

    def shutdown(self) -> None:
        if self.stall_watch is not None:
            self.stall_watch.stop()
            self.stall_watch = None
        if self._stats_poller is not None:
            self._stats_poller.stop()
            self._stats_poller = None
        self.registry.close()  # its dead-instance probes
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
        if self._index is not None:
            try:
                if isinstance(self._index, ActorIndex):  # ours, and it outlives the stores
                    self._index.clear()
                self._index.close()
            except Exception as exc:  # noqa: BLE001 -- shutting down either way
                log.warning("global index not cleared: %s", exc)
            self._index = None
        if self._ray_session is not None:
            self._ray_session.close()
            self._ray_session = None

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()
