"""The chaos suite's cluster and load.

A real cluster (deploy.launcher.Cluster: 2 prefill + 2 decode actors, a KV store, the global
index in a real redis-server) behind the real gateway served by uvicorn; load is 16 streaming
completions through the `openai` client. The suite starts its own Ray, so it runs as its own
pytest process (scripts/test.sh) and is collected only when named on the command line.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import pytest
import ray
import uvicorn

from pdcluster.deploy.config import ServeConfig
from pdcluster.deploy.launcher import Cluster
from pdcluster.deploy.serve import gateway_app
from pdcluster.engine.config import EngineConfig
from pdcluster.kvstore.config import KVStoreConfig, KVTransferConfig
from pdcluster.kvstore.pool_config import KVPoolConfig
from tests.kvstore.conftest import RedisServer, _free_port, _need_redis
from tests.faults import FAULTY
from tests.markers import starts

HERE = Path(__file__).parent
NUM_REQUESTS = 16
MAX_TOKENS = 64
REQUEST_DEADLINE_S = 120.0  # a request with no final event by then is lost
SETTLE_DEADLINE_S = 60.0
TAIL_TTL_S = 5.0  # tails a dead decode never took are reclaimed after this
STALL_TIMEOUT_S = 5.0  # a worker running requests without a step this long is restarted
#: a running request's full blocks go to the pool every this many (what a migration loads)
PUBLISH_INTERVAL = 4
#: what the structured half of the load must produce (a grammar that survives the fault)
SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["cat", "dog", "bird"]},
    "toys": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2}},
    "required": ["kind", "toys"], "additionalProperties": False}


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    """Only when named: the suite runs its own Ray (like tests/multinode)."""
    if collection_path.parent == HERE:
        named = [Path(a.split("::")[0]).resolve() for a in config.args]
        return not any(p == HERE or HERE in p.parents for p in named) or None
    return None


@dataclass(frozen=True)
class RequestSpec:
    index: int
    prompt: str
    temperature: float
    seed: int
    structured: bool = False  # constrained to SCHEMA
    max_tokens: int = MAX_TOKENS
    cache_salt: str | None = None  # a run of its own in the prefix caches and the pool


def request_specs() -> list[RequestSpec]:
    """Half greedy, half seeded sampling; every prompt different; one in four seeded ones
    under a JSON schema."""
    subjects = ["a cat", "a dog", "a little girl", "a boy", "a bird", "a big tree", "a red ball",
                "a fish", "a king", "a frog", "a small car", "a bear", "a cake", "a star",
                "a boat", "a bunny"]
    return [RequestSpec(i, f"Once upon a time, there was {subjects[i]} who",
                        0.0 if i % 2 == 0 else 1.0, 1000 + i, i % 4 == 3)
            for i in range(NUM_REQUESTS)]


@dataclass
class Outcome:
    """What the client got for one request."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    lost: bool = False
    chunks: int = 0

    @property
    def completed(self) -> bool:
        return self.finish_reason is not None and self.error is None and not self.lost


@dataclass
class Report:
    kind: str
    outcomes: list[Outcome]
    migrations: int = 0

    @property
    def completed(self) -> int:
        return sum(o.completed for o in self.outcomes)

    @property
    def errored(self) -> int:
        return sum(o.error is not None and not o.lost for o in self.outcomes)

    @property
    def lost(self) -> int:
        return sum(o.lost or (o.finish_reason is None and o.error is None)
                   for o in self.outcomes)

    def __str__(self) -> str:
        errors = sorted({o.error[:100] for o in self.outcomes if o.error})
        return (f"[chaos] {self.kind}: {self.completed} completed, {self.errored} ended with a "
                f"clear error, {self.lost} lost; {self.migrations} migrations"
                + "".join(f"\n    error: {e}" for e in errors))


