"""The SLO planner (router.planner) inside the simulation: the live control loop's decisions
(deploy.autoscaler) on simulated measurements.

Every `planner_interval_s` the planner sees what the interval measured: prefill, the p90 TTFT
of the first tokens in it, the largest predicted queue wait and the busy fraction of the
serving instances; decode, the p90 TBT of the requests that finished in it, the largest KV
usage and the sequences waiting for KV room. A scale-up starts the lowest-numbered stopped
instance, which serves `instance_startup_s` later (an empty G1; its node's G2 as that node
left it); a scale-down stops routing to the least loaded serving instance, which stops once
it holds nothing. Instance time counts from start to stop (SimConfig, Simulation.lifetimes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdcluster.router.planner import (AutoscaleRange, Decision, Planner, PlannerConfig,
                                      RoleObservation, p90)


class SimAutoscaler:
    """Scales `sim` (the loadtest.simulator.engine.Simulation that made it, which imports
    this module: it is taken as it comes, not imported back)."""

    def __init__(self, sim: Any, scale: AutoscaleRange) -> None:
        self.sim = sim
        cfg = sim.config
        self.interval_s = cfg.planner_interval_s
        self.planner = Planner(PlannerConfig(cfg.slo, scale))
        self.starting: dict[str, str] = {}  # instance id -> role
        self.draining: dict[str, str] = {}
        self.decisions: list[dict] = []  # {"t", "role", "delta", "reason", "instance"}
        self._last_t = 0.0
        self._busy = {p: 0.0 for p in sim.prefills}
        self._backlog = 0.0

    def handlers(self) -> dict[str, Callable]:
        return {"plan": self.tick, "instance_ready": self._ready}

    def schedule(self, end_s: float) -> None:
        """Plan ticks over the arrivals' span."""
        t = self.interval_s
        while t <= end_s + self.interval_s:
            self.sim.push(t, "plan", None)
            t += self.interval_s

    def _role_ids(self, role: str) -> dict:
        return self.sim.prefills if role == "prefill" else self.sim.decodes

    def observe(self) -> tuple[RoleObservation, RoleObservation]:
        sim, since, now = self.sim, self._last_t, self.sim.now
        span = max(now - since, 1e-9)
        loads = sim.conductor.loads
        serving_p = sim.serving["prefill"]
        busy = 0.0
        for pid, p in sim.prefills.items():
            if pid in serving_p:
                busy += p.busy_s_total - self._busy[pid]
            self._busy[pid] = p.busy_s_total
        queues = [loads.prefill_queue_s(p) for p in serving_p]
        # offered load: the work run in the interval plus what its queues grew by
        offered = max(0.0, busy + sum(queues) - self._backlog)
        self._backlog = sum(queues)
        prefill = RoleObservation(
            len(serving_p), p90([ttft for t, ttft in sim.first_tokens if since < t <= now]),
            max(queues, default=0.0), offered / (span * max(1, len(serving_p))),
            starting=sum(r == "prefill" for r in self.starting.values()),
            draining=sum(r == "prefill" for r in self.draining.values()))
        serving_d = sim.serving["decode"]
        usage, waiting = [], 0
        for did in serving_d:
            d = sim.decodes[did]
            d.advance_to(now)
            usage.append(d.context_tokens / d.capacity_tokens if d.capacity_tokens else 0.0)
            waiting += len(d._waiting)
        decode = RoleObservation(
            len(serving_d), p90([tbt for t, tbt in sim.finishes if since < t <= now]),
            utilization=sum(usage) / max(1, len(usage)), waiting=waiting,
            starting=sum(r == "decode" for r in self.starting.values()),
            draining=sum(r == "decode" for r in self.draining.values()))
        return prefill, decode

    def tick(self, _) -> None:
        self._stop_drained()
        prefill, decode = self.observe()
        self._last_t = self.sim.now
        for decision in self.planner.decide(prefill, decode):
            self._apply(decision)

    def _apply(self, decision: Decision) -> None:
        sim, role = self.sim, decision.role
        if decision.delta > 0:
            running = set(sim.serving[role]) | set(self.starting) | set(self.draining)
            stopped = [i for i in self._role_ids(role) if i not in running]
            for instance_id in stopped[:decision.delta]:
                self.starting[instance_id] = role
                sim.lifetimes.append([role, instance_id, sim.now, None])
                sim.push(sim.now + sim.config.instance_startup_s, "instance_ready", instance_id)
                self._record(decision, instance_id)
            return
        serving = sim.serving[role]
        loads = sim.conductor.loads
        load = (loads.prefill_queue_s if role == "prefill"
                else lambda i: loads.decode_load(i).context_tokens)
        instance_id = min(serving, key=lambda i: (load(i), -serving.index(i)))
        serving.remove(instance_id)
        self.draining[instance_id] = role
        self._record(decision, instance_id)

    def _record(self, decision: Decision, instance_id: str) -> None:
        self.decisions.append({"t": round(self.sim.now, 3), "role": decision.role,
                               "delta": 1 if decision.delta > 0 else -1,
                               "reason": decision.reason, "instance": instance_id})

    def _ready(self, instance_id: str) -> None:
        role = self.starting.pop(instance_id)
        self.sim.serving[role].append(instance_id)

    def _stop_drained(self) -> None:
        sim = self.sim
        for instance_id, role in list(self.draining.items()):
            if role == "prefill":
                idle = sim.prefills[instance_id].idle()
            else:
                d = sim.decodes[instance_id]
                d.advance_to(sim.now)
                idle = d.load().batch_size == 0
            if idle:
                del self.draining[instance_id]
                run = next(r for r in sim.lifetimes if r[1] == instance_id and r[3] is None)
                run[3] = sim.now
