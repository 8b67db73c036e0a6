"""The SLO planner: how many prefill and decode instances the load of the last interval needs.

One decision per role per report interval, from what that interval measured against the SLOs
(the load-based mode of Dynamo's planner; DistServe's point that each phase scales on its own
SLO, TTFT for prefill and TBT for decode):

    prefill  up    the interval's p90 TTFT > SLO, or the predicted wait of its queue > SLO,
                   or the offered load over 100 % (the queues grow: TTFT will breach)
             down  for `quiet_intervals` in a row: p90 TTFT < `down_fraction` × SLO; and
                   their mean offered load, spread over one instance fewer, < `busy_low`
    decode   up    the interval's p90 TBT > SLO, or KV usage > `kv_high`, or sequences wait
                   for KV room
             down  for `quiet_intervals` in a row: p90 TBT < `down_fraction` × SLO and no
                   sequence waits; and their largest KV usage, spread over one instance
                   fewer, < `kv_low`

A scale-up adds at least one instance, and as many as carry the interval's load at
`busy_high` (prefill) or `kv_target` (decode): one step to the size the load needs, as
Dynamo's planner computes replicas from load rather than stepping by one.

A role with an instance still starting does not scale up again (the new one has not taken load
yet); a scale-down is a drain (the caller stops routing to the instance and stops it once
it holds nothing), and a drain in progress holds further scale-downs of its role. The same
code runs in the live control loop (deploy.autoscaler) and in the simulator
(loadtest.simulator.engine), so what the simulator shows is what the cluster does.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from pdcluster.router.admission import SLO

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class RoleRange:
    """The instances a role may have: minimum <= n <= maximum, minimum >= 1."""

    minimum: int
    maximum: int


@dataclass(frozen=True)
class AutoscaleRange:
    """`--autoscale prefill=MIN:MAX,decode=MIN:MAX`."""

    prefill: RoleRange
    decode: RoleRange

    @classmethod
    def parse(cls, text: str) -> AutoscaleRange:
        """Raises ValueError naming what is wrong (a missing role, MIN > MAX, MIN < 1)."""
        ranges: dict[str, RoleRange] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            match = re.fullmatch(r"(prefill|decode)=(\d+):(\d+)", part)
            if match is None:
                raise ValueError(f"--autoscale: {part!r} is not ROLE=MIN:MAX (ROLE: prefill or "
                                 "decode)")
            role, lo, hi = match.group(1), int(match.group(2)), int(match.group(3))
            if not 1 <= lo <= hi:
                raise ValueError(f"--autoscale: {role} needs 1 <= MIN <= MAX (got {lo}:{hi})")
            ranges[role] = RoleRange(lo, hi)
        missing = [r for r in ROLES if r not in ranges]
        if missing:
            raise ValueError(f"--autoscale: give both roles, e.g. prefill=1:2,decode=1:2 "
                             f"(missing {', '.join(missing)})")
        return cls(ranges["prefill"], ranges["decode"])

    def of(self, role: str) -> RoleRange:
        return getattr(self, role)

    def __str__(self) -> str:
        return ",".join(f"{r}={self.of(r).minimum}:{self.of(r).maximum}" for r in ROLES)


@dataclass(frozen=True)
class RoleObservation:
    """One role over one report interval.

    instances: serving (routed to); starting: added, not serving yet; draining: being removed.
    latency_s: the interval's p90 TTFT (prefill) or p90 TBT (decode) of the requests that
    reached it (decode: or the workers' mean step time, the larger), None when none did.
    queue_s (prefill): the wait of a request arriving now, the largest over instances. utilization: prefill, the offered load per
    serving instance ((busy seconds + queue growth) / (interval × instances), above 1 when
    the queues grow); decode, the mean over instances of KV blocks used / total. waiting
    (decode): sequences waiting for KV room.
    """

    instances: int
    latency_s: float | None = None
    queue_s: float = 0.0
    utilization: float = 0.0
    waiting: int = 0
    starting: int = 0
    draining: int = 0


@dataclass(frozen=True)
class PlannerConfig:
    slo: SLO
    range: AutoscaleRange
    down_fraction: float = 0.5
    busy_high: float = 0.8
    busy_low: float = 0.6
    kv_high: float = 0.9
    kv_target: float = 0.7
    kv_low: float = 0.6
    quiet_intervals: int = 6


@dataclass(frozen=True)
class Decision:
    """delta: > 0 add that many instances, -1 drain one; reason: why (logs and events)."""

    role: str
    delta: int
    reason: str


@dataclass
class Planner:
    """Call :meth:`decide` once per report interval with both roles' observations."""

    config: PlannerConfig
    #: per role, the utilizations of the quiet intervals in a row so far
    _quiet: dict[str, list[float]] = field(default_factory=lambda: {r: [] for r in ROLES})

    def decide(self, prefill: RoleObservation, decode: RoleObservation) -> list[Decision]:
        """The changes to make now (an empty list: keep both roles as they are)."""
        out = []
        for role, obs in (("prefill", prefill), ("decode", decode)):
            decision = self._decide(role, obs)
            if decision is not None:
                out.append(decision)
        return out

    def _decide(self, role: str, obs: RoleObservation) -> Decision | None:
        bounds = self.config.range.of(role)
        breach = self._breach(role, obs)
        quiet = self._quiet[role]
        if breach is not None:
            quiet.clear()
            room = bounds.maximum - obs.instances - obs.starting
            if room > 0 and obs.starting == 0:
                return Decision(role, min(room, max(1, self._needed(role, obs) - obs.instances)),
                                breach)
            return None
        if obs.instances + obs.starting < bounds.minimum:
            return Decision(role, +1, f"below the minimum of {bounds.minimum}")
        if not self._quiet_interval(role, obs):
            quiet.clear()
            return None
        quiet.append(obs.utilization)
        del quiet[:-self.config.quiet_intervals]
        if (len(quiet) == self.config.quiet_intervals and obs.instances > bounds.minimum
                and obs.starting == 0 and obs.draining == 0 and self._fewer_carry(role, obs)):
            quiet.clear()
            return Decision(role, -1, f"{self.config.quiet_intervals} quiet intervals; "
                            f"{obs.instances - 1} instance(s) carry the load")
        return None

    def _breach(self, role: str, obs: RoleObservation) -> str | None:
        slo, cfg = self.config.slo, self.config
        if role == "prefill":
            if obs.latency_s is not None and obs.latency_s > slo.ttft_s:
                return f"p90 TTFT {obs.latency_s:.2f} s > SLO {slo.ttft_s:g} s"
            if obs.queue_s > slo.ttft_s:
                return f"prefill queue {obs.queue_s:.2f} s > TTFT SLO {slo.ttft_s:g} s"
            if obs.utilization > 1.0:
                return f"offered load {obs.utilization:.0%} of the instances' capacity"
            return None
        if obs.latency_s is not None and obs.latency_s > slo.tbt_s:
            return f"p90 TBT {obs.latency_s * 1e3:.1f} ms > SLO {slo.tbt_s * 1e3:g} ms"
        if obs.utilization > cfg.kv_high:
            return f"KV usage {obs.utilization:.0%} > {cfg.kv_high:.0%}"
        if obs.waiting > 0:
            return f"{obs.waiting} sequence(s) wait for KV room"
        return None

    def _needed(self, role: str, obs: RoleObservation) -> int:
        """Instances that carry the interval's load at the target utilization (`busy_high`
        offered load for prefill, `kv_target` KV usage for decode): a scale-up's size."""
        target = self.config.busy_high if role == "prefill" else self.config.kv_target
        return math.ceil(obs.instances * obs.utilization / target)

    def _quiet_interval(self, role: str, obs: RoleObservation) -> bool:
        """Latency well within the SLO (and, for decode, no sequence waiting)."""
        cfg = self.config
        limit = cfg.down_fraction * (cfg.slo.ttft_s if role == "prefill" else cfg.slo.tbt_s)
        return (obs.latency_s is None or obs.latency_s < limit) and obs.waiting == 0

    def _fewer_carry(self, role: str, obs: RoleObservation) -> bool:
        """Whether one instance fewer carries the quiet intervals' load within the margin:
        prefill, their mean offered load (a rate: bursts average out); decode, their largest
        KV usage (a level that sequences hold)."""
        if obs.instances <= 1:
            return False
        spread, quiet = obs.instances / (obs.instances - 1), self._quiet[role]
        if role == "prefill":
            return sum(quiet) / len(quiet) * spread < self.config.busy_low
        return max(quiet) * spread < self.config.kv_low


def p90(values: list[float]) -> float | None:
    """The 90th percentile (nearest rank) of `values`, None for none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]
