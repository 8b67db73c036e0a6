"""The discrete-event cluster simulation: N prefill and M decode instances driven by a trace,
routed by the real Conductor (router.conductor) over real block pools and a real index.

Events, in time order: a request arrives → `Conductor.decide` (policy + admission; a rejection
ends it) → it waits in its prefill instance's FIFO → the prefill starts: the instance reuses its
local prefix (G1, its node's G2/G3) and, when the plan says so, pulls the rest of the longest
cached prefix from another node, then computes the remainder; busy for
T_transfer(loaded) + T_prefill(new, cached) → the first token (TTFT); all full blocks are
cached on the node → the KV reaches the decode instance (streamed during the prefill, so at
max(prefill end, prefill start + T_transfer(prompt))) → decode admits it if its KV fits and the
step time stays within the TBT SLO; otherwise the prefill was wasted: with admission the
request is rejected there, without it the request runs anyway (or waits for KV room).

With a PD decider (router.pd_decider) a request it keeps local skips the prefill instance: its
decode instance computes the whole prompt for T_prefill(prompt), during which every sequence
decoding there waits (one stall; the engine's chunked prefill spreads the same time over
several steps), then the request joins. Decode instances keep no prefix cache here, so the
decider sees none.

With `SimConfig.autoscale` every instance the range allows exists, and the SLO planner
(loadtest.simulator.autoscale) decides which serve; `lifetimes` records each instance's runs
for the instance-hours the summary reports.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter, deque
from dataclasses import dataclass, field

from pdcluster.kvstore.index import MemoryIndex
from pdcluster.loadtest.simulator.autoscale import SimAutoscaler
from pdcluster.loadtest.simulator.cache import NodeCache
from pdcluster.loadtest.simulator.decode import DecodeInstance
from pdcluster.loadtest.simulator.workload import SimRequest
from pdcluster.loadtest.trace import TRACE_BLOCK_SIZE
from pdcluster.router.admission import SLO, decode_rejection
from pdcluster.router.conductor import (Conductor, InstanceRegistry, PrefixKeyer, RequestRejected,
                                        RouteRequest)
from pdcluster.router.cost_model import PATH_PD, CostModel
from pdcluster.router.planner import AutoscaleRange
from pdcluster.router.load_source import LoadSource
from pdcluster.router.policies import PrefillPlan
from pdcluster.router.policies.base import DecodeLoad
from pdcluster.router.policies.forecast import DecodeForecast

LEASE_S = 1e12
REPLICA_INPUTS = ("private", "reports", "shared")


@dataclass(frozen=True)
class SimConfig:
    """Cluster shape and capacities; None capacities come from the cost model."""

    cost: CostModel
    prefill_instances: int = 8
    decode_instances: int = 8
    policy: str = "kvcache_centric"
    admission: str = "none"
    slo: SLO = SLO()
    device_cache_tokens: int = 0
    dram_cache_tokens: int | None = None
    ssd_cache_tokens: int = 0
    decode_kv_tokens: int | None = None
    block_size: int = TRACE_BLOCK_SIZE
    sample_interval_s: float = 10.0
    pd_decider: str = "always"
    #: Conductors (gateway replicas) routing in turn: request i goes to conductor i % n.
    conductors: int = 1
    #: with several, what each knows of the prefill queues (_ReplicaLoads): "private" (its
    #: own decisions), "reports" (plus the instances' queues as reported every
    #: report_interval_s: the live router.policies.live_loads), "shared" (plus every
    #: replica's decisions, published with decision_delay_s)
    inputs: str = "shared"
    report_interval_s: float = 0.25
    decision_delay_s: float = 0.0
    #: the SLO planner (router.planner) scales each role within this range every
    #: `planner_interval_s`; prefill_instances / decode_instances are the counts at start
    autoscale: AutoscaleRange | None = None
    planner_interval_s: float = 30.0
    #: seconds from an instance's start to its first request (model load)
    instance_startup_s: float = 60.0


@dataclass(slots=True)
class RequestResult:
    request: SimRequest
    status: str = "pending"  # ok | rejected | decode_rejected
    reason: str | None = None
    prefill_id: str | None = None
    decode_id: str | None = None
    started_s: float | None = None
    first_token_s: float | None = None
    end_s: float | None = None
    prefill_s: float = 0.0
    wasted: bool = False
    hit_blocks: Counter = field(default_factory=Counter)
    local: bool = False  # prefilled on its decode instance (the PD decider)
    conductor: int = 0  # which replica routed it


class _Prefill:
    def __init__(self, instance_id: str, node_id: str, cache: NodeCache) -> None:
        self.instance_id, self.node_id, self.cache = instance_id, node_id, cache
        self.queue: deque[tuple[RequestResult, PrefillPlan]] = deque()
        self.backlog_s = 0.0  # predicted exec of the queued ones
        self.busy_until = 0.0
        self.running: RequestResult | None = None
        self.busy_s_total = 0.0  # prefill seconds started here

    def idle(self) -> bool:
        return self.running is None and not self.queue


class _SimLoads(LoadSource):
    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    def now(self) -> float:
        return self.sim.now

    def node_of(self, instance_id: str) -> str | None:
        return self.sim.prefills[instance_id].node_id

    def prefill_queue_s(self, instance_id: str) -> float:
        p = self.sim.prefills[instance_id]
        return max(0.0, p.busy_until - self.sim.now) + p.backlog_s

    def decode_load(self, instance_id: str) -> DecodeLoad:
        d = self.sim.decodes[instance_id]
        d.advance_to(self.sim.now)
        return d.load()


class _ReplicaLoads(_SimLoads):
    """One Conductor of several. The prefill queue it knows: what it routed there itself
    (queued, or running: a perfect ledger of its own); with "reports", at least the
    instance's whole queue as of its last report plus what it routed there since (the live
    LedgerLoads); with "shared", plus the other replicas' decisions since the report, each
    visible once `decision_delay_s` old (published where the replicas read them). Decode
    loads are the workers' reports."""

    def __init__(self, sim: Simulation, conductor: int, inputs: str, delay_s: float) -> None:
        super().__init__(sim)
        self.conductor, self.inputs, self.delay_s = conductor, inputs, delay_s

    def prefill_queue_s(self, instance_id: str) -> float:
        p, now = self.sim.prefills[instance_id], self.sim.now
        entries = [(res.request.arrival_s, res.conductor, plan.exec_s) for res, plan in p.queue]
        if p.running is not None:
            entries.append((p.running.request.arrival_s, p.running.conductor,
                            max(0.0, p.busy_until - now)))
        k = self.conductor
        own = sum(s for _, c, s in entries if c == k)
        if self.inputs == "private":
            return own
        since = sum(s for routed, c, s in entries if routed >= self.sim.reported_at and (
            c == k or (self.inputs == "shared" and now - routed >= self.delay_s)))
        return max(own, self.sim.reported_prefill_queue_s(instance_id) + since)


