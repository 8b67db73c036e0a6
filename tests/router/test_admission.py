"""Admission control and the decode forecast (router.admission, router.policies.forecast)."""

from __future__ import annotations

import pytest

from pdcluster.router.admission import (SLO, decode_rejection, make_admission, ttft_rejection)
from pdcluster.router.cost_model import MOONCAKE_70B
from pdcluster.router.policies.base import (DecodeLoad, DecodePlan, PrefillCandidate, PrefillPlan,
                                            RouteContext)
from pdcluster.router.policies.forecast import DecodeForecast

SLO_ = SLO(ttft_s=30.0, tbt_s=0.1)


def test_ttft_rejection_says_when_to_retry():
    assert ttft_rejection(PrefillPlan("p0", 0, 0, 1.0, 29.0), SLO_) is None
    rej = ttft_rejection(PrefillPlan("p0", 0, 0, 1.0, 42.5), SLO_)
    assert rej.reason == "ttft_slo" and rej.retry_after_s == 13


def test_decode_rejection_by_kv_room_and_step_time():
    roomy = DecodeLoad("d0", 10, 100_000, capacity_tokens=1_000_000)
    assert decode_rejection(MOONCAKE_70B, roomy, 12_000, SLO_) is None
    full = DecodeLoad("d0", 10, 995_000, capacity_tokens=1_000_000)
    assert decode_rejection(MOONCAKE_70B, full, 12_000, SLO_).reason == "decode_kv_full"
    slow = DecodeLoad("d0", 300, 3_100_000)  # 12.5 ms + 2.9e-8 s × 3.1 M > 100 ms
    assert decode_rejection(MOONCAKE_70B, slow, 1000, SLO_).reason == "tbt_slo"


def _ctx(decodes):
    return RouteContext("r", 12_000, 512, 0, (PrefillCandidate("p0", None, 0.0),),
                        tuple(decodes), MOONCAKE_70B, now=100.0)


def test_arrival_checks_load_now_and_prediction_the_load_at_join():
    now_load = DecodeLoad("d0", 5, 60_000, capacity_tokens=100_000)
    at_join = DecodeLoad("d0", 9, 95_000, capacity_tokens=100_000)
    prefill, decode = PrefillPlan("p0", 0, 0, 2.0, 2.0), DecodePlan("d0", 0.02)
    c, j = _ctx([now_load]), _ctx([at_join])
    assert make_admission("none", SLO_).check(c, j, prefill, decode) is None
    assert make_admission("arrival", SLO_).check(c, j, prefill, decode) is None
    assert make_admission("prediction", SLO_).check(c, j, prefill, decode).reason == \
        "decode_kv_full"
    late = PrefillPlan("p0", 0, 0, 2.0, 31.0)
    assert make_admission("arrival", SLO_).check(c, j, late, decode).reason == "ttft_slo"
    with pytest.raises(ValueError):
        make_admission("magic", SLO_)


def test_forecast_adds_pending_joins_and_removes_confident_departures():
    f = DecodeForecast(MOONCAKE_70B)
    for _ in range(200):
        f.durations.add(10.0)  # every sequence decodes for 10 s
    f.add("old", "d0", join_at=0.0, tokens=8000)
    f.joined("old", at=0.0)
    f.add("young", "d0", join_at=95.0, tokens=8000)
    f.joined("young", at=95.0)
    f.add("next", "d0", join_at=101.0, tokens=5000)
    f.add("other", "d1", join_at=101.0, tokens=7000)
    load = DecodeLoad("d0", 2, 16_000)
    # at 102: "old" (age 100 s, past every observed duration) has left, "young" (age 5 s)
    # stays and grows, "next" has joined
    predicted = f.load_at(load, now=100.0, at=102.0)
    assert predicted.batch_size == 2
    step = MOONCAKE_70B.t_step(2, 16_000)
    assert predicted.context_tokens == 16_000 - 8000 + 5000 + int(2.0 / step)
    f.discard("next")
    assert f.load_at(load, 100.0, 102.0).context_tokens == 8000 + int(2.0 / step)
    f.finished("young", 10.0)
    assert f.load_at(load, 100.0, 100.0).context_tokens == 16_000


def test_forecast_of_several_instances_keeps_each_ones_sequences_apart():
    """loads_at over three instances: each one's departures and joins are its own."""
    f = DecodeForecast(MOONCAKE_70B)
    for _ in range(200):
        f.durations.add(10.0)  # every sequence decodes for 10 s
    for rid, decode, started, tokens in (("a", "d0", 0.0, 3000), ("b", "d0", 95.0, 4000),
                                         ("c", "d2", 0.0, 6000), ("d", "d2", 91.0, 500)):
        f.add(rid, decode, started, tokens)
        f.joined(rid, started)
    f.add("e", "d1", join_at=101.0, tokens=7000)
    loads = (DecodeLoad("d0", 2, 7000), DecodeLoad("d1", 0, 0), DecodeLoad("d2", 2, 6500))
    d0, d1, d2 = f.loads_at(loads, now=100.0, at=102.0)
    # by 102: "a" and "c" (age 100 s) have left, and "d" (its 10 s are up at 101); "b" (age
    # 5 s) stays and grows; "e" has joined d1
    assert (d0.batch_size, d0.context_tokens) == (1, 4000 + int(2.0 / MOONCAKE_70B.t_step(2, 7000)))
    assert (d1.batch_size, d1.context_tokens) == (1, 7000)
    assert (d2.batch_size, d2.context_tokens) == (0, 0)
    assert [f.load_at(load, 100.0, 102.0) for load in loads] == [d0, d1, d2]


def test_forecast_checks_later_joins_too():
    """A request joining at t=1 must still fit when one routed earlier joins at t=5."""
    f = DecodeForecast(MOONCAKE_70B)
    f.add("first", "d0", join_at=5.0, tokens=40_000)
    load = DecodeLoad("d0", 0, 0)
    assert f.load_at(load, now=0.0, at=1.0).context_tokens == 40_000


def test_forecast_without_observations_uses_a_uniform_decode_time():
    f = DecodeForecast(MOONCAKE_70B, expected_output_tokens=100)  # 100 × 12.5 ms = 1.25 s
    f.add("a", "d0", 0.0, 1000)
    f.joined("a", 0.0)
    load = DecodeLoad("d0", 1, 1000)
    assert f.load_at(load, 1.0, 1.1).batch_size == 1
    assert f.load_at(load, 1.0, 1.3).batch_size == 0


def test_live_expiry_moves_late_pending_into_running():
    f = DecodeForecast(MOONCAKE_70B, grace_s=1.0)
    f.add("a", "d0", join_at=0.0, tokens=1000)
    f.expire(now=5.0)
    assert f.load_at(DecodeLoad("d0"), 5.0, 5.0).context_tokens == 0  # no pending left
