"""Benchmark metrics, defined exactly as `vllm bench serve` defines them
(`calculate_metrics` in vllm/benchmarks/serve.py), under the same JSON key names.

Over the successful requests (failed ones count only in `failed`):
    TTFT_r  = first token event − send time
    E2EL_r  = last token event − send time
    TPOT_r  = (E2EL_r − TTFT_r) / (output_len_r − 1), only for output_len_r > 1 (the first token
              is excluded); for goodput a request with output_len_r <= 1 has TPOT 0
    ITL     = every gap between consecutive token events, pooled over all requests
    request_throughput     = completed / duration
    output_throughput      = Σ output_len / duration
    total_token_throughput = (Σ prompt_len + Σ output_len) / duration
    request_goodput        = #(requests meeting every SLO given: metric <= SLO) / duration;
                             None when no SLO is given
Each metric gets mean, median, std (numpy's population std) and the selected percentiles
(`numpy.percentile`, linear interpolation), in milliseconds: `mean_ttft_ms`, `p99_itl_ms`, ...
An empty list reports 0, as vLLM does. `output_len_r` is the server's usage count (see client),
taken as 1 when the server reported none, as vLLM does without a tokenizer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from pdcluster.loadtest.client import RequestRecord

SLO_NAMES = ("ttft", "tpot", "e2el")


def parse_goodput(pairs: Iterable[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` → {"ttft": 500.0, "tpot": 50.0} (milliseconds).

    Raises:
        ValueError: not NAME:VALUE, an unknown name, or a negative value.
    """
    slos: dict[str, float] = {}
    for pair in pairs:
        try:
            name, value = pair.split(":")
            slos[name.strip()] = float(value)
        except ValueError as exc:
            raise ValueError(f"goodput SLO {pair!r}: expected NAME:MILLISECONDS") from exc
    for name, value in slos.items():
        if name not in SLO_NAMES:
            raise ValueError(f"goodput SLO name {name!r}: expected one of {SLO_NAMES}")
        if value < 0:
            raise ValueError(f"goodput SLO {name}: {value} must be >= 0")
    return slos


def output_len(record: RequestRecord) -> int:
    return record.output_tokens or 1


def request_tpot(record: RequestRecord) -> float | None:
    """TPOT of one successful request in seconds; None when it has <= 1 output token."""
    n = output_len(record)
    return (record.e2el_s - record.ttft_s) / (n - 1) if n > 1 else None


def percentile_key(p: float) -> str:
    """vLLM's key spelling: 99 → "p99", 99.9 → "p99.9"."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


def compute_metrics(records: Sequence[RequestRecord], duration_s: float,
                    goodput_slos_ms: dict[str, float] | None = None,
                    percentiles: Sequence[float] = (90, 99)) -> dict:
    """The headline metrics of a run (see the module docstring), keyed as vLLM keys them."""
    ok = [r for r in records if r.success]
    out_lens = [output_len(r) for r in ok]
    ttfts = [r.ttft_s for r in ok]
    e2els = [r.e2el_s for r in ok]
    tpots = [t for t in (request_tpot(r) for r in ok) if t is not None]
    itls = [gap for r in ok for gap in r.itl_s]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(out_lens)
    result: dict = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": (_good_count(ok, goodput_slos_ms) / duration_s
                            if goodput_slos_ms else None),
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        result.update(_stats_ms(name, values, percentiles))
    result["max_output_tokens_per_s"] = _peak_tokens_per_s(ok)
    result["max_concurrent_requests"] = _peak_concurrency(ok)
    return result


def _good_count(ok: Sequence[RequestRecord], slos_ms: dict[str, float]) -> int:
    good = 0
    for r in ok:
        values = {"ttft": r.ttft_s, "tpot": request_tpot(r) or 0.0, "e2el": r.e2el_s}
        if all(slos_ms[name] / 1000.0 >= values[name] for name in slos_ms):
            good += 1
    return good


def _stats_ms(name: str, values: Sequence[float], percentiles: Sequence[float]) -> dict:
    data = np.asarray(values if values else [0.0], dtype=float)
    stats = {f"mean_{name}_ms": float(np.mean(data)) * 1000,
             f"median_{name}_ms": float(np.median(data)) * 1000,
             f"std_{name}_ms": float(np.std(data)) * 1000}
    for p in percentiles:
        stats[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(data, p)) * 1000
    return stats


def token_times(record: RequestRecord) -> list[float]:
    """Times (s after the benchmark start) of a successful request's token events."""
    t = record.start_s + record.ttft_s
    times = [t]
    for gap in record.itl_s:
        t += gap
        times.append(t)
    return times


def _peak_tokens_per_s(ok: Sequence[RequestRecord]) -> float:
    """The most token events in any one-second bucket from the first send (vLLM's
    `max_output_tokens_per_s`)."""
    if not ok:
        return 0.0
    t0 = min(r.start_s for r in ok)
    end = max(r.start_s + r.e2el_s for r in ok)
    buckets = np.zeros(int(math.ceil(end - t0)) + 1)
    for r in ok:
        for t in token_times(r):
            b = int(t - t0)
            if 0 <= b < len(buckets):
                buckets[b] += 1
    return float(buckets.max())


def _peak_concurrency(ok: Sequence[RequestRecord]) -> int:
    """Most requests in flight at once, over half-open [send, last token) intervals."""
    events = sorted([(r.start_s, 1) for r in ok] + [(r.start_s + r.e2el_s, -1) for r in ok])
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak
