"""Multi-turn chat load with a serving feature on and off: the decode worker publishing
replies to the KV pool (`--compare publish`), or incremental transfer (`--compare
incremental`: a decode holding a conversation's previous turn fetches only the rest).

For each setting (on, off), in alternating order over `--rounds`: start `pdcluster serve`
fresh (empty caches), run `pdcluster bench run --multi-turn`, stop it. Every request is
disaggregated (`--pd-decider always`). Prints, per setting, the mean over rounds of the
turns ≥ 2 hit ratio (over prompt tokens and over full-block prompt tokens, from the
per-request `cached_tokens`), the offline bound that counts replies, hit / bound, median TTFT
per turn, and the KV bytes per request moved to decode workers in all turns and in turns ≥ 2.
The latter is the run's Δ `pdcluster_kv_transfer_bytes_total` less what turn 1 moves, which is
every turn-1 prompt whole: ⌈L/16⌉ blocks of 16 tokens × the model's KV bytes per token
(2 · layers · KV heads · head dim · 4 bytes, fp32).

    python benchmarks/multi_turn.py                    # bundled stories260K, 2 prefill + 2 decode
    python benchmarks/multi_turn.py --compare incremental
    python benchmarks/multi_turn.py --model 100m --prefill 1 --decode 1 --input-len 256

`--model 100m` is the random-weight 100M-parameter Llama of benchmarks/throughput.py (fp32);
its prompts draw from that model's word-level vocabulary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import FULL, free_port, stop_server, wait_healthy, write_model  # noqa: E402

PDCLUSTER = Path(sys.executable).parent / "pdcluster"
BUNDLED = Path(__file__).resolve().parents[1] / "engine" / "models" / "stories260K"
SWITCHES = {"publish": "kv-decode-publish", "incremental": "kv-incremental-transfer"}
BLOCK = 16


def kv_bytes_per_token(model: Path) -> int:
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4


def serve(model: Path | None, args, on: bool, port: int, log: Path) -> subprocess.Popen:
    switch = SWITCHES[args.compare]
    command = [str(PDCLUSTER), "serve", "--port", str(port), "--log-level", "warning",
               "--prefill-instances", str(args.prefill), "--decode-instances", str(args.decode),
               "--pd-decider", "always", f"--{switch}" if on else f"--no-{switch}"]
    if model is not None:
        command += ["--model", str(model), "--num-kv-blocks", "2664",
                    "--max-num-batched-tokens", "1024", "--torch-threads", "1"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(log, "ab"),
                            start_new_session=True)


def bench(port: int, model: Path | None, args, out: Path, seed: int, name: str) -> dict:
    command = [str(PDCLUSTER), "bench", "run", "--multi-turn", "--port", str(port),
               "--num-conversations", str(args.conversations), "--num-turns", str(args.turns),
               "--input-len", args.input_len, "--user-len", args.user_len,
               "--output-len", str(args.output_len), "--think-time", str(args.think_time),
               "--seed", str(seed), "--result-dir", str(out), "--result-filename",
               f"{name}.json", "--no-report", "--disable-tqdm"]
    if args.max_concurrency:
        command += ["--max-concurrency", str(args.max_concurrency)]
    if model is not None:
        command += ["--tokenizer", str(model)]
    subprocess.run(command, check=True, capture_output=True)
    return json.loads((out / f"{name}.json").read_text())


def run_setting(model: Path | None, args, publish: bool, out: Path, seed: int) -> dict:
    port = free_port()
    name = f"{args.compare}-{'on' if publish else 'off'}-s{seed}"
    server = serve(model, args, publish, port, out / f"{name}.log")
    try:
        wait_healthy(port, server)
        return bench(port, model, args, out, seed, name)
    finally:
        stop_server(server)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compare", choices=tuple(SWITCHES), default="publish")
    parser.add_argument("--model", choices=("bundled", "100m"), default="bundled")
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--input-len", default="128")
    parser.add_argument("--user-len", default="8:16")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--think-time", type=float, default=0.5)
    parser.add_argument("--max-concurrency", type=int, default=None)
    args = parser.parse_args()
    results: dict[bool, list[dict]] = {True: [], False: []}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        model = None
        if args.model == "100m":
            model = Path(tmp) / "random-llama"
            write_model(model, FULL, 0)
        for round_ in range(args.rounds):
            for publish in ((True, False) if round_ % 2 == 0 else (False, True)):
                loads.append(os.getloadavg()[0])
                print(f"round {round_ + 1}: {args.compare} {'on' if publish else 'off'} ...",
                      flush=True)
                results[publish].append(run_setting(model, args, publish, Path(tmp),
                                                    seed=100 + round_))
                loads.append(os.getloadavg()[0])
        per_token = kv_bytes_per_token(model or BUNDLED)
    report(results, args, loads, per_token)
    return 0


def later_turn_bytes(result: dict, per_token: int) -> float | None:
    """KV bytes per request of turns >= 2: the run's total less every turn-1 prompt whole."""
    if result["kv_transfer_bytes"] is None:
        return None
    rows = [r for r in result["requests"] if r["success"]]
    first = sum(-(-r["prompt_len"] // BLOCK) * BLOCK * per_token for r in rows
                if r["turn"] == 1)
    later = [r for r in rows if r["turn"] >= 2]
    return (result["kv_transfer_bytes"] - first) / max(1, len(later))


def report(results: dict[bool, list[dict]], args, loads: list[float], per_token: int) -> None:
    def turn(result: dict, k) -> dict:
        return next(row for row in result["turns"] if row["turn"] == k)

    def mean(publish: bool, k, key: str) -> float:
        return statistics.mean(turn(r, k)[key] for r in results[publish])

    print(f"\n{args.model} model, {args.prefill} prefill + {args.decode} decode, "
          f"{args.conversations} conversations x {args.turns} turns, first prompt "
          f"{args.input_len}, user {args.user_len}, reply {args.output_len}, think "
          f"{args.think_time} s; mean of {args.rounds} round(s); load average "
          f"{min(loads):.2f}-{max(loads):.2f}\n")
    turns = [row["turn"] for row in results[True][0]["turns"]]
    print(f"| {args.compare} | turns >= 2 hit | of full blocks | bound | hit / bound | "
          + " | ".join(f"TTFT p50 turn {k}" for k in turns)
          + " | KV bytes / request | KV bytes / request, turns >= 2 |")
    print("|---" * (7 + len(turns)) + "|")
    for publish in (True, False):
        cells = [f"{100 * mean(publish, '2+', 'hit_ratio'):.1f} %",
                 f"{100 * mean(publish, '2+', 'hit_ratio_full_blocks'):.1f} %",
                 f"{100 * mean(publish, '2+', 'offline_bound_hit_ratio'):.1f} %",
                 f"{mean(publish, '2+', 'hit_vs_bound'):.3f}"]
        cells += [f"{mean(publish, k, 'median_ttft_ms'):.1f} ms" for k in turns]
        moved = [r["kv_transfer_bytes_per_request"] for r in results[publish]]
        cells.append(f"{statistics.mean(moved) / 1e3:.0f} kB" if None not in moved else "n/a")
        later = [later_turn_bytes(r, per_token) for r in results[publish]]
        cells.append(f"{statistics.mean(later) / 1e3:.0f} kB" if None not in later else "n/a")
        print(f"| {'on' if publish else 'off'} | " + " | ".join(cells) + " |")
    ratio = mean(True, "2+", "median_ttft_ms") / mean(False, "2+", "median_ttft_ms")
    print(f"\nturns >= 2 median TTFT, {args.compare} on / off: {ratio:.2f}x")
    later = {on: [later_turn_bytes(r, per_token) for r in results[on]] for on in (True, False)}
    if None not in later[True] + later[False]:
        print(f"turns >= 2 KV bytes per request, {args.compare} on / off: "
              f"{statistics.mean(later[True]) / statistics.mean(later[False]):.2f}x")


if __name__ == "__main__":
    sys.exit(main())
