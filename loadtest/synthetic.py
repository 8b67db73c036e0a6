"""Synthetic load: prompts of random token ids with lengths from a distribution and an optional
shared prefix.

Length specs (`--input-len`, `--output-len`):
    "128"        fixed
    "64:256"     uniform integer in [64, 256]
    "@FILE"      a histogram file: lines `length,count` or `lo,hi,count` (a bin, drawn uniformly
                 within [lo, hi]); `#` comments and a non-numeric header line are skipped.

Shared prefix: with fraction f, the first round(f · input_len) tokens of each prompt are the
head of one of `num_prefix_groups` fixed prefixes (request i uses group i mod G), the rest are
unique to the request — so an infinite cache hits on about f of the prompt tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdcluster.loadtest.tokens import BlockTokens, TokenSpace
from pdcluster.loadtest.workload import BenchRequest, Workload


@dataclass(frozen=True)
class LengthDist:
    """A distribution over positive integer lengths: weighted bins [lo, hi], drawn uniformly
    within the chosen bin (a fixed length is one bin with lo == hi)."""

    bins: tuple[tuple[int, int], ...]
    weights: tuple[float, ...]
    spec: str = ""

    def __post_init__(self) -> None:
        if not self.bins or len(self.bins) != len(self.weights):
            raise ValueError(f"length distribution {self.spec!r}: no bins")
        if any(lo < 1 or hi < lo for lo, hi in self.bins):
            raise ValueError(f"length distribution {self.spec!r}: bins need 1 <= lo <= hi")
        if any(w < 0 for w in self.weights) or sum(self.weights) <= 0:
            raise ValueError(f"length distribution {self.spec!r}: weights must be >= 0, sum > 0")

    @property
    def max(self) -> int:
        return max(hi for _, hi in self.bins)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` lengths, int64."""
        p = np.asarray(self.weights, dtype=float)
        which = rng.choice(len(self.bins), size=n, p=p / p.sum())
        lo = np.array([self.bins[i][0] for i in which], dtype=np.int64)
        hi = np.array([self.bins[i][1] for i in which], dtype=np.int64)
        return rng.integers(lo, hi + 1) if n else np.zeros(0, dtype=np.int64)


def parse_length(spec: str) -> LengthDist:
    """Parse "N", "LO:HI" or "@FILE" (see the module docstring).

    Raises:
        ValueError: a malformed spec or file.
    """
    spec = spec.strip()
    if spec.startswith("@"):
        return _read_histogram(Path(spec[1:]), spec)
    try:
        if ":" in spec:
            lo, hi = (int(x) for x in spec.split(":", 1))
        else:
            lo = hi = int(spec)
    except ValueError as exc:
        raise ValueError(f"length spec {spec!r}: expected N, LO:HI or @FILE") from exc
    return LengthDist(bins=((lo, hi),), weights=(1.0,), spec=spec)


def _read_histogram(path: Path, spec: str) -> LengthDist:
    bins: list[tuple[int, int]] = []
    weights: list[float] = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        fields = [f.strip() for f in line.replace("\t", ",").split(",") if f.strip()]
        try:
            numbers = [float(f) for f in fields]
        except ValueError:
            if not bins and lineno == 1:
                continue  # header
            raise ValueError(f"{path}:{lineno}: not numeric: {line!r}") from None
        if len(numbers) == 2:
            bins.append((int(numbers[0]), int(numbers[0])))
        elif len(numbers) == 3:
            bins.append((int(numbers[0]), int(numbers[1])))
        else:
            raise ValueError(f"{path}:{lineno}: expected length,count or lo,hi,count")
        weights.append(numbers[-1])
    return LengthDist(bins=tuple(bins), weights=tuple(weights), spec=spec)


def synthetic_workload(num_requests: int, input_len: LengthDist, output_len: LengthDist,
                       space: TokenSpace, *, arrivals_s: list[float] | None = None,
                       shared_prefix_fraction: float = 0.0, num_prefix_groups: int = 1,
                       max_model_len: int | None = None, seed: int = 0) -> Workload:
    """`num_requests` requests; request i arrives at `arrivals_s[i]` (default all at 0).
    Requests whose prompt plus output exceeds `max_model_len` are dropped and counted.

    Raises:
        ValueError: fraction outside [0, 1], groups < 1, or arrivals of the wrong length.
    """
    if not 0.0 <= shared_prefix_fraction <= 1.0:
        raise ValueError(f"shared prefix fraction must be in [0, 1] "
                         f"(got {shared_prefix_fraction})")
    if num_prefix_groups < 1:
        raise ValueError("num_prefix_groups must be >= 1")
    arrivals_s = arrivals_s if arrivals_s is not None else [0.0] * num_requests
    if len(arrivals_s) != num_requests:
        raise ValueError(f"{len(arrivals_s)} arrivals for {num_requests} requests")
    rng = np.random.default_rng(seed)
    in_lens = input_len.sample(rng, num_requests)
    out_lens = output_len.sample(rng, num_requests)
    prefixes = BlockTokens(space, seed, namespace="prefix")
    uniques = BlockTokens(space, seed, namespace="request")
    requests: list[BenchRequest] = []
    dropped = 0
    for i in range(num_requests):
        n_in, n_out = int(in_lens[i]), int(out_lens[i])
        if max_model_len is not None and n_in + n_out > max_model_len:
            dropped += 1
            continue
        n_prefix = round(shared_prefix_fraction * n_in)
        prompt = (prefixes.get(i % num_prefix_groups, input_len.max)[:n_prefix]
                  + uniques.get(i, n_in - n_prefix))
        requests.append(BenchRequest(index=i, prompt=prompt, output_len=n_out,
                                     arrival_s=arrivals_s[i]))
    return Workload(
        requests=requests, dropped=dropped,
        description=f"synthetic in={input_len.spec} out={output_len.spec}",
        params={"num_prompts": num_requests, "input_len": input_len.spec,
                "output_len": output_len.spec, "shared_prefix_fraction": shared_prefix_fraction,
                "num_prefix_groups": num_prefix_groups, "max_model_len": max_model_len,
                "seed": seed})