class Simulation:
    def __init__(self, config: SimConfig, requests: list[SimRequest]) -> None:
        self.config = config
        cost = config.cost
        self.now = 0.0
        self.index = MemoryIndex(clock=lambda: self.now)
        blocks = lambda tokens: int(tokens) // config.block_size  # noqa: E731
        dram = cost.dram_cache_tokens if config.dram_cache_tokens is None else \
            config.dram_cache_tokens
        scale = config.autoscale
        made = {"prefill": config.prefill_instances, "decode": config.decode_instances}
        if scale is not None:  # every instance the range allows exists; some serve
            made = {r: scale.of(r).maximum for r in made}
        self.prefills: dict[str, _Prefill] = {}
        for i in range(made["prefill"]):
            node = f"prefill-node-{i}"
            self.index.heartbeat(node, LEASE_S)
            cache = NodeCache(f"prefill-{i}", node, self.index,
                              blocks(config.device_cache_tokens), blocks(dram),
                              blocks(config.ssd_cache_tokens))
            self.prefills[f"prefill-{i}"] = _Prefill(f"prefill-{i}", node, cache)
        kv = cost.decode_kv_tokens if config.decode_kv_tokens is None else config.decode_kv_tokens
        self.decodes = {f"decode-{j}": DecodeInstance(f"decode-{j}", cost, kv, self._finished)
                        for j in range(made["decode"])}
        #: the instances routed to, by role; each run of an instance: [role, id, start s,
        #: stop s or None]
        self.serving = {"prefill": list(self.prefills), "decode": list(self.decodes)}
        self.lifetimes: list[list] = []
        if scale is not None:
            for role, n in (("prefill", config.prefill_instances),
                            ("decode", config.decode_instances)):
                bounds = scale.of(role)
                self.serving[role] = self.serving[role][:min(max(n, bounds.minimum),
                                                             bounds.maximum)]
        for role, ids in self.serving.items():
            self.lifetimes += [[role, i, 0.0, None] for i in ids]
        self.first_tokens: list[tuple[float, float]] = []  # (time, TTFT)
        self.finishes: list[tuple[float, float]] = []  # (time, TBT) of finished decodes
        self.end_s = 0.0
        self.autoscaler = SimAutoscaler(self, scale) if scale is not None else None
        self.forecast = DecodeForecast(cost, grace_s=math.inf)  # joins are reported
        if config.inputs not in REPLICA_INPUTS:
            raise ValueError(f"inputs must be one of {REPLICA_INPUTS}, got {config.inputs!r}")
        self.conductors = [
            Conductor(InstanceRegistry(), config.policy,
                      loads=_SimLoads(self) if config.conductors == 1 else
                      _ReplicaLoads(self, k, config.inputs, config.decision_delay_s),
                      index=self.index, keyer=PrefixKeyer(config.block_size, ""),
                      cost_model=cost, admission=config.admission, slo=config.slo,
                      forecast=self.forecast, pd_decider=config.pd_decider)
            for k in range(config.conductors)]
        self.conductor = self.conductors[0]
        self._reports: dict[str, float] = {}  # prefill queues, as last reported
        self.reported_at = 0.0
        self.results = [RequestResult(r) for r in requests]
        self._by_id = {r.request.request_id: r for r in self.results}
        self._by_order = {r.request.request_id: i for i, r in enumerate(self.results)}
        self._events: list = []
        self._seq = itertools.count()
        self.reuse = Counter()  # block key -> times reused by a prefill
        self.samples: list[dict] = []

    def reported_prefill_queue_s(self, instance_id: str) -> float:
        """The instance's queue as its last report said, less the time since."""
        return max(0.0, self._reports.get(instance_id, 0.0) - (self.now - self.reported_at))

    def _report(self, _) -> None:
        loads = _SimLoads(self)
        self._reports = {p: loads.prefill_queue_s(p) for p in self.prefills}
        self.reported_at = self.now

    def _push(self, t: float, kind: str, payload) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def run(self) -> Simulation:
        for res in self.results:
            self._push(res.request.arrival_s, "arrive", res)
        end = max((r.request.arrival_s for r in self.results), default=0.0)
        t = 0.0
        while t <= end:
            self._push(t, "sample", None)
            t += self.config.sample_interval_s
        if len(self.conductors) > 1 and self.config.inputs != "private":
            for i in range(int(end / self.config.report_interval_s) + 1):
                self._push(i * self.config.report_interval_s, "report", None)
        handlers = {"arrive": self._arrive, "prefill_done": self._prefill_done,
                    "decode_ready": self._decode_ready, "sample": self._sample,
                    "report": self._report}
        if self.autoscaler is not None:
            handlers.update(self.autoscaler.handlers())
            self.autoscaler.schedule(end)
        while self._events:
            self.now, _, kind, payload = heapq.heappop(self._events)
            handlers[kind](payload)
        for d in self.decodes.values():
            d.drain()
        self.end_s = max([r.end_s for r in self.results if r.end_s is not None] + [self.now])
        return self

    def push(self, t: float, kind: str, payload) -> None:
        """Schedule an event (an extension's: the autoscaler's)."""
        self._push(t, kind, payload)

    def instance_seconds(self) -> dict[str, float]:
        """Seconds each role's instances ran (starting, serving or draining), to the end."""
        out = {"prefill": 0.0, "decode": 0.0}
        for role, _, start, stop in self.lifetimes:
            out[role] += max(0.0, (self.end_s if stop is None else stop) - start)
        return out

    def _arrive(self, res: RequestResult) -> None:
        req = res.request
        route = RouteRequest(req.request_id, (), block_keys=req.keys, num_tokens=req.input_tokens)
        res.conductor = self._by_order[req.request_id] % len(self.conductors)
        try:
            decision = self.conductors[res.conductor].decide(route, self.serving["prefill"],
                                                             self.serving["decode"])
        except RequestRejected as exc:
            res.status, res.reason = "rejected", exc.rejection.reason
            return
        res.prefill_id = decision.prefill.instance_id
        res.decode_id = decision.decode.instance_id
        if decision.local:
            self._prefill_on_decode(res)
            return
        p = self.prefills[res.prefill_id]
        p.queue.append((res, decision.prefill))
        p.backlog_s += decision.prefill.exec_s
        if p.running is None:
            self._start(p)

    def _prefill_on_decode(self, res: RequestResult) -> None:
        req = res.request
        res.local, res.prefill_id = True, None
        res.prefill_s = self.config.cost.t_prefill(req.input_tokens)
        d = self.decodes[res.decode_id]
        res.started_s = self.now
        res.first_token_s = d.stall(self.now, res.prefill_s)
        self.first_tokens.append((res.first_token_s, res.first_token_s - req.arrival_s))
        if req.output_tokens <= 1:
            res.status, res.end_s = "ok", res.first_token_s
            self.forecast.discard(req.request_id)
            return
        d.join(req.request_id, req.input_tokens + 1, req.output_tokens - 1, res.first_token_s,
               queue_when_full=True)
        self.forecast.joined(req.request_id, res.first_token_s)

    def _start(self, p: _Prefill) -> None:
        res, plan = p.queue.popleft()
        p.backlog_s = max(0.0, p.backlog_s - plan.exec_s) if p.queue else 0.0
        req, cost, bs = res.request, self.config.cost, self.config.block_size
        max_hit = (req.input_tokens - 1) // bs
        local, device_run, by_tier = p.cache.local_prefix(req.keys[:max_hit])
        cached = local
        if plan.pull and local < min(max_hit, len(req.keys)):
            cached = max(local, len(self.index.longest_prefix(list(req.keys[:max_hit]))))
            by_tier["remote"] += cached - local
        self.reuse.update(req.keys[:cached])
        res.hit_blocks = by_tier
        res.prefill_s = cost.t_load_tokens((local - device_run) * bs, (cached - local) * bs) + \
            cost.t_prefill(req.input_tokens - cached * bs, cached * bs)
        res.started_s = self.now
        p.busy_s_total += res.prefill_s
        p.running, p.busy_until = res, self.now + res.prefill_s
        self._push(p.busy_until, "prefill_done", p)

    def _prefill_done(self, p: _Prefill) -> None:
        res, req = p.running, p.running.request
        p.cache.store(req.keys)
        res.first_token_s = self.now
        self.first_tokens.append((self.now, self.now - req.arrival_s))
        self.conductors[res.conductor].prefill_done(req.request_id)
        p.running = None
        if p.queue:
            self._start(p)
        if req.output_tokens <= 1:
            res.status, res.end_s = "ok", self.now
            self.forecast.discard(req.request_id)
            return
        streamed = res.started_s + self.config.cost.t_transfer_tokens(req.input_tokens,
                                                                      PATH_PD)
        self._push(max(self.now, streamed), "decode_ready", res)

    def _decode_ready(self, res: RequestResult) -> None:
        req = res.request
        d = self.decodes[res.decode_id]
        d.advance_to(self.now)
        rejection = decode_rejection(self.config.cost, d.load(), req.input_tokens,
                                     self.config.slo)
        res.wasted = rejection is not None
        if rejection is not None and self.config.admission != "none":
            res.status, res.reason, res.end_s = "decode_rejected", rejection.reason, self.now
            self.forecast.discard(req.request_id)
            return
        d.join(req.request_id, req.input_tokens + 1, req.output_tokens - 1, self.now,
               queue_when_full=True)
        self.forecast.joined(req.request_id, self.now)

    def _finished(self, request_id: str, joined_at: float, finished_at: float) -> None:
        res = self._by_id[request_id]
        res.status, res.end_s = "ok", finished_at
        if res.request.output_tokens > 1:
            self.finishes.append((finished_at, (finished_at - res.first_token_s)
                                  / (res.request.output_tokens - 1)))
        self.forecast.finished(request_id, finished_at - joined_at)

    def _sample(self, _) -> None:
        loads = self.conductor.loads
        self.samples.append({
            "t": self.now,
            "prefill_queue_s": [round(loads.prefill_queue_s(p), 3) for p in self.prefills],
            "decode_batch": [loads.decode_load(d).batch_size for d in self.decodes],
            "decode_tokens": [loads.decode_load(d).context_tokens for d in self.decodes],
        })
