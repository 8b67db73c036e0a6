"""PNG plots of simulation results (matplotlib, Agg backend).

Per run `<stem>_ttft_cdf.png` (TTFT CDF), `<stem>_load.png` (each prefill instance's predicted
queue and each decode instance's KV tokens over time) and `<stem>_hit_ratio.png` (prefix hit
ratio by tier). For a comparison (`--policy all` / `--admission all`), `<stem>_compare.png`:
TTFT CDFs of every run on one axis.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from pdcluster.loadtest.report import save_figure  # its import selects the Agg backend


def _cdf(ax, values_s: list[float], label: str) -> None:
    data = np.sort(np.asarray(values_s, dtype=float))
    if len(data):
        ax.plot(data, np.arange(1, len(data) + 1) / len(data), label=label)


def write_run_plots(summary: dict, ttfts_s: list[float], out_dir: Path, stem: str
                    ) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    _cdf(ax, ttfts_s, summary["config"]["policy"])
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.axvline(summary["config"]["slo_ttft_s"], color="grey", linestyle="--", label="SLO")
    ax.legend()
    paths.append(save_figure(fig, out_dir / f"{stem}_ttft_cdf.png"))

    samples = summary.get("samples") or []
    if samples:
        t = [s["t"] for s in samples]
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
        for i, series in enumerate(zip(*[s["prefill_queue_s"] for s in samples])):
            top.plot(t, series, linewidth=0.8, label=f"prefill-{i}")
        top.set_ylabel("prefill queue (s)")
        for i, series in enumerate(zip(*[s["decode_tokens"] for s in samples])):
            bottom.plot(t, np.asarray(series) / 1000, linewidth=0.8, label=f"decode-{i}")
        bottom.set_ylabel("decode KV (k tokens)")
        bottom.set_xlabel("simulated time (s)")
        top.legend(fontsize=6, ncol=4)
        paths.append(save_figure(fig, out_dir / f"{stem}_load.png"))

    tiers = summary.get("hit_ratio_by_tier") or {}
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(list(tiers) or ["none"], [100 * v for v in tiers.values()] or [0])
    ax.set_ylabel("prompt tokens reused (%)")
    ax.set_title(f"prefix hit ratio {100 * summary['hit_ratio']:.1f}%")
    paths.append(save_figure(fig, out_dir / f"{stem}_hit_ratio.png"))
    return paths


def write_compare_plot(ttfts_by_run: dict[str, list[float]], slo_ttft_s: float, out_dir: Path,
                       stem: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for name, values in ttfts_by_run.items():
        _cdf(ax, values, name)
    ax.set_xscale("log")
    ax.axvline(slo_ttft_s, color="grey", linestyle="--", label="TTFT SLO")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of completed requests")
    ax.legend()
    return save_figure(fig, out_dir / f"{stem}_compare.png")