async def _one(client, model: str, spec: RequestSpec, out: Outcome) -> None:
    import openai

    try:
        stream = await client.completions.create(
            model=model, prompt=spec.prompt, max_tokens=spec.max_tokens,
            temperature=spec.temperature, seed=spec.seed, stream=True, extra_body={
                "ignore_eos": True, "return_token_ids": True,
                **({"cache_salt": spec.cache_salt} if spec.cache_salt else {}),
                **({"structured_outputs": {"json": SCHEMA}} if spec.structured else {})})
        async for chunk in stream:
            choice = chunk.choices[0]
            out.chunks += 1
            out.text += choice.text
            out.token_ids += (choice.model_extra or {}).get("token_ids") or []
            out.finish_reason = choice.finish_reason or out.finish_reason
    except openai.APIError as exc:  # an HTTP error status or an SSE error event
        out.error = f"{type(exc).__name__}: {exc}"


async def _load(api_base: str, model: str, specs: list[RequestSpec],
                fault: Callable[[], None] | None, trigger_chunks: int) -> list[Outcome]:
    import openai

    client = openai.AsyncOpenAI(base_url=api_base, api_key="unused", max_retries=0,
                                timeout=REQUEST_DEADLINE_S)
    outcomes = [Outcome() for _ in specs]

    async def guarded(spec: RequestSpec) -> None:
        try:
            await asyncio.wait_for(_one(client, model, spec, outcomes[spec.index]),
                                   REQUEST_DEADLINE_S)
        except asyncio.TimeoutError:
            outcomes[spec.index].lost = True

    async def inject() -> None:
        while sum(o.chunks for o in outcomes) < trigger_chunks:
            if all(o.finish_reason or o.error for o in outcomes):
                raise AssertionError("the load finished before the fault was injected")
            await asyncio.sleep(0.002)
        await asyncio.to_thread(fault)

    tasks = [guarded(s) for s in specs] + ([inject()] if fault is not None else [])
    try:
        await asyncio.gather(*tasks)
    finally:
        await client.close()
    return outcomes


@dataclass
class ChaosEnv:
    cluster: Cluster
    redis: RedisServer
    api_base: str
    model: str

    def run(self, kind: str, fault: Callable[[], None] | None = None,
            trigger_chunks: int = 0, specs: list[RequestSpec] | None = None) -> Report:
        """The requests (default: the 16 of request_specs), with `fault` run once
        `trigger_chunks` chunks have streamed."""
        before = self.cluster.pipeline.migrations_total
        outcomes = asyncio.run(_load(self.api_base, self.model, specs or request_specs(), fault,
                                     trigger_chunks))
        report = Report(kind, outcomes, self.cluster.pipeline.migrations_total - before)
        print(report)
        return report

    @staticmethod
    def pid_of(instance) -> int:
        """The process id of a registry Instance (worker or KV store)."""
        if instance.role == "kvstore":
            return ray.get(instance.handle.pid.remote(), timeout=30)
        return ray.get(instance.handle.info.remote(), timeout=30)["pid"]

    def kill_busiest(self, role: str, sig: int = signal.SIGKILL
                     ) -> tuple[Callable[[], None], dict]:
        """A fault that sends `sig` (default: kill -9) to the live `role` instance running the
        most requests at the moment it runs (routing may leave one idle), and the record it
        fills in: the victim's worker_id and pid."""
        pids = {i.worker_id: self.pid_of(i) for i in self.cluster.registry.by_role(role)}
        victim: dict = {}

        def fault() -> None:
            live = self.cluster.registry.by_role(role)
            stats = ray.get([i.handle.stats.remote() for i in live], timeout=10)
            busiest = max(zip(live, stats), key=lambda p: p[1].num_active)[0]
            victim.update(worker_id=busiest.worker_id, pid=pids[busiest.worker_id])
            os.kill(victim["pid"], sig)

        return fault, victim

    def settle(self, roles=("prefill", "decode")) -> dict[str, dict]:
        """Wait until every live worker holds no block and runs nothing and every live KV store
        pins no G2 slot and keeps no tail. Returns the last stats per instance (AssertionError
        past SETTLE_DEADLINE_S, listing what is still held)."""
        deadline = time.monotonic() + SETTLE_DEADLINE_S
        while True:
            stats, held = {}, []
            for role in (*roles, "kvstore"):
                for inst in self.cluster.registry.by_role(role):
                    try:
                        s = stats[inst.worker_id] = ray.get(inst.handle.stats.remote(), timeout=10)
                    except ray.exceptions.RayActorError:
                        continue  # a dead KV store: nothing of it can leak into a live part
                    if role == "kvstore":
                        busy = s["tiers"]["host"]["used"] + s["num_tails"]
                    else:
                        # free counts cached blocks too (evictable): all free = baseline
                        busy = (s.num_blocks - s.num_free_blocks + s.num_used_blocks
                                + s.num_active + s.num_waiting)
                    if busy:
                        held.append((inst.worker_id, s))
            if not held:
                return stats
            assert time.monotonic() < deadline, f"blocks still held after settling: {held}"
            time.sleep(0.25)

    def wait_rejoined(self, role: str, count: int) -> None:
        deadline = time.monotonic() + SETTLE_DEADLINE_S
        while len(self.cluster.registry.by_role(role)) < count:
            assert time.monotonic() < deadline, f"killed {role} actor did not rejoin"
            time.sleep(0.1)


