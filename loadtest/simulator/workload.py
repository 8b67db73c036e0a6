"""Simulated requests from a Mooncake trace: lengths, arrival times and block keys.

The simulator works at the trace's own granularity: one KV block per trace block of 512 tokens.
Trace hash id h at position i names block i together with every block before it
(`../shared/traces/mooncake/README.md`), so a block's key is sha256 over the hash id alone —
equal ids give equal keys, exactly the sharing the trace records. Only full blocks are keyed
(a key names a full block's tokens): a prompt of n tokens has n // 512 keys; its partial tail is
always computed.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

from pdcluster.loadtest.arrivals import trace_arrivals
from pdcluster.loadtest.trace import TRACE_BLOCK_SIZE, TraceRecord, read_trace


@dataclass(frozen=True, slots=True)
class SimRequest:
    request_id: str
    arrival_s: float
    input_tokens: int
    output_tokens: int
    keys: tuple[bytes, ...]


def _block_key(hash_id: int) -> bytes:
    return hashlib.sha256(b"mooncake-trace-block:%d" % hash_id).digest()


def requests_from_records(records: list[TraceRecord], time_scale: float = 1.0
                          ) -> list[SimRequest]:
    """One SimRequest per record, arrivals from the timestamps (gaps × time_scale)."""
    key_of = functools.cache(_block_key)  # a trace repeats its hot hash ids many times
    arrivals = trace_arrivals([r.timestamp_ms for r in records], time_scale)
    out = []
    for record, arrival in zip(records, arrivals):
        num_full = min(len(record.hash_ids), record.input_length // TRACE_BLOCK_SIZE)
        out.append(SimRequest(f"r{record.index}", arrival, record.input_length,
                              max(1, record.output_length),
                              tuple(key_of(h) for h in record.hash_ids[:num_full])))
    return out


def load_requests(path: str | Path, time_scale: float = 1.0, start: int = 0,
                  num_requests: int | None = None) -> list[SimRequest]:
    """Raises ValueError for a malformed trace, OSError for an unreadable one."""
    return requests_from_records(read_trace(path, start, num_requests), time_scale)


def vary_rate(requests: list[SimRequest], factors: list[float]) -> list[SimRequest]:
    """The same requests with the arrival rate multiplied by factors[i] over the i-th of
    len(factors) equal spans of the trace's time (`--rate-profile 1,2,1`: the middle third
    twice as fast). Raises ValueError for a factor <= 0."""
    if any(f <= 0 for f in factors):
        raise ValueError(f"rate factors must be > 0, got {factors}")
    if not requests or not factors:
        return list(requests)
    t0 = requests[0].arrival_s
    span = (requests[-1].arrival_s - t0) / len(factors) or 1.0
    starts = [0.0]
    for f in factors:
        starts.append(starts[-1] + span / f)

    def warp(t: float) -> float:
        i = min(int((t - t0) / span), len(factors) - 1)
        return t0 + starts[i] + (t - t0 - i * span) / factors[i]

    return [dataclasses.replace(r, arrival_s=warp(r.arrival_s)) for r in requests]
