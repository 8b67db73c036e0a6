"""Human-readable output of a run or sweep: the console summary, a Markdown report and PNG plots
(matplotlib, Agg backend — no display needed).

Per run, `<stem>.md` with the headline table and
    <stem>_ttft_cdf.png    CDF of TTFT over successful requests
    <stem>_tpot_cdf.png    CDF of TPOT (requests with more than one output token)
    <stem>_throughput.png  output tokens/s and completed requests/s over time
    <stem>_hit_ratio.png   prefix-cache hit ratio over time: measured per scrape interval and
                           cumulative (when /metrics has the counters), and the offline bound
Per sweep, `<stem>.md` with one row per point and `<stem>_latency_vs_load.png`.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from pdcluster.loadtest.client import RequestRecord  # noqa: E402
from pdcluster.loadtest.metrics import request_tpot, token_times  # noqa: E402


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def summary_rows(result: dict) -> list[tuple[str, str]]:
    """(label, value) pairs of the headline numbers, in vLLM's order."""
    rows = [("Successful requests", _fmt(result["completed"])),
            ("Failed requests", _fmt(result["failed"])),
            ("Dropped (over max model len)", _fmt(result.get("dropped", 0))),
            ("Benchmark duration (s)", _fmt(result["duration"])),
            ("Total input tokens", _fmt(result["total_input_tokens"])),
            ("Total generated tokens", _fmt(result["total_output_tokens"])),
            ("Request throughput (req/s)", _fmt(result["request_throughput"])),
            ("Request goodput (req/s)", _fmt(result.get("request_goodput"))),
            ("Output token throughput (tok/s)", _fmt(result["output_throughput"])),
            ("Total token throughput (tok/s)", _fmt(result["total_token_throughput"]))]
    pcts = sorted({k.split("_")[0] for k in result if k.startswith("p") and k.endswith("_ttft_ms")},
                  key=lambda p: float(p[1:]))
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", *pcts):
            key = f"{stat}_{name}_ms"
            if key in result:
                rows.append((f"{stat.capitalize()} {name.upper()} (ms)", _fmt(result[key])))
    rows.append(("Prefix cache hit ratio (measured)", _pct(result.get("prefix_cache_hit_ratio"))))
    for tier, ratio in (result.get("prefix_cache_hit_ratio_by_tier") or {}).items():
        rows.append((f"  tier {tier}", _pct(ratio)))
    rows.append(("Prefix hit ratio (offline, infinite cache)",
                 _pct(result.get("offline_prefix_hit_ratio"))))
    if result.get("turns"):
        rows.append(("Conversations", _fmt(result.get("num_conversations"))))
        rows.append(("Abandoned turns (after a failure)", _fmt(result.get("abandoned_turns"))))
        rows.append(("KV bytes transferred", _fmt(result.get("kv_transfer_bytes"), 0)))
        rows.append(("KV bytes transferred per request",
                     _fmt(result.get("kv_transfer_bytes_per_request"), 0)))
    return rows


def format_summary(result: dict) -> str:
    """vLLM-style console block; a multi-turn run adds its per-turn table."""
    lines = [" Serving Benchmark Result ".center(60, "=")]
    lines += [f"{label + ':':<46} {value}" for label, value in summary_rows(result)]
    if result.get("turns"):
        lines.append(" Per turn ".center(60, "-"))
        lines += turn_table(result)
    lines.append("=" * 60)
    return "\n".join(lines)


TURN_COLUMNS = ("turn", "completed", "median TTFT ms", "hit", "hit of full blocks",
                "bound", "hit / bound")