@contextlib.contextmanager
def running_env(workdir: Path, **overrides) -> Iterator[ChaosEnv]:
    """A redis-server, a Cluster on it (2 prefill + 2 decode unless overridden) and the
    gateway over real HTTP; all stopped on exit."""
    _need_redis()
    redis = RedisServer(workdir)
    redis.start()
    config = ServeConfig(**{
        "prefill_instances": 2, "decode_instances": 2, "ray_num_cpus": 6,
        "pd_decider": "always",  # the chaos of the disaggregated path
        "ray_namespace": f"pdcluster-chaos-{os.getpid()}",
        "engine": EngineConfig(num_kv_blocks=256),
        "kvstore": KVStoreConfig(tail_ttl_s=TAIL_TTL_S),
        "transfer": KVTransferConfig(decode_publish_interval=PUBLISH_INTERVAL),
        "worker_stall_timeout_s": STALL_TIMEOUT_S,
        "kvpool": KVPoolConfig(index_url=redis.url, node_lease_s=3.0,
                               dram_cache_bytes=64 << 20),
        **overrides})
    port = _free_port()
    try:
        with Cluster(config, actors=FAULTY) as cluster:
            server = uvicorn.Server(uvicorn.Config(gateway_app(cluster.config, cluster),
                                                   host="127.0.0.1", port=port,
                                                   log_level="warning", lifespan="off"))
            thread = threading.Thread(target=server.run, name="gateway", daemon=True)
            thread.start()
            deadline = time.time() + 30
            while not server.started:
                assert time.time() < deadline and thread.is_alive(), "gateway did not start"
                time.sleep(0.05)
            try:
                yield ChaosEnv(cluster, redis, f"http://127.0.0.1:{port}/v1",
                               config.model_name())
            finally:
                server.should_exit = True
                thread.join(timeout=10)
    finally:
        redis.stop()


@pytest.fixture(scope="module")
@starts("ray", "server")
def chaos_env(tmp_path_factory) -> Iterator[ChaosEnv]:
    """The disaggregated cluster, for the whole module."""
    with running_env(tmp_path_factory.mktemp("redis")) as env:
        yield env


@pytest.fixture(scope="module")
@starts("ray", "server")
def colocated_env(tmp_path_factory) -> Iterator[ChaosEnv]:
    """Two colocated decode instances (`--colocated`), for the whole module."""
    with running_env(tmp_path_factory.mktemp("redis"), colocated=True) as env:
        yield env
