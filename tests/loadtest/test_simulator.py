"""`pdcluster simulate`: closed-form decode batching, simulated tiers over the real block pool
and index, and short runs of the whole simulation through its CLI."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pdcluster.kvstore.index import Location, MemoryIndex
from pdcluster.loadtest.simulator.cache import NodeCache
from pdcluster.loadtest.simulator.cli import main as simulate_main
from pdcluster.loadtest.simulator.decode import DecodeInstance
from pdcluster.loadtest.simulator.engine import SimConfig, Simulation
from pdcluster.loadtest.simulator.results import summarize
from pdcluster.loadtest.simulator.workload import load_requests, requests_from_records
from pdcluster.loadtest.trace import TraceRecord
from pdcluster.router.admission import SLO
from pdcluster.router.cost_model import MOONCAKE_70B

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake" / \
    "conversation_trace.jsonl"
needs_trace = pytest.mark.skipif(not TRACE.is_file(), reason="no Mooncake trace")


def reference_decode(cost, joins):
    """Step by step: joins = [(rid, arrive_s, ctx, steps)] -> {rid: (joined_at, finished_at)}."""
    t, running, out = 0.0, {}, {}
    pending = sorted(joins, key=lambda j: j[1])
    while pending or running:
        if not running and pending and pending[0][1] > t:
            t = pending[0][1]
        while pending and pending[0][1] <= t:
            rid, _, ctx, steps = pending.pop(0)
            running[rid] = [ctx, steps, t]
        t += cost.t_step(len(running), sum(c for c, _, _ in running.values()))
        for rid in list(running):
            running[rid][0] += 1
            running[rid][1] -= 1
            if running[rid][1] == 0:
                out[rid] = (running[rid][2], t)
                del running[rid]
    return out


def test_closed_form_decode_matches_stepping():
    rng = random.Random(3)
    joins = [(f"r{i}", rng.uniform(0, 3), rng.randrange(100, 20_000), rng.randrange(1, 80))
             for i in range(40)]
    got = {}
    d = DecodeInstance("d0", MOONCAKE_70B, None, lambda rid, a, b: got.__setitem__(rid, (a, b)))
    for rid, at, ctx, steps in sorted(joins, key=lambda j: j[1]):
        d.join(rid, ctx, steps, at)
    d.drain()
    want = reference_decode(MOONCAKE_70B, joins)
    assert got.keys() == want.keys()
    for rid in want:
        assert got[rid] == pytest.approx(want[rid], abs=1e-9)
    assert d.batch_size == 0 and d.context_tokens == 0


def test_decode_kv_capacity_refuses_or_queues():
    finished = []
    d = DecodeInstance("d0", MOONCAKE_70B, 1000, lambda rid, a, b: finished.append(rid))
    assert d.join("a", 800, 10, 0.0)
    assert not d.join("b", 300, 10, 0.0)
    assert d.join("b", 300, 10, 0.0, queue_when_full=True)
    assert d.load().batch_size == 2 and d.batch_size == 1
    d.drain()
    assert finished == ["a", "b"]


def test_node_cache_writes_through_demotes_and_publishes():
    index = MemoryIndex(clock=lambda: 0.0)
    index.heartbeat("n0", 1e9)
    cache = NodeCache("p0", "n0", index, device_blocks=2, host_blocks=3, ssd_blocks=4)
    keys = [bytes([i]) * 32 for i in range(5)]
    cache.store(keys[:3])  # G1 (2 blocks) keeps the leading two; G2 all three
    assert cache.local_prefix(keys) == (3, 2, {"device": 2, "host": 1})
    cache.store(keys[3:5])  # G2 evicts LRU tails first (keys 2, 1) and demotes them to G3
    n, device_run, by_tier = cache.local_prefix(keys)
    assert n == 5 and by_tier["ssd"] == 2 and device_run == 0
    held = index.lookup(keys)
    assert held[0] == [Location("n0", "host")]
    assert held[1] == [Location("n0", "ssd")]
    assert Location("n0", "device", "p0") in held[4] and Location("n0", "host") in held[4]


def small_run(policy="kvcache_centric", admission="none", n=400, **kw) -> dict:
    requests = load_requests(TRACE, 0.6, 0, n)
    config = SimConfig(MOONCAKE_70B, policy=policy, admission=admission,
                       slo=SLO(30.0, 0.1), **kw)
    return summarize(Simulation(config, requests).run())


@needs_trace
def test_a_short_run_completes_every_request_and_reports():
    s = small_run()
    assert s["completed"] == s["num_requests"] == 400 and s["rejected"] == 0
    assert 0 < s["mean_ttft_ms"] < s["p99_ttft_ms"]
    assert 0 < s["mean_tbt_ms"] < 100 and s["mean_e2e_ms"] > s["mean_ttft_ms"]
    assert 0 < s["hit_ratio"] <= 0.4 and set(s["hit_ratio_by_tier"]) <= {"host", "remote"}
    assert s["slo_attainment"] == pytest.approx(s["good"] / 400)
    assert len(s["hot_blocks"]) == 10 and s["hot_blocks"][0]["replicas"] == 8
    assert len(s["samples"]) > 5 and len(s["samples"][0]["prefill_queue_s"]) == 8
    assert sum(v["requests"] for v in s["per_instance"].values()) == 400


@needs_trace
def test_decode_bound_admission_rejects_and_counts_wasted_prefills():
    runs = {a: small_run(admission=a, decode_instances=1, decode_kv_tokens=60_000)
            for a in ("none", "arrival", "prediction")}
    assert runs["none"]["rejected"] == 0 and runs["none"]["wasted_prefills"] > 0
    for a in ("arrival", "prediction"):
        assert runs[a]["rejected"] > 0 and runs[a]["completed"] + runs[a]["rejected"] == 400
    assert runs["prediction"]["wasted_prefill_s"] < runs["arrival"]["wasted_prefill_s"]


def test_workload_keys_full_blocks_only():
    records = [TraceRecord(0, 0.0, 1100, 5, (7, 8, 9)), TraceRecord(1, 1000.0, 1024, 1, (7, 8))]
    a, b = requests_from_records(records, time_scale=0.5)
    assert len(a.keys) == 2 and len(b.keys) == 2 and a.keys == b.keys
    assert b.arrival_s == 0.5


@needs_trace
def test_cli_policy_all_writes_every_policy_and_plots(tmp_path):
    out = tmp_path / "sim.json"
    assert simulate_main(["--trace", str(TRACE), "--num-requests", "150", "--policy", "all",
                          "--time-scale", "0.6", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["policies"]) == {"random", "round_robin", "least_loaded", "cache_aware",
                                       "kvcache_centric"}
    for row in result["policies"].values():
        assert {"mean_ttft_ms", "p99_ttft_ms", "slo_attainment", "goodput",
                "hit_ratio"} <= set(row)
    assert (tmp_path / "sim_compare.png").is_file()
    single = tmp_path / "one.json"
    assert simulate_main(["--trace", str(TRACE), "--num-requests", "100", "--admission",
                          "prediction", "--output", str(single)]) == 0
    assert json.loads(single.read_text())["config"]["admission"] == "prediction"
    for suffix in ("ttft_cdf", "load", "hit_ratio"):
        assert (tmp_path / f"one_{suffix}.png").is_file()
    assert simulate_main(["--trace", str(TRACE), "--policy", "all", "--admission", "all",
                          "--output", str(single)]) == 2


@needs_trace
def test_measured_transfer_reranks_against_the_assumed_figures(tmp_path):
    """`--measured-transfer`: the same runs under a profile file's transfer figures; a slower
    measured tier and remote path make cache reuse dearer, so the prefill times grow, and both
    rankings are written."""
    from dataclasses import replace

    from pdcluster.router.cost_model import save_cost_model

    slow = {"local": {"latency_s": 0.01, "bytes_per_s": 5e8},
            "remote": {"latency_s": 0.02, "bytes_per_s": 2e8},
            "pd:grpc": {"latency_s": 0.02, "bytes_per_s": 2e8}}
    measured = tmp_path / "measured.json"
    save_cost_model(replace(MOONCAKE_70B, name="measured", transfer_paths=slow), measured)
    out = tmp_path / "sim.json"
    assert simulate_main(["--trace", str(TRACE), "--num-requests", "150", "--policy", "all",
                          "--time-scale", "0.6", "--no-plots", "--measured-transfer",
                          str(measured), "--output", str(out)]) == 0
    comparison = json.loads(out.read_text())["transfer_comparison"]
    assert comparison["paths"]["pd"] == slow["pd:grpc"]
    for side in ("assumed", "measured"):
        assert sorted(comparison[side]["ranking"]) == sorted(comparison[side]["policies"])
    assumed, slower = (comparison[s]["policies"]["kvcache_centric"]["mean_ttft_ms"]
                       for s in ("assumed", "measured"))
    assert slower > assumed
    empty = tmp_path / "empty.json"
    save_cost_model(MOONCAKE_70B, empty)
    assert simulate_main(["--trace", str(TRACE), "--num-requests", "20", "--policy", "all",
                          "--no-plots", "--measured-transfer", str(empty), "--output",
                          str(out)]) == 2


def test_a_stall_delays_every_running_sequence_by_its_length():
    got = {}
    d = DecodeInstance("d0", MOONCAKE_70B, None, lambda rid, a, b: got.__setitem__(rid, b))
    plain = DecodeInstance("d1", MOONCAKE_70B, None, lambda rid, a, b: got.__setitem__(rid, b))
    d.join("a", 1000, 20, 0.0)
    plain.join("b", 1000, 20, 0.0)
    assert d.stall(0.0, 0.5) == pytest.approx(0.5)
    d.drain()
    plain.drain()
    assert got["a"] == pytest.approx(got["b"] + 0.5)


@needs_trace
def test_pd_deciders_in_the_simulator(tmp_path):
    out = tmp_path / "pd.json"
    assert simulate_main(["--trace", str(TRACE), "--num-requests", "200", "--pd-decider",
                          "all", "--time-scale", "0.6", "--no-plots",
                          "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["pd_deciders"]
    assert set(rows) == {"always", "never", "cost"}
    assert rows["always"]["local_fraction"] == 0 and rows["never"]["local_fraction"] == 1
    # prefilling every prompt on the decode stalls every decode: far worse steps
    assert rows["never"]["mean_tbt_ms"] > 2 * rows["always"]["mean_tbt_ms"]
    assert simulate_main(["--trace", str(TRACE), "--pd-decider", "sometimes",
                          "--output", str(out)]) == 2


@needs_trace
def test_gateway_replicas_route_as_one_only_when_they_share_their_inputs():
    """4 Conductors, each routing a quarter of the requests (in turn). With every replica's
    decisions published as made (and the instances' reports), each sees the queues one
    Conductor sees: the same routes, the same TTFTs. With reports alone, a replica misses the
    others' decisions since the last report (the trace's arrivals come in bursts at one
    instant); with its own decisions only it misses more."""
    runs = {(n, inputs): small_run(n=1200, conductors=n, inputs=inputs)
            for n, inputs in ((1, "shared"), (4, "shared"), (4, "reports"), (4, "private"))}
    one = runs[1, "shared"]
    assert runs[4, "shared"]["mean_ttft_ms"] == pytest.approx(one["mean_ttft_ms"])
    assert runs[4, "shared"]["per_instance"] == one["per_instance"]
    assert one["mean_ttft_ms"] < runs[4, "reports"]["mean_ttft_ms"] < \
        runs[4, "private"]["mean_ttft_ms"]
    assert all(r["completed"] == 1200 for r in runs.values())
