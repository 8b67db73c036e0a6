"""Arrival schedules: seconds after the benchmark start at which each request is sent.

Synthetic arrivals follow `vllm bench serve` (`get_request` in vllm/benchmarks/serve.py): gaps
are Gamma(shape=burstiness, scale=1/(rate·burstiness)) — burstiness 1 is a Poisson process,
< 1 burstier, > 1 more regular, inf a constant 1/rate — the first request also waits one gap,
and the cumulative times are rescaled so the last arrival lands exactly at n/rate (vLLM does
this to make throughput stable across seeds). A rate of inf sends everything at time 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def rate_arrivals(n: int, rate: float, burstiness: float = 1.0,
                  rng: np.random.Generator | None = None, normalize: bool = True) -> list[float]:
    """Arrival offsets (s, non-decreasing) of `n` requests at mean `rate` requests/s.

    Raises:
        ValueError: rate or burstiness not > 0.
    """
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be > 0 (got {rate}, {burstiness})")
    if n == 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / rate)
    else:
        rng = rng if rng is not None else np.random.default_rng(0)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    times = np.cumsum(gaps)
    if normalize and times[-1] > 0:
        times *= (n / rate) / times[-1]
    return times.tolist()


def trace_arrivals(timestamps_ms: Sequence[float], time_scale: float = 1.0) -> list[float]:
    """Arrival offsets (s) replaying trace timestamps: the first request at 0, every gap between
    arrivals multiplied by `time_scale` (0.5 replays twice as fast).

    Raises:
        ValueError: time_scale < 0.
    """
    if time_scale < 0:
        raise ValueError(f"time_scale must be >= 0 (got {time_scale})")
    if not timestamps_ms:
        return []
    t0 = timestamps_ms[0]
    return [(t - t0) * time_scale / 1000.0 for t in timestamps_ms]


def parse_rate_steps(text: str) -> list[tuple[float, float]]:
    """`--rate-steps 2:60,8:60,2:60` -> [(2.0, 60.0), (8.0, 60.0), (2.0, 60.0)]: requests/s
    and seconds of each step. Raises ValueError for a malformed or non-positive step."""
    steps = []
    for part in text.split(","):
        rate, sep, seconds = part.partition(":")
        try:
            step = (float(rate), float(seconds))
        except ValueError:
            step = None
        if not sep or step is None or step[0] <= 0 or step[1] <= 0:
            raise ValueError(f"--rate-steps: {part!r} is not RATE:SECONDS with both > 0")
        steps.append(step)
    return steps


def stepped_arrivals(steps: Sequence[tuple[float, float]], burstiness: float = 1.0,
                     rng: np.random.Generator | None = None) -> list[float]:
    """Arrival offsets (s) of a load that steps through (rate, seconds) pairs: each step's
    arrivals follow `rate_arrivals` at its rate over its own seconds (its count is
    rate × seconds, rounded), placed after the steps before it."""
    rng = rng if rng is not None else np.random.default_rng(0)
    out: list[float] = []
    t0 = 0.0
    for rate, seconds in steps:
        n = round(rate * seconds)
        out += [t0 + t for t in rate_arrivals(n, rate, burstiness, rng)]
        t0 += seconds
    return out
