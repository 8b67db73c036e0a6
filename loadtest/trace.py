"""Mooncake trace replay: trace records → requests whose token ids reproduce the trace's
prefix sharing.

Format (`../shared/traces/mooncake/README.md`; Mooncake FAST'25, Appendix A): one JSON object per
line, `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}`, where hash
id i names prompt block i (512 tokens; the last block may be partial) together with every block
before it.

Mapping. With length scale s, the trace block size 512 becomes B = round(512·s) tokens and every
length is scaled by B/512 (so a non-integral 512·s is rounded once, here, and all lengths stay
consistent with it). The prompt of a record with hash ids h_0..h_{n-1} is

    tokens(h_0, B) ‖ tokens(h_1, B) ‖ … ‖ tokens(h_{n-1}, tail)

where tokens(h, k) is the first k ids of the deterministic block of h (`tokens.BlockTokens`) and
tail = max(1, round((input_length − 512·(n−1)) · B/512)) ≤ B. Equal hash ids at equal positions
therefore give equal tokens, so two prompts share exactly the prefix the trace says they share.
The output length is max(1, round(output_length · B/512)). A request whose scaled prompt plus
output exceeds `max_model_len` is dropped and counted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pdcluster.loadtest.arrivals import trace_arrivals
from pdcluster.loadtest.tokens import BlockTokens, TokenSpace
from pdcluster.loadtest.workload import BenchRequest, Workload

TRACE_BLOCK_SIZE = 512


@dataclass(frozen=True)
class TraceRecord:
    index: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: str | Path, start: int = 0, num_requests: int | None = None
               ) -> list[TraceRecord]:
    """Records `start` .. `start + num_requests - 1` (0-based, blank lines skipped).

    Raises:
        ValueError: a malformed record (missing field, no hash ids).
    """
    if start < 0 or (num_requests is not None and num_requests < 0):
        raise ValueError("start and num_requests must be >= 0")
    end = None if num_requests is None else start + num_requests
    records: list[TraceRecord] = []
    with open(path, encoding="utf-8") as f:
        index = 0
        for line in f:
            if not line.strip():
                continue
            if end is not None and index >= end:
                break
            if index >= start:
                records.append(_parse_record(index, line))
            index += 1
    return records


def _parse_record(index: int, line: str) -> TraceRecord:
    try:
        obj = json.loads(line)
        record = TraceRecord(index=index, timestamp_ms=float(obj["timestamp"]),
                             input_length=int(obj["input_length"]),
                             output_length=int(obj["output_length"]),
                             hash_ids=tuple(int(h) for h in obj["hash_ids"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"trace record {index}: {exc}") from exc
    if not record.hash_ids or record.input_length < 1:
        raise ValueError(f"trace record {index}: needs input_length >= 1 and hash ids")
    return record


def scaled_block_size(length_scale: float) -> int:
    """Tokens per trace block after scaling: round(512 · length_scale), at least 1.

    Raises:
        ValueError: length_scale <= 0.
    """
    if length_scale <= 0:
        raise ValueError(f"length_scale must be > 0 (got {length_scale})")
    return max(1, round(TRACE_BLOCK_SIZE * length_scale))


def trace_workload(records: list[TraceRecord], space: TokenSpace, *, length_scale: float = 1.0,
                   time_scale: float = 1.0, max_model_len: int | None = None, seed: int = 0,
                   source: str = "trace") -> Workload:
    """Requests for `records` (see the module docstring for the mapping); arrivals follow the
    timestamps (relative to the first record), gaps multiplied by `time_scale`."""
    block = scaled_block_size(length_scale)
    blocks = BlockTokens(space, seed, namespace="mooncake")
    arrivals = trace_arrivals([r.timestamp_ms for r in records], time_scale)
    requests: list[BenchRequest] = []
    dropped = 0
    for record, arrival in zip(records, arrivals):
        prompt = record_prompt(record, block, blocks)
        output_len = max(1, round(record.output_length * block / TRACE_BLOCK_SIZE))
        if max_model_len is not None and len(prompt) + output_len > max_model_len:
            dropped += 1
            continue
        requests.append(BenchRequest(index=record.index, prompt=prompt, output_len=output_len,
                                     arrival_s=arrival))
    first = records[0].index if records else 0
    return Workload(
        requests=requests, dropped=dropped,
        description=f"trace {source}[{first}:{first + len(records)}]",
        params={"trace": source, "start": first, "num_requests": len(records),
                "length_scale": length_scale, "trace_block_size": block,
                "time_scale": time_scale, "max_model_len": max_model_len, "seed": seed})


def record_prompt(record: TraceRecord, block: int, blocks: BlockTokens) -> list[int]:
    """The prompt token ids of `record` with `block`-token blocks (see the module docstring)."""
    n = len(record.hash_ids)
    tail_orig = min(max(record.input_length - TRACE_BLOCK_SIZE * (n - 1), 1), TRACE_BLOCK_SIZE)
    tail = min(block, max(1, round(tail_orig * block / TRACE_BLOCK_SIZE)))
    prompt: list[int] = []
    for h in record.hash_ids[:-1]:
        prompt.extend(blocks.get(h, block))
    prompt.extend(blocks.get(record.hash_ids[-1], tail))
    return prompt
