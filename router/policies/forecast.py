"""Decode load ahead of time, for prediction-based admission (arXiv 2407.00079v1 §6.4) and for
choosing a decode instance by the load it will have when the request gets there.

The Conductor records every routed request (`add`: decode instance, predicted join time, KV
tokens); the caller reports joins (`joined`), finishes (`finished`, with the sequence's time in
decode) and requests that will never join (`discard`). The load of decode instance d at a
future time `at`, from its load observed now:

    observed now − KV of d's running sequences confidently finished by t (the rest grow by
                   one token per step) + KV of requests routed to d that have joined by t,

at t = `at` and at every later predicted join of a request routed to d (the new request will
still be there then), taking the peak. A running sequence of age a finishes within Δ with
probability (F(a+Δ) − F(a)) / (1 − F(a)), F the empirical distribution of observed decode
times; it counts as gone when that is >= `confidence`: capacity is a hard limit, so the forecast
errs on the side of load. Mooncake predicts with one uniform
decode time t_d per request; with no observations yet this falls back to exactly that
(t_d = expected output tokens × a step), but conditioning on age is what keeps long-running
sequences of a heavy-tailed output distribution counted. Live, where finishes are not always
reported, an entry is dropped once its survival probability falls below 1 %, and pending
entries count as joined `grace_s` after their predicted join.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from itertools import accumulate

import numpy as np

from pdcluster.router.cost_model import CostModel
from pdcluster.router.policies.base import DecodeLoad

DEFAULT_EXPECTED_OUTPUT_TOKENS = 256
_SAMPLES = 4096
DEFAULT_CONFIDENCE = 0.99
_MAX_CHECKPOINTS = 32
_RESORT_EVERY = 128


class DurationDistribution:
    """Empirical CDF of the last `_SAMPLES` observed decode times."""

    def __init__(self) -> None:
        self._recent: deque[float] = deque(maxlen=_SAMPLES)
        self.sorted = np.zeros(0)
        self._unsorted = 0

    def __len__(self) -> int:
        return len(self._recent)

    def add(self, seconds: float) -> None:
        self._recent.append(seconds)
        self._unsorted += 1
        if self._unsorted >= _RESORT_EVERY or len(self._recent) < _RESORT_EVERY:
            self.sorted, self._unsorted = np.sort(np.fromiter(self._recent, float)), 0

    def cdf(self, x: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.sorted, x, side="right") / len(self.sorted)


class DecodeForecast:
    """See the module docstring. Thread-safe."""

    def __init__(self, cost: CostModel,
                 expected_output_tokens: int = DEFAULT_EXPECTED_OUTPUT_TOKENS,
                 grace_s: float = 2.0, confidence: float = DEFAULT_CONFIDENCE) -> None:
        self.cost = cost
        self.confidence = confidence
        self.expected_output_tokens = expected_output_tokens
        self.grace_s = grace_s
        self._lock = threading.Lock()
        # decode -> request -> (predicted join time, KV tokens); and where each request is
        self._pending: dict[str, dict[str, tuple[float, int]]] = {}
        self._running: dict[str, dict[str, tuple[float, int]]] = {}  # (joined at, KV tokens)
        self._where: dict[str, tuple[dict, str]] = {}  # request -> (its map, decode)
        self.durations = DurationDistribution()

    def add(self, request_id: str, decode_id: str, join_at: float, tokens: int) -> None:
        with self._lock:
            self._put(self._pending, request_id, decode_id, join_at, tokens)

    def joined(self, request_id: str, at: float) -> None:
        with self._lock:
            where = self._where.get(request_id)
            if where is not None and where[0] is self._pending:
                _, tokens = self._pop(request_id)
                self._put(self._running, request_id, where[1], at, tokens)

    def discard(self, request_id: str) -> None:
        """The request will not join (rejected, failed, aborted) or has left."""
        with self._lock:
            self._pop(request_id)

    def finished(self, request_id: str, decode_s: float) -> None:
        with self._lock:
            self._pop(request_id)
            self.durations.add(decode_s)

    def _put(self, table: dict, rid: str, decode: str, t: float, tokens: int) -> None:
        table.setdefault(decode, {})[rid] = (t, tokens)
        self._where[rid] = (table, decode)

    def _pop(self, rid: str) -> tuple[float, int] | None:
        where = self._where.pop(rid, None)
        return None if where is None else where[0][where[1]].pop(rid)

    def expire(self, now: float) -> None:
        """Live housekeeping (see the module docstring); a no-op when joins are reported."""
        with self._lock:
            late = [(rid, decode, t, n) for decode, entries in self._pending.items()
                    for rid, (t, n) in entries.items() if t + self.grace_s < now]
            for rid, decode, t, n in late:
                self._pop(rid)
                self._put(self._running, rid, decode, t, n)
            if late:
                for decode, entries in self._running.items():
                    started = np.fromiter((t for t, _ in entries.values()), float)
                    gone = self._departure_times(started, now) < now + 1e-9
                    for rid, is_gone in zip(list(entries), gone):
                        if is_gone:
                            self._pop(rid)

    def _default_decode_s(self) -> float:
        return self.expected_output_tokens * self.cost.t_step(1, 0)

    def _departure_times(self, started: np.ndarray, now: float) -> np.ndarray:
        """Per running sequence, the earliest time by which it has finished with probability
        >= `confidence`: with F the CDF of decode times and a = now − started, P(done within
        Δ) = (F(a+Δ) − F(a)) / (1 − F(a)) >= c  ⇔  a + Δ >= Q(F(a) + c·(1 − F(a)))."""
        n = len(self.durations.sorted)
        if not n:
            return started + self._default_decode_s()
        f = self.durations.cdf(now - started)
        u = f + self.confidence * (1.0 - f)
        index = np.ceil(u * n - 1e-9).astype(int) - 1
        q = self.durations.sorted[np.minimum(np.maximum(index, 0), n - 1)]
        return np.where(f >= 1.0, now, started + q)

    def load_at(self, load: DecodeLoad, now: float, at: float) -> DecodeLoad:
        """`load` (observed at `now`) as predicted from time `at` >= now on: the peak over `at`
        and the predicted joins of requests routed to the instance that come later (a request
        joining at `at` is still there then, so it must fit next to them too)."""
        return self.loads_at((load,), now, at)[0]

    def loads_at(self, loads: Sequence[DecodeLoad], now: float, at: float) -> tuple[DecodeLoad, ...]:
        """`load_at` of each of `loads`, in order. The departure times of every instance's
        running sequences are computed in one pass, since they depend only on their start."""
        with self._lock:
            runs = [list(self._running.get(load.instance_id, {}).values()) for load in loads]
            pendings = [sorted(self._pending.get(load.instance_id, {}).values()) for load in loads]
            sizes = [len(run) for run in runs]
            total = sum(sizes)
            started = np.fromiter((t for run in runs for t, _ in run), float, total)
            kv = np.fromiter((n for run in runs for _, n in run), float, total)
            departs = self._departure_times(started, now)
        # departures in time order within each instance, with their KV summed: how many have
        # left by t and what they held are one bisection per checkpoint (KV counts are
        # integers: the sums are exact). Plain lists: a few dozen entries per instance, where
        # numpy's per-call cost outweighs its loops.
        instance = np.repeat(np.arange(len(loads)), sizes)
        order = np.lexsort((departs, instance))
        departed = departs[order].tolist()
        departed_kv = [0.0, *np.cumsum(kv[order]).tolist()]
        out, lo = [], 0
        for load, size, pending in zip(loads, sizes, pendings):
            hi = lo + size
            out.append(self._peak(load, now, at, departed, departed_kv, lo, hi, pending))
            lo = hi
        return tuple(out)

    def _peak(self, load: DecodeLoad, now: float, at: float, departed: list[float],
              departed_kv: list[float], lo: int, hi: int,
              pending: list[tuple[float, int]]) -> DecodeLoad:
        """The peak load over `at` and the later joins; the instance's running sequences are
        departed[lo:hi] (sorted), and departed_kv[i] - departed_kv[lo] is the KV of those in
        departed[lo:i]."""
        step = self.cost.t_step(max(1, load.batch_size), load.context_tokens)
        joins = [t for t, _ in pending]
        joined_kv = list(accumulate((n for _, n in pending), initial=0))
        first = bisect.bisect_right(joins, at)  # joins are sorted
        later = joins[first:first + _MAX_CHECKPOINTS]
        peak = (0, 0)
        for t in [at] + later:
            gone = bisect.bisect_right(departed, t, lo, hi) - lo if t > now else 0
            stay = hi - lo - gone
            k = bisect.bisect_right(joins, t)
            batch = load.batch_size - gone + k
            tokens = (load.context_tokens - (departed_kv[lo + gone] - departed_kv[lo])
                      + joined_kv[k])
            if step > 0:  # the sequences that stay grow by a token per step
                tokens += stay * int((t - now) / step)
            peak = max(peak, (round(tokens), batch))
        return replace(load, batch_size=max(0, peak[1]), context_tokens=max(0, peak[0]))
