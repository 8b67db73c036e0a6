"""The Conductor's LoadSource in a live cluster: its own ledger plus the workers' load reports.

What several gateways share: a prefill worker's queue holds every gateway's requests, so each
Conductor takes the later of its own prediction and the worker's reported prompt tokens still
to compute plus what every gateway routed there since (router.decision_board); decode loads
are the workers' own counts.

Prefill queues are predicted, as Mooncake's Conductor predicts them: every routed request adds
its predicted execution time to its instance's FIFO (`busy_until`). When the pipeline reports
that a prefill ended (`Conductor.prefill_done`), the entry leaves, the measured duration
calibrates a scale on the cost model and the queue is re-predicted from now; with no report an
entry simply expires at its predicted end. A guard factor learned from measured TTFTs widens
predictions when service times are noisy (see LedgerLoads). Decode loads come from the
workers' `stats()` (running + waiting sequences, KV blocks used / total), polled by
`StatsPoller` with the prefill workers' pending prompt tokens; it also learns each instance's
node from `info()`.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable

from pdcluster.engine.core.stats import SchedulerStats
from pdcluster.router.cost_model import CostModel
from pdcluster.router.load_source import LoadSource, RouteDecision
from pdcluster.router.policies.base import DecodeLoad
from pdcluster.router.registry import InstanceRegistry

log = logging.getLogger(__name__)

_SCALE_BOUNDS = (0.05, 20.0)
_FORGET_AFTER_S = 120.0
_ERROR_WINDOW = 64
_GUARD_QUANTILE = 1.0


@dataclass
class _Entry:
    instance_id: str
    routed_at: float
    exec_s: float  # cost-model prediction, unscaled
    ttft_s: float  # predicted at routing with the scale, without the guard


class LedgerLoads(LoadSource):
    """Prefill queues from this Conductor's own decisions; decode loads from reports.

    `scale` (EWMA of measured / predicted prefill service time, over all instances: they run
    the same engine, and a per-instance factor would make unmeasured instances look faster)
    calibrates the cost model; `guard` (>= 1: the largest measured / predicted TTFT of the
    last `_ERROR_WINDOW` prefills) widens every prediction when service times are noisy (CPU
    contention, out-of-order service), so SLO admission errs on the safe side. Both multiply
    the queue (`prefill_queue_s`) and the execution estimate (`exec_scale`). Thread-safe.
    `clock`: monotonic seconds (injectable for tests).
    """

    def __init__(self, cost: CostModel, block_size: int = 16,
                 clock: Callable[[], float] = time.monotonic, calibration_weight: float = 0.3
                 ) -> None:
        self.cost = cost
        self.block_size = block_size
        self._clock = clock
        self._weight = calibration_weight
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._busy_until: dict[str, float] = {}  # unguarded
        self._last_done: dict[str, float] = {}
        self.scale = 1.0
        self._ratios: deque[float] = deque(maxlen=_ERROR_WINDOW)
        self.guard = 1.0
        self._decode: dict[str, DecodeLoad] = {}
        self._reported_prefill_s: dict[str, float] = {}
        self._reported_at: dict[str, float] = {}
        self._peers: dict[str, deque[tuple[float, float]]] = {}  # other gateways' routes
        #: called with (instance, uncalibrated exec_s) of every route (the decision board)
        self.publish: Callable[[str, float], None] | None = None
        self._nodes: dict[str, str] = {}

    def now(self) -> float:
        return self._clock()

    def node_of(self, instance_id: str) -> str | None:
        return self._nodes.get(instance_id)

    def set_node(self, instance_id: str, node_id: str) -> None:
        self._nodes[instance_id] = node_id

    def prefill_queue_s(self, instance_id: str) -> float:
        """The later of this Conductor's own prediction and the shared view: what the worker
        last reported it has still to compute (every gateway's requests), less the time
        since, plus what this and the other gateways (router.decision_board) routed there
        since that report. A gateway just (re)started sees the others' load at once."""
        with self._lock:
            now = self._clock()
            own = self._busy_until.get(instance_id, 0.0) - now
            at = self._reported_at.get(instance_id)
            peers = self._peers.get(instance_id, ())
            if at is None:  # no report yet: others' routes drain by their prediction
                pending = sum(max(0.0, s * self.scale - (now - t)) for t, s in peers)
                return max(0.0, own, pending) * self.guard
            reported = max(0.0, self._reported_prefill_s.get(instance_id, 0.0) - (now - at))
            since = sum(e.exec_s for e in self._entries.values()
                        if e.instance_id == instance_id and e.routed_at >= at)
            since += sum(s for t, s in peers if t >= at)
            return max(0.0, own, reported + since * self.scale) * self.guard

    def report_prefill(self, instance_id: str, stats: SchedulerStats,
                       asked_at: float | None = None) -> None:
        """A prefill worker's stats(): num_pending_prompt_tokens, its queue in tokens, as
        seconds by the calibrated cost model. `asked_at` (this clock; default now): when the
        stats were asked for. The report is taken as of then: a route seen later may not have
        reached the worker when it answered, so it keeps counting (at worst twice, never
        not at all; under load the answer can come long after the question)."""
        tokens = stats.num_pending_prompt_tokens
        with self._lock:
            at = self._clock() if asked_at is None else asked_at
            self._reported_prefill_s[instance_id] = (
                self.cost.t_prefill(tokens) * self.scale if tokens else 0.0)
            self._reported_at[instance_id] = at
            peers = self._peers.get(instance_id)
            while peers and peers[0][0] < at:  # in the report
                peers.popleft()

    def add_peer_decision(self, instance_id: str, exec_s: float) -> None:
        """Another gateway routed a request to `instance_id` (router.decision_board), with
        `exec_s` predicted prefill seconds (uncalibrated)."""
        with self._lock:
            peers = self._peers.setdefault(instance_id, deque())
            now = self._clock()
            peers.append((now, exec_s))
            while peers and now - peers[0][0] > _FORGET_AFTER_S:
                peers.popleft()

    def exec_scale(self, instance_id: str) -> float:
        return self.scale * self.guard

    def decode_load(self, instance_id: str) -> DecodeLoad:
        return self._decode.get(instance_id) or DecodeLoad(instance_id)

    def report_decode(self, instance_id: str, stats: SchedulerStats) -> None:
        """A decode worker's stats(): num_active, num_waiting, num_used_blocks, num_blocks."""
        self._decode[instance_id] = DecodeLoad(
            instance_id, stats.num_active + stats.num_waiting,
            stats.num_used_blocks * self.block_size, stats.num_blocks * self.block_size)

    def on_routed(self, decision: RouteDecision) -> None:
        p = decision.prefill.instance_id
        with self._lock:
            now = self._clock()
            raw = decision.prefill.exec_s / (self.scale * self.guard)
            start = max(now, self._busy_until.get(p, 0.0))
            self._busy_until[p] = start + raw * self.scale
            self._entries[decision.request_id] = _Entry(p, now, raw, self._busy_until[p] - now)
            self._forget(now)
        if self.publish is not None and not decision.local:
            self.publish(p, raw)

    def on_prefill_done(self, request_id: str, ok: bool = True) -> None:
        with self._lock:
            entry = self._entries.pop(request_id, None)
            if entry is None:
                return
            p, now = entry.instance_id, self._clock()
            began = max(entry.routed_at, self._last_done.get(p, 0.0))
            self._last_done[p] = now
            if ok and entry.exec_s > 0:
                # one prefill at a time: it began at the later of its routing and the previous
                # end (a serial server's service time)
                ratio = min(max((now - began) / entry.exec_s, _SCALE_BOUNDS[0]), _SCALE_BOUNDS[1])
                self.scale = (1 - self._weight) * self.scale + self._weight * ratio
                self._ratios.append((now - entry.routed_at) / max(entry.ttft_s, 1e-6))
                ranked = sorted(self._ratios)
                self.guard = min(max(1.0, ranked[int(_GUARD_QUANTILE * (len(ranked) - 1))]),
                                 _SCALE_BOUNDS[1])
            pending = sum(e.exec_s for e in self._entries.values() if e.instance_id == p)
            self._busy_until[p] = now + pending * self.scale

    def _forget(self, now: float) -> None:
        while self._entries:
            rid, entry = next(iter(self._entries.items()))
            if now - entry.routed_at < _FORGET_AFTER_S:
                break
            del self._entries[rid]


class StatsPoller:
    """Polls decode workers' stats() into a LedgerLoads every `interval_s`, and every worker's
    info() once for its node id. A daemon thread; `stop()` ends it."""

    def __init__(self, registry: InstanceRegistry, loads: LedgerLoads,
                 interval_s: float = 0.25, timeout_s: float = 2.0, board=None) -> None:
        """`board`: a router.decision_board.DecisionBoard feeding `loads`, started and
        stopped with the poller."""
        self.registry = registry
        self.loads = loads
        self.board = board
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="conductor-stats", daemon=True)

    def start(self) -> StatsPoller:
        self._thread.start()
        if self.board is not None:
            self.board.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self.board is not None:
            self.board.stop()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def poll_once(self) -> None:
        import ray

        for inst in self.registry.by_role("prefill") + self.registry.by_role("decode"):
            if self.loads.node_of(inst.worker_id) is None:
                try:
                    info = ray.get(inst.handle.info.remote(), timeout=self.timeout_s)
                    self.loads.set_node(inst.worker_id, info["node_id"])
                except Exception as exc:  # noqa: BLE001 — retried next round
                    log.debug("no info from %s: %s", inst.worker_id, exc)
        asked_at = self.loads.now()
        reports = [(inst, functools.partial(self.loads.report_prefill, asked_at=asked_at),
                    inst.handle.stats.remote()) for inst in self.registry.by_role("prefill")]
        reports += [(inst, self.loads.report_decode, inst.handle.stats.remote())
                    for inst in self.registry.by_role("decode")]
        for inst, report, ref in reports:
            try:
                report(inst.worker_id, ray.get(ref, timeout=self.timeout_s))
            except Exception as exc:  # noqa: BLE001 — a dead or slow worker keeps its last report
                log.debug("no stats from %s: %s", inst.worker_id, exc)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll_once()