def turn_table(result: dict) -> list[str]:
    """The per-turn rows of a multi-turn result as a Markdown table."""
    lines = ["| " + " | ".join(TURN_COLUMNS) + " |", "|---" * len(TURN_COLUMNS) + "|"]
    for row in result["turns"]:
        cells = (row["turn"], row["completed"], _fmt(row["median_ttft_ms"], 1),
                 _pct(row["hit_ratio"]), _pct(row["hit_ratio_full_blocks"]),
                 _pct(row["offline_bound_hit_ratio"]), _fmt(row["hit_vs_bound"], 3))
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def write_report(result: dict, out_dir: Path, stem: str) -> Path:
    """Write `<stem>.md` and its PNGs under `out_dir`; returns the Markdown path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    records = [RequestRecord.from_json(r) for r in result.get("requests", [])]
    ok = [r for r in records if r.success]
    plots = {
        "TTFT CDF": _cdf_plot([r.ttft_s * 1000 for r in ok], "TTFT (ms)",
                              out_dir / f"{stem}_ttft_cdf.png"),
        "TPOT CDF": _cdf_plot([t * 1000 for r in ok if (t := request_tpot(r)) is not None],
                              "TPOT (ms)", out_dir / f"{stem}_tpot_cdf.png"),
        "Throughput over time": _throughput_plot(ok, result["duration"],
                                                 out_dir / f"{stem}_throughput.png"),
        "Prefix-cache hit ratio over time": _hit_ratio_plot(result,
                                                            out_dir / f"{stem}_hit_ratio.png"),
    }
    md = [f"# Benchmark: {result.get('label') or stem}", "",
          f"- endpoint: `{result.get('api_url')}`, model `{result.get('model_id')}`",
          f"- workload: {result.get('workload')}",
          f"- date: {result.get('date')}", "",
          "| metric | value |", "|---|---:|"]
    md += [f"| {label.strip()} | {value} |" for label, value in summary_rows(result)]
    if result.get("turns"):
        md += ["", "## Per turn", ""] + turn_table(result)
    errors = sorted({r.error for r in records if not r.success})
    if errors:
        md += ["", "## Errors (distinct)", ""] + [f"- `{e[:200]}`" for e in errors[:20]]
    for title, path in plots.items():
        md += ["", f"## {title}", "", f"![{title}]({path.name})"]
    path = out_dir / f"{stem}.md"
    path.write_text("\n".join(md) + "\n", encoding="utf-8")
    return path


def _cdf_plot(values_ms: list[float], xlabel: str, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    if values_ms:
        xs = np.sort(np.asarray(values_ms))
        ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post")
        for p, style in ((50, ":"), (90, "--"), (99, "-.")):
            ax.axvline(np.percentile(xs, p), color="gray", linestyle=style, label=f"p{p}")
        ax.legend(loc="lower right")
    else:
        ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def _throughput_plot(ok: list[RequestRecord], duration: float, path: Path) -> Path:
    width = duration / 100 if duration < 100 else max(1.0, duration / 150)
    width = max(width, 1e-3)
    edges = np.arange(0.0, duration + width, width)
    tokens = np.histogram([t for r in ok for t in token_times(r)], bins=edges)[0] / width
    done = np.histogram([r.start_s + r.e2el_s for r in ok], bins=edges)[0] / width
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    top.stairs(tokens, edges)
    top.set_ylabel("output tok/s")
    bottom.stairs(done, edges, color="tab:orange")
    bottom.set_ylabel("completed req/s")
    bottom.set_xlabel(f"time since start (s), {width:.3g} s bins")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    return save_figure(fig, path)


def _hit_ratio_plot(result: dict, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    rows = [r for r in result.get("requests", [])]
    if rows:
        order = np.argsort([r["arrival_s"] for r in rows], kind="stable")
        hit = np.cumsum([rows[i]["offline_prefix_hit_tokens"] for i in order])
        queried = np.cumsum([rows[i]["offline_prefix_queried_tokens"] for i in order])
        times = [rows[i]["arrival_s"] for i in order]
        ax.plot(times, hit / np.maximum(queried, 1), label="offline bound, cumulative",
                color="gray", linestyle="--")
    timeline = result.get("prefix_cache_timeline") or []
    if len(timeline) >= 2:
        t = np.array([s["t_s"] for s in timeline])
        q = np.array([s["queried"] for s in timeline])
        h = np.array([sum(s["hit_by_tier"].values()) for s in timeline])
        dq, dh = np.diff(q), np.diff(h)
        interval = np.where(dq > 0, dh / np.where(dq > 0, dq, 1), np.nan)
        ax.plot(t[1:], interval, marker=".", label="measured, per interval")
        ax.plot(t[1:], (h[1:] - h[0]) / np.maximum(q[1:] - q[0], 1), label="measured, cumulative")
    else:
        ax.set_title("no /metrics prefix-cache counters: offline bound only", fontsize=9)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("prefix-cache hit ratio")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    return save_figure(fig, path)


def write_sweep_report(results: list[dict], axis: str, out_dir: Path, stem: str) -> Path:
    """`<stem>.md` (one row per point) and `<stem>_latency_vs_load.png`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    x = [r["request_throughput"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, name in zip(axes, ("ttft", "tpot", "e2el")):
        for stat, style in (("mean", "o-"), ("median", "s--"), ("p99", "^:")):
            key = f"{stat}_{name}_ms"
            if all(key in r for r in results):
                ax.plot(x, [r[key] for r in results], style, label=stat)
        for xi, r in zip(x, results):
            ax.annotate(str(r.get(axis)), (xi, r[f"mean_{name}_ms"]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
        ax.set_xlabel("achieved request throughput (req/s)")
        ax.set_ylabel(f"{name.upper()} (ms)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"latency against load (points labelled with {axis})")
    plot = save_figure(fig, out_dir / f"{stem}_latency_vs_load.png")
    cols = ["request_throughput", "output_throughput", "request_goodput", "mean_ttft_ms",
            "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_e2el_ms", "p99_e2el_ms",
            "completed", "failed"]
    md = [f"# Sweep over {axis}", "", f"| {axis} | " + " | ".join(cols) + " |",
          "|---" * (len(cols) + 1) + "|"]
    md += [f"| {r.get(axis)} | " + " | ".join(_fmt(r.get(c)) for c in cols) + " |"
           for r in results]
    md += ["", "## Latency against load", "", f"![latency against load]({plot.name})"]
    path = out_dir / f"{stem}.md"
    path.write_text("\n".join(md) + "\n", encoding="utf-8")
    return path


def save_figure(fig, path: Path) -> Path:
    """Write `fig` to `path` as a PNG and close it; returns `path`."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
