"""The PD decider on a real cluster: short and long prompts mixed, under `--pd-decider always`,
`never` and `cost`, side by side.

The model is the random-weight 100M-parameter Llama of benchmarks/throughput.py (fp32), on
1 prefill + 1 decode instance (`--torch-threads 1` each). The Conductor's cost model is
fitted on this machine first (`pdcluster profile` on that model), so `cost` predicts with this
machine's figures. For each decider, in rotating order over `--rounds`: start `pdcluster
serve` fresh, run `pdcluster bench run` with half the prompts of 32–64 tokens and half of
400–480 (uncached: a fresh seed each run), Poisson arrivals at `--request-rate`, and stop it.

Prints per decider (mean over rounds): goodput under the SLOs (`--slo-ttft-ms`,
`--slo-tpot-ms`), median TTFT of the short and of the long prompts, median TPOT, and the
share of requests the decider kept local (from `pdcluster_pd_decisions_total`), then
`cost`'s goodput against the better of the other two and its short-prompt TTFT against
`never`'s: a decider worth having matches the better fixed choice on goodput, uses both
paths, and serves short prompts as fast as prefilling them locally.

    python benchmarks/pd_decider.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import FULL, free_port, stop_server, wait_healthy, write_model  # noqa: E402

PDCLUSTER = Path(sys.executable).parent / "pdcluster"
DECIDERS = ("always", "never", "cost")
SHORT_MAX = 64


def profile(model: Path, out: Path) -> Path:
    path = out / "cost-100m.json"
    subprocess.run([str(PDCLUSTER), "profile", "--model", str(model), "--torch-threads", "1",
                    "--num-kv-blocks", "2664", "--max-num-batched-tokens", "1024",
                    "--name", "random-100m-cpu", "--output", str(path)],
                   check=True, capture_output=True)
    return path


def decisions(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("pdcluster_pd_decisions_total{"):
            path = line.split('path="', 1)[1].split('"', 1)[0]
            out[path] = float(line.rsplit(" ", 1)[1])
    return out


def run(model: Path, cost: Path, decider: str, args, seed: int, out: Path) -> dict:
    port = free_port()
    name = f"{decider}-s{seed}"
    server = subprocess.Popen(
        [str(PDCLUSTER), "serve", "--model", str(model), "--port", str(port),
         "--num-kv-blocks", "2664", "--max-num-batched-tokens", "1024", "--torch-threads", "1",
         "--log-level", "warning", "--cost-model", str(cost), "--pd-decider", decider,
         "--slo-tbt-ms", str(args.slo_tpot_ms)],
        stdout=subprocess.DEVNULL, stderr=open(out / f"{name}.log", "ab"),
        start_new_session=True)
    try:
        wait_healthy(port, server)
        lengths = out / "lengths.csv"
        lengths.write_text(f"32,{SHORT_MAX},1\n400,480,1\n")
        before = decisions(port)
        subprocess.run([str(PDCLUSTER), "bench", "run", "--port", str(port),
                        "--tokenizer", str(model), "--input-len", f"@{lengths}",
                        "--output-len", str(args.output_len),
                        "--num-prompts", str(args.num_prompts),
                        "--request-rate", str(args.request_rate), "--seed", str(seed),
                        "--goodput", f"ttft:{args.slo_ttft_ms}", f"tpot:{args.slo_tpot_ms}",
                        "--result-dir", str(out), "--result-filename", f"{name}.json",
                        "--no-report", "--disable-tqdm"], check=True, capture_output=True)
        after = decisions(port)
        result = json.loads((out / f"{name}.json").read_text())
        result["decisions"] = {p: after.get(p, 0) - before.get(p, 0) for p in after}
        return result
    finally:
        stop_server(server)


def summary(result: dict) -> dict:
    ok = [r for r in result["requests"] if r["success"]]
    short = [r["ttft_s"] * 1000 for r in ok if r["prompt_len"] <= SHORT_MAX]
    long = [r["ttft_s"] * 1000 for r in ok if r["prompt_len"] > SHORT_MAX]
    total = sum(result["decisions"].values())
    return {"goodput": result["request_goodput"], "short_ttft": statistics.median(short),
            "long_ttft": statistics.median(long), "tpot": result["median_tpot_ms"],
            "local": result["decisions"].get("local", 0) / total if total else 0.0,
            "failed": result["failed"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=80)
    parser.add_argument("--request-rate", type=float, default=1.5)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--slo-ttft-ms", type=float, default=1500)
    parser.add_argument("--slo-tpot-ms", type=float, default=100)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {d: [] for d in DECIDERS}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        model = out / "random-llama"
        write_model(model, FULL, 0)
        cost = profile(model, out)
        print(f"cost model: {json.loads(cost.read_text())}", flush=True)
        for round_ in range(args.rounds):
            order = DECIDERS[round_ % 3:] + DECIDERS[:round_ % 3]
            for decider in order:
                loads.append(os.getloadavg()[0])
                print(f"round {round_ + 1}: {decider} ...", flush=True)
                results[decider].append(summary(run(model, cost, decider, args,
                                                    1000 + round_, out)))
                loads.append(os.getloadavg()[0])
    print(f"\n100M fp32, 1 prefill + 1 decode, {args.num_prompts} prompts (half 32-{SHORT_MAX} "
          f"tokens, half 400-480), {args.output_len} output tokens, {args.request_rate} req/s "
          f"Poisson; SLOs TTFT {args.slo_ttft_ms:g} ms, TPOT {args.slo_tpot_ms:g} ms; mean of "
          f"{args.rounds} round(s); load average {min(loads):.2f}-{max(loads):.2f}\n")
    print("| decider | goodput req/s | TTFT p50 short | TTFT p50 long | TPOT p50 | local | "
          "failed |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    mean = {d: {k: statistics.mean(r[k] for r in results[d]) for k in results[d][0]}
            for d in DECIDERS}
    for d in DECIDERS:
        m = mean[d]
        print(f"| {d} | {m['goodput']:.3f} | {m['short_ttft']:.0f} ms | {m['long_ttft']:.0f} ms "
              f"| {m['tpot']:.1f} ms | {100 * m['local']:.0f} % | {m['failed']:.0f} |")
    best = max(mean["always"]["goodput"], mean["never"]["goodput"])
    print(f"\ncost goodput / best of always, never: {mean['cost']['goodput'] / best:.2f}x; "
          f"cost short TTFT / never: "
          f"{mean['cost']['short_ttft'] / mean['never']['short_ttft']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
