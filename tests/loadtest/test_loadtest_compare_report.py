"""`bench compare` on two result files; the report writes PNGs and Markdown."""

import json

import pytest

from pdcluster.loadtest.cli import main
from pdcluster.loadtest.client import RequestRecord
from pdcluster.loadtest.compare import compare_rows
from pdcluster.loadtest.metrics import compute_metrics
from pdcluster.loadtest.report import format_summary, write_report, write_sweep_report


def result(ttft_scale: float, hit: float | None) -> dict:
    records = [RequestRecord(index=i, prompt_len=100, expected_output_len=4, arrival_s=0.1 * i,
                             start_s=0.1 * i, success=i != 3, error="" if i != 3 else "HTTP 500",
                             ttft_s=ttft_scale * (0.05 + 0.01 * i), itl_s=[0.02, 0.02, 0.03],
                             e2el_s=ttft_scale * (0.05 + 0.01 * i) + 0.07,
                             output_tokens=4 if i != 3 else 0) for i in range(10)]
    out = compute_metrics(records, duration_s=2.0, goodput_slos_ms={"ttft": 100})
    rows = [{**r.to_json(), "offline_prefix_hit_tokens": 48, "offline_prefix_queried_tokens": 100}
            for r in records]
    return {**out, "dropped": 1, "prefix_cache_hit_ratio": hit,
            "prefix_cache_hit_ratio_by_tier": None if hit is None else {"device": hit},
            "offline_prefix_hit_ratio": 0.48, "requests": rows,
            "prefix_cache_timeline": None if hit is None else [
                {"t_s": 0.0, "queried": 0, "hit_by_tier": {"device": 0}},
                {"t_s": 1.0, "queried": 500, "hit_by_tier": {"device": 200}},
                {"t_s": 2.0, "queried": 900, "hit_by_tier": {"device": 430}}]}


def test_compare_rows_ratios():
    a, b = result(1.0, 0.45), result(2.0, None)
    rows = {r["metric"]: r for r in compare_rows(a, b)}
    assert rows["mean_ttft_ms"]["ratio"] == pytest.approx(b["mean_ttft_ms"] / a["mean_ttft_ms"])
    assert rows["mean_ttft_ms"]["better"] == "a"        # lower latency is better
    assert rows["request_throughput"]["ratio"] == pytest.approx(1.0)
    assert rows["request_throughput"]["better"] == "="
    assert rows["prefix_cache_hit_ratio"]["b"] is None
    assert rows["prefix_cache_hit_ratio"]["ratio"] is None
    assert rows["prefix_cache_hit_ratio[device]"]["a"] == 0.45
    assert "requests" not in rows


def test_cli_compare_prints_every_headline_ratio(tmp_path, capsys):
    pa, pb = tmp_path / "on.json", tmp_path / "off.json"
    pa.write_text(json.dumps(result(1.0, 0.45)))
    pb.write_text(json.dumps(result(1.5, 0.0)))
    md = tmp_path / "cmp.md"
    assert main(["compare", str(pa), str(pb), "--output", str(md)]) == 0
    out = capsys.readouterr().out
    for metric in ("request_throughput", "output_throughput", "mean_ttft_ms", "p99_tpot_ms",
                   "mean_e2el_ms", "prefix_cache_hit_ratio", "request_goodput"):
        assert f"| {metric} |" in out
    assert "| mean_ttft_ms |" in md.read_text()
    assert main(["compare", str(pa), str(tmp_path / "missing.json")]) == 2


def test_report_writes_pngs_and_markdown(tmp_path):
    res = result(1.0, 0.45)
    md = write_report(res, tmp_path, "run")
    text = md.read_text()
    for png in ("ttft_cdf", "tpot_cdf", "throughput", "hit_ratio"):
        path = tmp_path / f"run_{png}.png"
        assert path.stat().st_size > 1000
        assert path.read_bytes()[:4] == b"\x89PNG"
        assert f"(run_{png}.png)" in text
    assert "HTTP 500" in text and "| Mean TTFT (ms) |" in text
    assert "Successful requests:" in format_summary(res)


def test_report_command_and_sweep_report(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result(1.0, None)))
    assert main(["report", str(path)]) == 0
    assert (tmp_path / "r_hit_ratio.png").exists() and (tmp_path / "r.md").exists()
    points = [{**result(s, 0.4), "request_rate": rate} for s, rate in ((1, 1.0), (2, "inf"))]
    md = write_sweep_report(points, "request_rate", tmp_path, "sw")
    assert (tmp_path / "sw_latency_vs_load.png").read_bytes()[:4] == b"\x89PNG"
    assert "| inf |" in md.read_text()
