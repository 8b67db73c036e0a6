"""The SLO planner's decisions (router.planner), on hand-made interval observations."""

from __future__ import annotations

import pytest

from pdcluster.router.admission import SLO
from pdcluster.router.planner import AutoscaleRange, Planner, PlannerConfig, RoleObservation, p90

SLO_ = SLO(ttft_s=2.0, tbt_s=0.05)
RANGE = AutoscaleRange.parse("prefill=1:4,decode=1:3")


def planner(**kw) -> Planner:
    return Planner(PlannerConfig(SLO_, RANGE, **kw))


def calm(n: int = 2) -> RoleObservation:
    return RoleObservation(n, latency_s=0.001, utilization=0.05)


@pytest.mark.parametrize("text, message", [
    ("prefill=1:2", "missing decode"),
    ("prefill=0:2,decode=1:1", "1 <= MIN <= MAX"),
    ("prefill=3:2,decode=1:1", "1 <= MIN <= MAX"),
    ("prefill=1-2,decode=1:1", "is not ROLE=MIN:MAX"),
    ("encode=1:2,decode=1:1", "is not ROLE=MIN:MAX"),
])
def test_a_bad_range_is_refused_with_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        AutoscaleRange.parse(text)


def test_the_range_reads_back_as_written():
    assert str(AutoscaleRange.parse(" decode=2:5 , prefill=1:3")) == "prefill=1:3,decode=2:5"


def test_a_ttft_breach_adds_what_the_offered_load_needs_within_the_maximum():
    # 1 instance offered 250 % of its capacity: 0.8 busy each needs ceil(2.5 / 0.8) = 4
    out = planner().decide(RoleObservation(1, latency_s=3.0, utilization=2.5),
                           RoleObservation(1, latency_s=0.01))
    assert [(d.role, d.delta) for d in out] == [("prefill", 3)]
    assert "TTFT 3.00 s > SLO 2 s" in out[0].reason
    # at 3 of 4 the same load adds the one left
    out = planner().decide(RoleObservation(3, latency_s=3.0, utilization=2.5), calm(1))
    assert [(d.role, d.delta) for d in out] == [("prefill", 1)]


@pytest.mark.parametrize("obs, reason", [
    (RoleObservation(2, latency_s=0.06), "TBT 60.0 ms > SLO 50 ms"),
    (RoleObservation(2, latency_s=0.01, utilization=0.95), "KV usage 95% > 90%"),
    (RoleObservation(2, latency_s=0.01, utilization=0.5, waiting=3), "3 sequence(s) wait"),
])
def test_decode_scales_up_on_tbt_kv_usage_or_waiting_sequences(obs, reason):
    out = planner().decide(calm(1), obs)
    assert [d.role for d in out] == ["decode"] and out[0].delta >= 1
    assert reason in out[0].reason


def test_a_growing_queue_adds_before_ttft_breaches():
    queue = planner().decide(RoleObservation(2, latency_s=0.5, queue_s=2.5), calm(1))
    offered = planner().decide(RoleObservation(2, latency_s=0.5, utilization=1.2), calm(1))
    assert [d.role for d in queue + offered] == ["prefill", "prefill"]
    assert "queue 2.50 s" in queue[0].reason and "offered load 120%" in offered[0].reason


def test_no_second_scale_up_while_one_is_starting_nor_past_the_maximum():
    breach = {"latency_s": 5.0, "utilization": 3.0}
    p = planner()
    assert p.decide(RoleObservation(2, starting=1, **breach), calm(1)) == []
    assert p.decide(RoleObservation(4, **breach), calm(1)) == []


def test_scale_down_only_after_the_quiet_intervals_and_never_below_the_minimum():
    p = planner(quiet_intervals=3)
    for _ in range(2):
        assert p.decide(calm(3), calm(1)) == []
    out = p.decide(calm(3), calm(1))
    assert [(d.role, d.delta) for d in out] == [("prefill", -1)]
    # the count restarts after a scale-down, and one breach restarts it too
    assert p.decide(calm(2), calm(1)) == []
    p.decide(RoleObservation(2, latency_s=1.5, utilization=0.2), calm(1))  # not quiet
    assert p.decide(calm(2), calm(1)) == [] and p.decide(calm(2), calm(1)) == []
    assert [d.delta for d in p.decide(calm(2), calm(1))] == [-1]
    # at the minimum, quiet for ever changes nothing
    assert all(p.decide(calm(1), calm(1)) == [] for _ in range(10))


def test_load_that_one_instance_fewer_could_not_carry_is_not_quiet():
    p = planner(quiet_intervals=1)
    # 2 at 40 % busy -> 80 % on one: over busy_low (0.6)
    assert p.decide(RoleObservation(2, latency_s=0.1, utilization=0.4), calm(1)) == []
    # decode: mean KV 40 % on 2 -> 80 % on one, over kv_low (0.6)
    assert p.decide(calm(1), RoleObservation(2, latency_s=0.001, utilization=0.4)) == []
    # a drain in progress holds the next one
    assert p.decide(RoleObservation(3, latency_s=0.001, draining=1), calm(1)) == []


def test_below_the_minimum_adds_without_a_breach():
    p = Planner(PlannerConfig(SLO_, AutoscaleRange.parse("prefill=2:4,decode=1:3")))
    assert [(d.role, d.delta) for d in p.decide(calm(1), calm(1))] == [("prefill", 1)]


def test_p90_is_the_nearest_rank():
    assert p90([]) is None
    assert p90([3.0]) == 3.0
    assert p90([float(i) for i in range(1, 11)]) == 9.0
    assert p90([float(i) for i in range(1, 12)]) == 10.0
