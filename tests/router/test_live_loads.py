"""The live LoadSource: the prefill ledger, calibration and decode load reports."""

from __future__ import annotations

import pytest

from pdcluster.engine.core.stats import SchedulerStats
from pdcluster.router.cost_model import MOONCAKE_70B
from pdcluster.router.load_source import RouteDecision
from pdcluster.router.policies.base import DecodePlan, PrefillPlan
from pdcluster.router.policies.live_loads import LedgerLoads


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def decision(rid: str, instance: str, exec_s: float, ttft_s: float = 0.0) -> RouteDecision:
    return RouteDecision(rid, PrefillPlan(instance, 0, 0, exec_s, ttft_s),
                         DecodePlan("d0", 0.01), 100, 0.0)


def test_queue_accumulates_and_drains_by_prediction():
    clock = Clock()
    loads = LedgerLoads(MOONCAKE_70B, clock=clock)
    loads.on_routed(decision("a", "p0", 1.0))
    loads.on_routed(decision("b", "p0", 2.0))
    assert loads.prefill_queue_s("p0") == pytest.approx(3.0)
    assert loads.prefill_queue_s("p1") == 0.0
    clock.t = 2.5
    assert loads.prefill_queue_s("p0") == pytest.approx(0.5)
    clock.t = 10.0
    assert loads.prefill_queue_s("p0") == 0.0


def test_reported_prefills_calibrate_the_scale_and_the_guard():
    clock = Clock()
    loads = LedgerLoads(MOONCAKE_70B, clock=clock, calibration_weight=1.0)
    loads.on_routed(decision("a", "p0", 1.0))
    loads.on_routed(decision("b", "p0", 1.0))
    clock.t = 2.0  # "a" took twice as long as predicted
    loads.on_prefill_done("a")
    assert loads.scale == pytest.approx(2.0)
    assert loads.guard == pytest.approx(2.0)  # measured 2 s for a predicted 1 s TTFT
    # "b" is still queued: its predicted 1 s × scale 2, widened by the guard
    assert loads.prefill_queue_s("p0") == pytest.approx(2.0 * 2.0)
    assert loads.exec_scale("p0") == pytest.approx(4.0)
    clock.t = 3.0
    loads.on_prefill_done("b", ok=False)  # a failure neither calibrates nor stays queued
    assert loads.scale == pytest.approx(2.0)
    assert loads.prefill_queue_s("p0") == 0.0
    loads.on_prefill_done("unknown")  # ignored


def test_decode_reports():
    loads = LedgerLoads(MOONCAKE_70B, block_size=16)
    assert loads.decode_load("d0").batch_size == 0
    loads.report_decode("d0", SchedulerStats("d0", 1, num_active=3, num_waiting=1,
                                             num_used_blocks=10, num_blocks=100))
    d = loads.decode_load("d0")
    assert (d.batch_size, d.context_tokens, d.capacity_tokens) == (4, 160, 1600)
    loads.set_node("p0", "node-a")
    assert loads.node_of("p0") == "node-a" and loads.node_of("p1") is None


def test_a_fresh_conductor_sees_the_queue_other_gateways_filled_from_the_worker_s_report():
    """A replica (or a gateway just restarted) has routed nothing itself; the prefill
    worker's report of the prompt tokens it still has to compute is its queue, by the cost
    model, and its own later decisions only lengthen it."""
    clock = Clock()
    other, fresh = LedgerLoads(MOONCAKE_70B, clock=clock), LedgerLoads(MOONCAKE_70B, clock=clock)
    other.on_routed(decision("a", "p0", MOONCAKE_70B.t_prefill(8000)))
    assert fresh.prefill_queue_s("p0") == 0.0
    fresh.report_prefill("p0", SchedulerStats("p0", 1, num_pending_prompt_tokens=8000))
    assert fresh.prefill_queue_s("p0") == pytest.approx(other.prefill_queue_s("p0"))
    assert fresh.prefill_queue_s("p1") == 0.0
    fresh.report_prefill("p0", SchedulerStats("p0", 1, num_pending_prompt_tokens=0))  # drained
    assert fresh.prefill_queue_s("p0") == 0.0
    fresh.on_routed(decision("b", "p0", 5.0))
    # b not yet at the worker
    fresh.report_prefill("p0", SchedulerStats("p0", 1, num_pending_prompt_tokens=100))
    reported = MOONCAKE_70B.t_prefill(100)
    assert fresh.prefill_queue_s("p0") == pytest.approx(reported + 5.0)
    clock.t = 1.0  # the report ages; b, routed since it, still counts whole
    assert fresh.prefill_queue_s("p0") == pytest.approx(max(0.0, reported - 1.0) + 5.0)


def test_the_other_gateways_routes_count_until_the_next_report():
    """router.decision_board: a peer's route lands on the queue at once, and is dropped once
    a report came after it (the report holds it)."""
    clock = Clock()
    loads = LedgerLoads(MOONCAKE_70B, clock=clock)
    loads.add_peer_decision("p0", 2.0)  # no report yet: it drains by its prediction
    assert loads.prefill_queue_s("p0") == pytest.approx(2.0)
    clock.t = 1.5
    assert loads.prefill_queue_s("p0") == pytest.approx(0.5)
    clock.t = 2.5
    assert loads.prefill_queue_s("p0") == 0.0
    loads.report_prefill("p0", SchedulerStats("p0", 1, num_pending_prompt_tokens=0))
    clock.t = 3.0
    loads.add_peer_decision("p0", 4.0)
    loads.add_peer_decision("p0", 1.0)
    assert loads.prefill_queue_s("p0") == pytest.approx(5.0)
    clock.t = 3.5
    # now in the report
    loads.report_prefill("p0", SchedulerStats("p0", 1, num_pending_prompt_tokens=8000))
    assert loads.prefill_queue_s("p0") == pytest.approx(MOONCAKE_70B.t_prefill(8000))


def test_a_report_holds_only_the_routes_seen_before_it_was_asked_for():
    """A route that reaches this gateway while a worker's stats are in flight may not have
    reached the worker when it answered: it keeps counting after the report."""
    clock = Clock()
    loads = LedgerLoads(MOONCAKE_70B, clock=clock)
    loads.add_peer_decision("p0", 1.0)  # before the question: in the report
    clock.t = 1.0
    asked_at = clock.t
    clock.t = 1.2
    loads.add_peer_decision("p0", 3.0)  # while the answer travels
    clock.t = 1.5
    loads.report_prefill("p0", SchedulerStats("p0", 1, num_pending_prompt_tokens=0), asked_at)
    assert loads.prefill_queue_s("p0") == pytest.approx(3.0)
    # stamped on arrival instead, the report would have dropped it
    loads.report_prefill("p0", SchedulerStats("p0", 1, num_pending_prompt_tokens=0))
    assert loads.prefill_queue_s("p0") == 0.0
