"""Tokens a migrated request recomputes when its decode dies, with and without
`--kv-decode-publish-interval`.

For each interval (default 0, i.e. blocks go to the pool only when a sequence ends, and 4), in
a process of its own: a cluster of 1 prefill + 2 decode instances on the bundled model
(`--pd-decider always`, the embedded index), driven through its request pipeline
(router.pipeline, no HTTP). First the load runs without a fault, then again under another
cache salt (so nothing of the first run is reused), and once the streams have produced
`--kill-at` tokens each on average, the decode running the most requests gets kill -9. Its
requests move to the other decode; each migrated attempt's prompt is the original prompt +
the output so far, and its first token says how much of that its new worker loaded from the
pool (router.pipeline.Migration). Prints, per interval, the migrated requests and the tokens
they resumed with, loaded and recomputed (mean, max), and whether every output equals the
fault-free run's.

    python benchmarks/migration.py                      # intervals 0 and 4
    python benchmarks/migration.py --intervals 0,1,4 --requests 8 --kill-at 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

BUNDLED = Path(__file__).resolve().parents[1] / "engine" / "models" / "stories260K"
SUBJECTS = ["a sleepy cat", "a brave mouse", "a tall giraffe", "a lost puppy", "a red fox",
            "a tiny snail", "a happy whale", "an old owl"]


def _prompts(n: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(BUNDLED / "tokenizer.json"))
    return [tokenizer.encode(f"Once upon a time, there was {SUBJECTS[i % len(SUBJECTS)]} "
                             f"number {i} who").ids for i in range(n)]


async def _load(cluster, prompts, args, salt: str, kill: bool) -> dict:
    import ray

    from pdcluster.engine.protocol import SamplingParams

    outputs: list[list[int]] = [[] for _ in prompts]
    killed: dict = {}

    def kill_busiest() -> None:
        live = cluster.registry.by_role("decode")
        stats = ray.get([i.handle.stats.remote() for i in live], timeout=10)
        busiest = max(zip(live, stats), key=lambda p: p[1].num_active)[0]
        killed["pid"] = ray.get(busiest.handle.info.remote(), timeout=10)["pid"]
        killed["worker_id"] = busiest.worker_id
        os.kill(killed["pid"], signal.SIGKILL)

    async def one(i: int, prompt: list[int]) -> None:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=i % 2 * 1.0,
                                seed=100 + i, ignore_eos=True)
        async for delta in cluster.pipeline.generate(f"{salt}-{i}", prompt, params, salt):
            outputs[i] += delta.token_ids
            if kill and not killed and sum(map(len, outputs)) >= args.kill_at * len(prompts):
                killed["at"] = sum(map(len, outputs))  # once
                await asyncio.to_thread(kill_busiest)

    seen = len(cluster.pipeline.migrations)
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    moved = list(cluster.pipeline.migrations)[seen:]
    return {"outputs": outputs, "killed": killed,
            "migrations": [(m.num_tokens, m.num_cached_tokens) for m in moved]}


def one_setting(interval: int, args) -> dict:
    from pdcluster.deploy.config import ServeConfig
    from pdcluster.deploy.launcher import Cluster
    from pdcluster.engine.config import EngineConfig
    from pdcluster.kvstore.config import KVTransferConfig

    config = ServeConfig(prefill_instances=1, decode_instances=2, pd_decider="always",
                         ray_num_cpus=4, ray_namespace=f"pdcluster-migration-{os.getpid()}",
                         engine=EngineConfig(num_kv_blocks=512),
                         transfer=KVTransferConfig(decode_publish_interval=interval))
    prompts = _prompts(args.requests)
    with Cluster(config) as cluster:
        reference = asyncio.run(_load(cluster, prompts, args, "reference", kill=False))
        faulted = asyncio.run(_load(cluster, prompts, args, "faulted", kill=True))
    return {"interval": interval, "migrations": faulted["migrations"],
            "killed": faulted["killed"],
            "equal": faulted["outputs"] == reference["outputs"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--intervals", default="0,4",
                        help="--kv-decode-publish-interval values, in blocks (comma-separated)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=420)
    parser.add_argument("--kill-at", type=int, default=300,
                        help="kill once the streams have this many tokens each on average")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # one interval, as JSON
    args = parser.parse_args()
    if args.one is not None:
        print("RESULT " + json.dumps(one_setting(args.one, args)))
        return
    rows = []
    for interval in (int(x) for x in args.intervals.split(",")):
        command = [sys.executable, __file__, "--one", str(interval), "--requests",
                   str(args.requests), "--max-tokens", str(args.max_tokens),
                   "--kill-at", str(args.kill_at)]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.split("RESULT ", 1)[1]))
    print(f"{args.requests} requests of {args.max_tokens} tokens (half greedy, half seeded), "
          f"decode killed at ~{args.kill_at} tokens each")
    print("| publish interval | migrated | resumed with (mean) | loaded (mean) | "
          "recomputed (mean / max) | outputs equal no-fault |")
    print("|---:|---:|---:|---:|---:|---|")
    for row in rows:
        m = row["migrations"]
        resumed = [t for t, _ in m]
        recomputed = [t - c for t, c in m]
        print(f"| {row['interval'] or 'off (0)'} | {len(m)} | "
              f"{statistics.mean(resumed) if m else 0:.0f} | "
              f"{statistics.mean(c for _, c in m) if m else 0:.0f} | "
              f"{statistics.mean(recomputed) if m else 0:.1f} / {max(recomputed, default=0)} | "
              f"{'yes' if row['equal'] else 'NO'} |")


if __name__ == "__main__":
    main()
