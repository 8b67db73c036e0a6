"""What a benchmark sends: requests with token-id prompts and (optional) arrival times."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BenchRequest:
    """One request to send.

    Attributes:
        index: position in the workload (0-based); for a trace, the record's line number.
        prompt: prompt token ids, sent as the `prompt` list of /v1/completions.
        output_len: `max_tokens` (sent with `ignore_eos`, so the server generates exactly this).
        arrival_s: seconds after the benchmark start at which to send it.
    """

    index: int
    prompt: list[int]
    output_len: int
    arrival_s: float = 0.0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


@dataclass(frozen=True)
class Workload:
    """Requests in arrival order, plus what was left out and why.

    Attributes:
        requests: sorted by `arrival_s`.
        dropped: requests that did not fit `max_model_len` (prompt + output) and were not sent.
        description: a short human label ("trace conversation_trace.jsonl[0:2000]", ...).
        params: the workload's settings, copied into the result JSON.
    """

    requests: list[BenchRequest]
    dropped: int = 0
    description: str = ""
    params: dict = field(default_factory=dict)


def with_arrivals(workload: Workload, arrivals_s: list[float]) -> Workload:
    """The same requests re-timed: request i arrives at `arrivals_s[i]` (e.g. a trace replayed
    at a fixed `--request-rate` instead of its own timestamps).

    Raises:
        ValueError: not one arrival per request.
    """
    if len(arrivals_s) != len(workload.requests):
        raise ValueError(f"{len(arrivals_s)} arrivals for {len(workload.requests)} requests")
    requests = [BenchRequest(r.index, r.prompt, r.output_len, t)
                for r, t in zip(workload.requests, arrivals_s)]
    return Workload(requests, workload.dropped, workload.description, dict(workload.params))
