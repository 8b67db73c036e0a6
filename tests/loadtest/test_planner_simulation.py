"""The SLO planner in the simulator (loadtest.simulator.autoscale) and `pdcluster plan`
(loadtest.simulator.plan) on Mooncake's conversation trace."""

from __future__ import annotations

import json

import pytest

from pdcluster.loadtest.simulator.engine import SimConfig, Simulation
from pdcluster.loadtest.simulator.plan import main as plan_main
from pdcluster.loadtest.simulator.results import summarize
from pdcluster.loadtest.simulator.workload import SimRequest, load_requests, vary_rate
from pdcluster.router.admission import SLO
from pdcluster.router.cost_model import MOONCAKE_70B
from pdcluster.router.planner import AutoscaleRange
from tests.loadtest.test_simulator import TRACE, needs_trace


def test_vary_rate_doubles_the_middle_third():
    requests = [SimRequest(f"r{i}", float(i), 1, 1, ()) for i in range(31)]  # 0..30 s
    warped = [r.arrival_s for r in vary_rate(requests, [1, 2, 1])]
    assert warped[:11] == pytest.approx([float(i) for i in range(11)])
    assert warped[10:21] == pytest.approx([10 + 0.5 * i for i in range(11)])
    assert warped[20:] == pytest.approx([15.0 + i for i in range(11)])
    with pytest.raises(ValueError, match="> 0"):
        vary_rate(requests, [1, 0])


def test_a_static_cluster_counts_every_instance_for_the_whole_run():
    requests = [SimRequest(f"r{i}", 2.0 * i, 600, 20, ()) for i in range(10)]
    sim = Simulation(SimConfig(MOONCAKE_70B, 3, 2, slo=SLO(30, 0.1)), requests).run()
    summary = summarize(sim, include_samples=False)
    assert summary["instance_hours"] == pytest.approx({"prefill": 3 * sim.end_s / 3600,
                                                      "decode": 2 * sim.end_s / 3600})
    assert summary["instance_hours_per_1k"] == pytest.approx(5 * sim.end_s / 3600 * 100)


@needs_trace
def test_the_planner_beats_any_static_cluster_of_its_peak_size_on_a_doubling_rate():
    """6,000 requests at --time-scale 0.6, their rate doubled over the middle third. Every
    static cluster of the planner's peak size (16 + 4) runs 20 instances for at least the
    arrivals' span, so n / (20 x span) bounds its good requests per instance-hour."""
    requests = vary_rate(load_requests(TRACE, 0.6, 0, 6000), [1, 2, 1])
    span_h = (requests[-1].arrival_s - requests[0].arrival_s) / 3600
    sim = Simulation(SimConfig(MOONCAKE_70B, 8, 2, slo=SLO(30, 0.1),
                               autoscale=AutoscaleRange.parse("prefill=1:16,decode=1:4")),
                     requests).run()
    summary = summarize(sim, include_samples=False)
    static_bound = len(requests) / (20 * span_h)
    assert summary["goodput_per_instance_hour"] > 1.1 * static_bound
    assert summary["slo_attainment"] > 0.97
    decisions = summary["autoscale"]["decisions"]
    assert {(d["role"], d["delta"]) for d in decisions} >= {("prefill", 1), ("prefill", -1)}
    # never past the range, never below it
    serving = {"prefill": 8, "decode": 2}
    for d in decisions:
        serving[d["role"]] += d["delta"]
        assert 1 <= serving["prefill"] <= 16 and 1 <= serving["decode"] <= 4


@needs_trace
def test_plan_prints_the_cheapest_shape_that_meets_the_slos_and_why_the_next_fails(
        tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert plan_main(["--trace", str(TRACE), "--num-requests", "2000", "--time-scale", "0.6",
                      "--slo-ttft-s", "30", "--slo-tbt-ms", "100", "--target-attainment",
                      "0.99", "--max-prefill", "12", "--max-decode", "4",
                      "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    plan, cheaper = result["plan"], result["next_cheaper"]
    assert plan["attainment"] >= 0.99 and cheaper["attainment"] < 0.99
    assert cheaper["gpu_hours_per_1k"] < plan["gpu_hours_per_1k"]
    assert (plan["prefill"] + plan["decode"]) - (cheaper["prefill"] + cheaper["decode"]) == 1
    # every shape with fewer instances that was simulated missed the target
    fewer = [r for r in result["runs"] if r["prefill"] + r["decode"]
             < plan["prefill"] + plan["decode"]]
    assert fewer and all(r["attainment"] < 0.99 for r in fewer)
    assert f"plan: {plan['shape']}" in printed and "next cheaper" in printed
    assert "fails: " in printed.split("next cheaper")[1]
