"""`--autoscale`: the SLO planner (router.planner) as a control loop over a running cluster.

Every `autoscale_interval_s` (the report interval) it measures what the planner needs:
prefill, the p90 TTFT of the first tokens this gateway sent in the interval
(GatewayMetrics.recent), the largest queue wait (the Conductor's prediction, or the
worker's pending prompt tokens at the rate its `busy_s_total` and
`num_prefill_tokens_total` say it computes them) and the offered load ((busy seconds + queue
growth) / (interval × instances)); decode, the larger of the p90 TPOT of the requests that
ended in it and the workers' mean step time (busy seconds / steps), the mean KV usage and
the sequences waiting. The workers' own figures hold the whole cluster's load, whatever share
of it this gateway routes. Then it applies the planner's decisions:

- scale-up: `Cluster.add_instance` starts the worker (a thread per instance, so the loop
  goes on) and routes to it once its model answers; on KubeRay a worker that fits no pod is
  pending until Ray's autoscaler adds one (deploy/k8s enables it);
- scale-down drains: no gateway routes to the instance any more (`Cluster.drain_instance`:
  this gateway's registry, and a detached cluster's record, which every gateway follows:
  deploy.membership); once it holds nothing (no request of this gateway routed to it, none
  active, waiting or being sent in its stats; in a detached cluster also not before the
  other gateways have read the drain and what they routed before has arrived)
  `Cluster.retire_instance` stops it. No request fails: what it runs finishes where it is.

In a detached cluster any number of gateways may run it (deploy/k8s gives every gateway
replica `autoscale`); one acts, holding a lease in the cluster record that it renews every
round (ClusterRecord.scaler_lease), and another takes over, drains in progress included,
within LEASE_INTERVALS rounds of its death. Its TTFT and TBT are what its own requests
measured; behind a load balancer that spreads requests, a fair sample.

The last events (add, ready, drain, stopped, failed) and rounds' observations are in /health
under "autoscale".
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from dataclasses import asdict

import ray

from pdcluster.deploy.cluster_record import read_record, record_actor
from pdcluster.deploy.launcher import Cluster
from pdcluster.deploy.membership import REFRESH_S
from pdcluster.engine.core.stats import SchedulerStats
from pdcluster.router.admission import SLO
from pdcluster.router.metrics import GatewayMetrics
from pdcluster.router.planner import Decision, Planner, PlannerConfig, RoleObservation, p90

log = logging.getLogger(__name__)

#: how many recent events /health lists
EVENT_HISTORY = 64
#: a scaling gateway's lease on a detached cluster lasts this many intervals
LEASE_INTERVALS = 3
STATS_TIMEOUT_S = 5.0


class Autoscaler:
    def __init__(self, cluster: Cluster, metrics: GatewayMetrics,
                 planner: PlannerConfig | None = None) -> None:
        cfg = cluster.config
        self.cluster, self.metrics = cluster, metrics
        self.interval_s = cfg.autoscale_interval_s
        self.planner = Planner(planner or PlannerConfig(
            SLO(cfg.slo_ttft_s, cfg.slo_tbt_ms / 1000), cfg.autoscale_range()))
        self.events: deque[dict] = deque(maxlen=EVENT_HISTORY)
        self.observations: deque[dict] = deque(maxlen=EVENT_HISTORY)  # one per round
        self._lock = threading.Lock()
        self._starting = {"prefill": 0, "decode": 0}
        self._draining: dict[str, str] = {}  # worker id -> role
        self._drained_at: dict[str, float] = {}
        # a detached cluster's other gateways see a drain at their next read of the record;
        # what they routed there before it reaches the worker within its TTFT
        self.drain_grace_s = (2 * REFRESH_S + cfg.slo_ttft_s) if cluster.detached else 0.0
        self._counters: dict[str, tuple] = {}  # worker -> its stats' counters, last round
        self._prefill_rate: dict[str, float] = {}  # prefill worker -> prompt tokens a busy s
        self._backlog = 0.0
        self._last = time.monotonic()
        self.holder = f"{socket.gethostname()}:{os.getpid()}"
        self._leading = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autoscaler", daemon=True)

    def start(self) -> Autoscaler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def state(self) -> dict:
        """What /health shows: the range, whether this gateway scales now (`_lead`), the
        instances starting and draining, the events
        and each round's observations (router.planner.RoleObservation per role)."""
        with self._lock:
            return {"range": str(self.planner.config.range), "leading": self._leading,
                    "starting": dict(self._starting), "draining": sorted(self._draining),
                    "events": list(self.events), "observations": list(self.observations)}

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception:  # the loop must outlive one bad round
                log.exception("autoscaler round failed")

    def _event(self, action: str, role: str, worker_id: str | None, reason: str) -> None:
        with self._lock:
            self.events.append({"at": time.time(), "action": action, "role": role,
                                "worker_id": worker_id, "reason": reason})
        log.info("autoscale: %s %s %s (%s)", action, role, worker_id or "", reason)

    def _stats(self) -> dict[str, SchedulerStats]:
        instances = self.cluster.prefill + self.cluster.decode
        refs = [(i.worker_id, i.handle.stats.remote()) for i in instances]
        out = {}
        for worker_id, ref in refs:
            try:
                out[worker_id] = ray.get(ref, timeout=STATS_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 -- left out this round
                log.debug("no stats from %s: %s", worker_id, exc)
        return out

    def _lead(self) -> bool:
        """Whether this gateway scales now: always for the workers it owns; in a detached
        cluster while it holds the record's lease (taking over the drains the record lists
        when it has just got it)."""
        if not self.cluster.detached:
            return True
        record = record_actor(self.cluster.config.ray_namespace)
        lead = ray.get(record.scaler_lease.remote(self.holder, LEASE_INTERVALS * self.interval_s),
                       timeout=self.interval_s)
        if lead and not self._leading:
            manifest = read_record(self.cluster.config.ray_namespace)
            with self._lock:
                for name in manifest.draining:
                    role = "prefill" if name in manifest.prefill else "decode"
                    self._draining.setdefault(name, role)
                    self._drained_at.setdefault(name, time.monotonic())
            self._event("lead", "-", None, "holds the cluster's scaler lease")
        self._leading = lead
        return lead

    def tick(self) -> None:
        """One round: measure, stop drained instances, apply the planner's decisions (only
        while this gateway leads: `_lead`)."""
        if not self._lead():
            self._last = time.monotonic()
            return
        stats = self._stats()
        self._stop_drained(stats)
        prefill, decode = self.observe(stats)
        with self._lock:
            self.observations.append({"at": time.time(), "prefill": asdict(prefill),
                                      "decode": asdict(decode)})
        for decision in self.planner.decide(prefill, decode):
            self._apply(decision, stats)

    def observe(self, stats: dict[str, SchedulerStats]
                ) -> tuple[RoleObservation, RoleObservation]:
        now = time.monotonic()
        span, since = max(now - self._last, 1e-9), self._last
        self._last = now
        ttfts, tpots = self.metrics.recent(since)
        registry, loads = self.cluster.registry, self.cluster.conductor.loads
        serving_p = [i.worker_id for i in registry.by_role("prefill")]
        serving_d = [i.worker_id for i in registry.by_role("decode")]
        moved = {}  # worker -> (busy s, prompt tokens computed, decode steps) in the interval
        for worker_id, st in stats.items():
            now_c = (st.busy_s_total, st.num_prefill_tokens_total, st.num_steps_total)
            before = self._counters.get(worker_id, now_c)
            moved[worker_id] = tuple(max(0, a - b) for a, b in zip(now_c, before))
            self._counters[worker_id] = now_c
        busy = 0.0
        queues = []
        for w in serving_p:
            d_busy, d_tokens, _ = moved.get(w, (0.0, 0, 0))
            busy += d_busy
            if d_busy > 0 and d_tokens > 0:
                self._prefill_rate[w] = d_tokens / d_busy
            # the Conductor's prediction, or the worker's own queue at the rate it computed
            # (a gateway that routes little has no calibrated prediction)
            own = (stats[w].num_pending_prompt_tokens / self._prefill_rate[w]
                   if w in self._prefill_rate and w in stats else 0.0)
            queues.append(max(loads.prefill_queue_s(w), own))
        offered = max(0.0, busy + sum(queues) - self._backlog)
        self._backlog = sum(queues)
        d_busy = sum(moved.get(w, (0.0, 0, 0))[0] for w in serving_d)
        d_steps = sum(moved.get(w, (0.0, 0, 0))[2] for w in serving_d)
        # what every running sequence waited between two tokens, as the workers measured it
        step_s = d_busy / d_steps if d_steps else None
        with self._lock:
            starting = dict(self._starting)
            draining = list(self._draining.values())
        prefill = RoleObservation(len(serving_p), p90(ttfts), max(queues, default=0.0),
                                  offered / (span * max(1, len(serving_p))),
                                  starting=starting["prefill"],
                                  draining=draining.count("prefill"))
        usage = [st.num_used_blocks / st.num_blocks
                 for w, st in stats.items() if w in serving_d and st.num_blocks]
        tbt = [x for x in (p90(tpots), step_s) if x is not None]
        decode = RoleObservation(len(serving_d), max(tbt) if tbt else None,
                                 utilization=sum(usage) / max(1, len(usage)),
                                 waiting=sum(stats[w].num_waiting
                                             for w in serving_d if w in stats),
                                 starting=starting["decode"],
                                 draining=draining.count("decode"))
        return prefill, decode

    def _apply(self, decision: Decision, stats: dict[str, SchedulerStats]) -> None:
        role = decision.role
        if decision.delta > 0:
            for _ in range(decision.delta):
                with self._lock:
                    self._starting[role] += 1
                self._event("add", role, None, decision.reason)
                threading.Thread(target=self._add, args=(role,), name=f"autoscale-{role}",
                                 daemon=True).start()
            return
        serving = self.cluster.registry.by_role(role)
        if len(serving) <= 1:
            return
        victim = min(serving, key=lambda i: (
            self.cluster.pipeline.holds(i.worker_id)
            + (stats[i.worker_id].num_active if i.worker_id in stats else 0), i.worker_id))
        self.cluster.drain_instance(victim.worker_id)
        with self._lock:
            self._draining[victim.worker_id] = role
            self._drained_at[victim.worker_id] = time.monotonic()
        self._event("drain", role, victim.worker_id, decision.reason)

    def _add(self, role: str) -> None:
        try:
            instance = self.cluster.add_instance(role)
            self._event("ready", role, instance.worker_id, "answers; routed to")
        except Exception as exc:  # noqa: BLE001 — reported; the planner may ask again
            self._event("failed", role, None, f"start failed: {exc}")
        finally:
            with self._lock:
                self._starting[role] -= 1

    def _stop_drained(self, stats: dict[str, SchedulerStats]) -> None:
        with self._lock:
            draining = dict(self._draining)
        for worker_id, role in draining.items():
            st = stats.get(worker_id)
            if st is None or self.cluster.pipeline.holds(worker_id) or \
                    st.num_active or st.num_waiting or st.num_sending or \
                    time.monotonic() - self._drained_at[worker_id] < self.drain_grace_s:
                continue
            self.cluster.retire_instance(worker_id)
            with self._lock:
                self._draining.pop(worker_id, None)
                self._drained_at.pop(worker_id, None)
            self._event("stopped", role, worker_id, "drained: held nothing")
