"""Solo-request TTFT and ITL of pdcluster and vLLM's CPU backend: one request at a time, so a
prompt's time to first token is its prefill alone, with no queue and no batch beside it.

    .venv/bin/python benchmarks/solo_ttft.py [--lengths 512,1024,1800] [--repeats 3]
        [--modes vllm,colocated,disaggregated] [--output-len 32] [--skip-vllm-install]

Servers are benchmarks/trace_vs_vllm.py's (`server_command`: the random 100M Llama, fp32,
`--threads` cores each, vLLM with its prefix cache on), started one at a time. Every prompt is
fresh random token ids (no prefix hit anywhere), sent after one short untimed request, each
length `--repeats` times, through the same client as the trace (`loadtest.runner`, streaming
/v1/completions, `ignore_eos`, concurrency 1). Prints, per length and server, the median TTFT
(s) and ITL (ms) and TTFT over vLLM's. The trace's attainment hardly moving with the rate is
what this separates out: a prompt that misses the TTFT SLO alone misses it at any rate.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))

from throughput import FULL, stop_server, write_model
from trace_vs_vllm import add_server_options, cpu_model, model_id, start_server
from vs_vllm import VLLM_VENV

from pdcluster.loadtest.client import ClientConfig
from pdcluster.loadtest.runner import RunConfig, run_benchmark
from pdcluster.loadtest.workload import BenchRequest, Workload

#: the server's KV block, for the client's offline hit count only (every prompt is fresh)
BLOCK = 32


def requests(lengths: list[int], repeats: int, output_len: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest(i, [rng.randrange(3, FULL["vocab_size"]) for _ in range(length)],
                         output_len)
            for i, length in enumerate(length for length in lengths for _ in range(repeats))]


def measure(base: str, lengths: list[int], args) -> dict[int, tuple[float, float]]:
    """{prompt length: (median TTFT s, median ITL ms)} of one request at a time."""
    client = ClientConfig(api_url=f"{base}/v1/completions", model=model_id(base), timeout_s=600)
    run = RunConfig(max_concurrency=1, percentiles=(50,), block_size=BLOCK, progress=False)
    asyncio.run(run_benchmark(Workload(requests([64], 1, 1, args.seed - 1)), client, run))
    out = {}
    for i, length in enumerate(lengths):
        workload = Workload(requests([length], args.repeats, args.output_len, args.seed + i))
        result = asyncio.run(run_benchmark(workload, client, run))
        if result["failed"]:
            raise RuntimeError(f"{result['failed']} of {args.repeats} requests failed")
        out[length] = (result["median_ttft_ms"] / 1000, result["median_itl_ms"])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="512,1024,1800", help="prompt lengths, tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--modes", default="vllm,colocated,disaggregated")
    add_server_options(parser)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    modes = args.modes.split(",")
    if "vllm" in modes and args.skip_vllm_install and not (VLLM_VENV / "bin" / "python").exists():
        parser.error(f"--skip-vllm-install: no {VLLM_VENV}")
    results: dict[str, dict[int, tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "random-llama"
        write_model(model, FULL, 0)
        for mode in modes:
            print(f"{mode} (load {os.getloadavg()[0]:.2f}) ...", flush=True)
            server, base, _ = start_server(mode, model, args, BLOCK, Path(tmp) / f"{mode}.log")
            try:
                results[mode] = measure(base, lengths, args)
            finally:
                stop_server(server)
    print(f"\n{cpu_model()}; {args.threads} cores a server, {args.dtype}, median of "
          f"{args.repeats}, {args.output_len} tokens out\n")
    print("| server | " + " | ".join(f"{n} tokens: TTFT s / ITL ms" for n in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for mode, row in results.items():
        cells = []
        for n in lengths:
            ttft, itl = row[n]
            ratio = (f" ({ttft / results['vllm'][n][0]:.2f}× vLLM)"
                     if "vllm" in results and mode != "vllm" else "")
            cells.append(f"{ttft:.3f}{ratio} / {itl:.1f}")
        print(f"| {mode} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
