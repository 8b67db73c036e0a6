"""The numbers of a simulation run, as one JSON-able dict.

Latencies follow `loadtest.metrics` (vLLM's definitions, milliseconds): TTFT = first token −
arrival; TBT = (E2E − TTFT) / (output tokens − 1), a request's mean time between tokens (its
TPOT); E2E = last token − arrival. Over completed requests only. A request is *good* when it
completed with TTFT <= the TTFT SLO and TBT <= the TBT SLO; SLO attainment = good / all
requests (rejected ones count as missed); goodput = good / duration (req/s), duration = last
event − first arrival. Hit ratios are cached prompt tokens over all prompt tokens of the
prefills that ran, by the tier they came from ("remote": pulled from another node).
Wasted prefill-seconds: prefill time spent on requests decode could not admit within the TBT
SLO (arXiv 2407.00079v1 §6). Instance time: see `instance_time`.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from pdcluster.loadtest.simulator.engine import Simulation

HOT_BLOCKS = 10


def _stats(name: str, values_s: list[float]) -> dict:
    data = np.asarray(values_s or [0.0], dtype=float) * 1000
    return {f"mean_{name}_ms": float(data.mean()), f"median_{name}_ms": float(np.median(data)),
            f"p90_{name}_ms": float(np.percentile(data, 90)),
            f"p99_{name}_ms": float(np.percentile(data, 99))}


def summarize(sim: Simulation, include_samples: bool = True) -> dict:
    cfg, slo = sim.config, sim.config.slo
    results = sim.results
    done = [r for r in results if r.status == "ok"]
    ttft = [r.first_token_s - r.request.arrival_s for r in done]
    e2e = [r.end_s - r.request.arrival_s for r in done]
    tbt = [(r.end_s - r.first_token_s) / (r.request.output_tokens - 1) for r in done
           if r.request.output_tokens > 1]
    good = sum(1 for r, t, e in zip(done, ttft, e2e) if t <= slo.ttft_s and (
        r.request.output_tokens <= 1
        or (e - t) / (r.request.output_tokens - 1) <= slo.tbt_s))
    t0 = min((r.request.arrival_s for r in results), default=0.0)
    t_end = max([r.end_s for r in results if r.end_s is not None] + [t0])
    duration = max(t_end - t0, 1e-9)
    ran = [r for r in results if r.started_s is not None]
    prompt_tokens = sum(r.request.input_tokens for r in ran)
    hit_tokens: Counter = Counter()
    for r in ran:
        for tier, n in r.hit_blocks.items():
            hit_tokens[tier] += n * cfg.block_size
    rejected = Counter(r.reason for r in results if r.status == "rejected")
    decode_rejected = Counter(r.reason for r in results if r.status == "decode_rejected")
    wasted = [r for r in results if r.wasted]
    out = {
        "config": {"policy": cfg.policy, "admission": cfg.admission,
                   "pd_decider": cfg.pd_decider,
                   "prefill_instances": cfg.prefill_instances,
                   "decode_instances": cfg.decode_instances, "cost_model": cfg.cost.name,
                   "slo_ttft_s": slo.ttft_s, "slo_tbt_ms": slo.tbt_s * 1000,
                   "device_cache_tokens": cfg.device_cache_tokens,
                   "dram_cache_tokens": cfg.dram_cache_tokens or cfg.cost.dram_cache_tokens,
                   "ssd_cache_tokens": cfg.ssd_cache_tokens,
                   "decode_kv_tokens": cfg.decode_kv_tokens or cfg.cost.decode_kv_tokens},
        "num_requests": len(results), "completed": len(done),
        "rejected": sum(rejected.values()) + sum(decode_rejected.values()),
        "rejected_at_arrival": dict(rejected), "rejected_at_decode": dict(decode_rejected),
        "wasted_prefills": len(wasted),
        "wasted_prefill_s": float(sum(r.prefill_s for r in wasted)),
        "prefill_busy_s": float(sum(r.prefill_s for r in ran)),
        "duration_s": duration, "good": good,
        "slo_attainment": good / max(1, len(results)), "goodput": good / duration,
        "local_fraction": sum(r.local for r in ran) / max(1, len(ran)),
        "request_throughput": len(done) / duration,
        **_stats("ttft", ttft), **_stats("tbt", tbt), **_stats("e2e", e2e),
        "hit_ratio": sum(hit_tokens.values()) / max(1, prompt_tokens),
        "hit_ratio_by_tier": {t: n / max(1, prompt_tokens) for t, n in sorted(hit_tokens.items())},
        "hot_blocks": hot_blocks(sim),
        "per_instance": per_instance(sim),
        **instance_time(sim, good),
    }
    if sim.autoscaler is not None:
        out["autoscale"] = {"range": str(cfg.autoscale), "decisions": sim.autoscaler.decisions}
    if include_samples:
        out["samples"] = sim.samples
    return out


def instance_time(sim: Simulation, good: int) -> dict:
    """Instance-hours run (an instance counts from its start to its stop, or to the last
    event), per 1k requests of the trace, and good requests per instance-hour."""
    seconds = sim.instance_seconds()
    hours = sum(seconds.values()) / 3600
    return {"instance_hours": {r: s / 3600 for r, s in seconds.items()},
            "instance_hours_per_1k": hours * 1000 / max(1, len(sim.results)),
            "goodput_per_instance_hour": good / hours if hours else 0.0}


def hot_blocks(sim: Simulation, n: int = HOT_BLOCKS) -> list[dict]:
    """The n most reused blocks: reuse count and the nodes holding them at the end."""
    top = sim.reuse.most_common(n)
    held = sim.index.lookup([k for k, _ in top])
    return [{"key": k.hex()[:16], "reuses": count,
             "replicas": len({loc.node_id for loc in locs})}
            for (k, count), locs in zip(top, held)]


def per_instance(sim: Simulation) -> dict:
    busy: Counter = Counter()
    count: Counter = Counter()
    for r in sim.results:
        if r.started_s is not None and not r.local:
            busy[r.prefill_id] += r.prefill_s
            count[r.prefill_id] += 1
    return {p: {"requests": count[p], "busy_s": round(busy[p], 3)} for p in sim.prefills}


POLICY_KEYS = ("mean_ttft_ms", "p99_ttft_ms", "slo_attainment", "goodput", "hit_ratio")


def policy_row(summary: dict) -> dict:
    """The per-policy entry of `--policy all`, plus a few more for the tables."""
    return {k: summary[k] for k in (*POLICY_KEYS, "median_ttft_ms", "mean_tbt_ms",
                                    "p99_tbt_ms", "rejected", "wasted_prefill_s",
                                    "local_fraction")}
