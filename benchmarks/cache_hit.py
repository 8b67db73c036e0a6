"""Prefix-cache hit ratio of the Mooncake conversation trace under capacity limits; no model.

Replays the ``hash_ids`` of ``conversation_trace.jsonl`` (12,031 requests, 288,500 blocks of
512 tokens, 182,790 unique) through the real cache code: each request's hash ids become chained
32-byte keys with ``engine.core.hashing.block_keys`` (one hash id per "token", block size 1; the ids
already name a prefix, the chaining keeps the keys' real form); LRU runs on
``engine.core.block_pool.BlockPool`` (its O(1) free queue), every other policy on
``benchmarks.eviction.PolicyCache``. Per request (``PolicyCache.serve``): hits = leading cached
blocks; then every block of the request is cached, the missing ones evicting; released tail-first.
Every block of the trace counts, the partial last block of a request too, as in the trace's
README (infinite cache: 36.6%).

Capacities (Mooncake FAST'25 §5 cache study): a *global* pool of C blocks against *local* pools,
``--instances`` pools of C / instances blocks each. C sweeps ``--capacities`` (fractions of the
unique-block footprint); the ``mooncake`` column is 10 instances x 3M tokens (5,859 blocks each)
against one pool of the same total. Local requests are routed round-robin or cache-aware:
Mooncake's rule, the least estimated TTFT = queued prefill work + uncached blocks / prefill rate
(``CacheAwareRouter``), each instance's cached prefix read from the global index
(``kvstore.index.MemoryIndex``) fed with the pools' ``BlockStored`` / ``BlockRemoved`` events.
With equal queues that is the longest cached prefix, ties round-robin; pure longest-prefix
routing would send every request to the first instance, as all share block 0. The
``belady (offline)`` row is the offline optimum under the same rule. ``lru+runsW`` is the
BlockPool with run window W (``--block-run-window``: runs of consecutive blocks taken from
among the W x n least recently freed), to see what that order costs in hits.

Check: the BlockPool LRU hit count equals an independent plain-``OrderedDict`` LRU simulation
exactly, for the global pool and for every local pool (on the request stream routed to it);
a mismatch exits with status 1.

    .venv/bin/python benchmarks/cache_hit.py [--eviction lru,arc] [--plot out.png]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Sequence

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root: benchmarks.*

from benchmarks.cache_hit_sim import (  # noqa: E402
    ROUTERS, BlockPoolCache, Request, infinite_cache_hits, replay, run_window_of, trace_requests)
from benchmarks.cache_hit_sweep import (  # noqa: E402
    CellResult, belady_hits, check_lru, ordered_dict_lru_hits, run_sweep, sweep_cells)
from benchmarks.eviction import DEFAULT_EVICTION, EVICTION_POLICIES  # noqa: E402
from pdcluster.loadtest.trace import read_trace  # noqa: E402

__all__ = ["BlockPoolCache", "Request", "belady_hits", "check_lru", "infinite_cache_hits",
           "main", "ordered_dict_lru_hits", "replay", "trace_requests"]  # the tests use these

DEFAULT_TRACE = (Path(__file__).resolve().parents[2]
                 / "shared/traces/mooncake/conversation_trace.jsonl")


def markdown_report(results: Sequence[CellResult], bound: float, header: str) -> str:
    columns = list(dict.fromkeys(r.cell.column for r in results))
    rows: dict[tuple[str, str], dict[str, CellResult]] = {}
    for r in results:
        rows.setdefault((r.cell.mode, r.cell.policy), {})[r.cell.column] = r
    lines = [header, "", "Block hit ratio (infinite cache: "
             f"{bound:.2%}); capacity as a fraction of the unique-block footprint", "",
             "| mode | policy | " + " | ".join(columns) + " |",
             "|---|---|" + "---:|" * len(columns)]
    for (mode, policy), by_col in rows.items():
        lines.append(f"| {mode} | {policy} | "
                     + " | ".join(f"{by_col[c].hit_ratio:.2%}" for c in columns) + " |")
    gains = [f"| {mode} | {policy} | " + " | ".join(
                 f"{by_col[c].hit_ratio / rows[mode, 'lru'][c].hit_ratio - 1:+.1%}"
                 for c in columns) + " |"
             for (mode, policy), by_col in rows.items()
             if policy != "lru" and (mode, "lru") in rows]
    if gains:
        lines += ["", "Relative gain over LRU (hit ratio / LRU's - 1)", "",
                  "| mode | policy | " + " | ".join(columns) + " |",
                  "|---|---|" + "---:|" * len(columns)] + gains
    aware = [r for r in results if r.cell.routing == "cache_aware" and r.cell.instances > 1]
    if aware:
        lines += ["", "Cache-aware routing, busiest pool's requests / mean: "
                  f"{min(r.max_load for r in aware):.2f} .. {max(r.max_load for r in aware):.2f}"]
    return "\n".join(lines)


def plot(results: Sequence[CellResult], bound: float, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r.cell.mode for r in results))
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 4), sharey=True,
                             squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for policy in dict.fromkeys(r.cell.policy for r in results):
            pts = sorted((r.cell.capacity * r.cell.instances, r.hit_ratio) for r in results
                         if r.cell.mode == mode and r.cell.policy == policy
                         and r.cell.column != "mooncake")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
        ax.axhline(bound, color="gray", linestyle="--", label="infinite cache")
        ax.set_title(mode)
        ax.set_xlabel("total capacity (blocks of 512 tokens)")
    axes[0][0].set_ylabel("block hit ratio")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--num-requests", type=int, default=None,
                        help="replay only the first N records")
    parser.add_argument("--eviction", default=",".join(EVICTION_POLICIES),
                        help=f"comma-separated policies: {', '.join(EVICTION_POLICIES)} "
                             f"(default: all; the default policy is {DEFAULT_EVICTION}), or "
                             f"lru+runsW: the BlockPool with run window W (the order in which "
                             f"a cross-layer cache's blocks are taken)")
    parser.add_argument("--capacities", default="0.05,0.1,0.2,0.3,0.5,1.0",
                        help="comma-separated fractions of the unique-block footprint")
    parser.add_argument("--instances", type=int, default=10)
    parser.add_argument("--local-tokens", type=int, default=3_000_000,
                        help="tokens per local cache for the 'mooncake' column")
    parser.add_argument("--block-tokens", type=int, default=512)
    parser.add_argument("--routing", default=",".join(ROUTERS),
                        help=f"local-mode routings, comma-separated: {', '.join(ROUTERS)}")
    parser.add_argument("--prefill-blocks-per-s", type=float, default=10.0,
                        help="per-instance prefill rate in the cache-aware router's TTFT model "
                             "(the trace brings 8.2 blocks/s per instance of 10 without hits)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--plot", default=None, help="write a PNG here")
    parser.add_argument("--chain-unaware", action="store_true",
                        help="policies other than lru may evict a block with cached children")
    parser.add_argument("--no-oracle", action="store_true",
                        help="skip the offline optimum (Belady) row of the global pool")
    args = parser.parse_args(argv)

    policies = [p for p in args.eviction.split(",") if p]
    routings = [r for r in args.routing.split(",") if r]
    for p in policies:
        if p not in EVICTION_POLICIES and run_window_of(p) is None:
            parser.error(f"unknown eviction policy {p!r}")
    for r in routings:
        if r not in ROUTERS:
            parser.error(f"unknown routing {r!r}")
    start = time.perf_counter()
    records = read_trace(args.trace, 0, args.num_requests)
    hash_id_lists = [r.hash_ids for r in records]
    total = sum(map(len, hash_id_lists))
    unique = len({h for ids in hash_id_lists for h in ids})
    bound = infinite_cache_hits(hash_id_lists) / total
    cells = sweep_cells(policies, [float(f) for f in args.capacities.split(",")], unique,
                        args.instances, args.local_tokens // args.block_tokens, routings,
                        args.prefill_blocks_per_s, not args.no_oracle, not args.chain_unaware)
    results = run_sweep(records, cells, args.jobs)
    header = (f"{len(hash_id_lists)} requests, {total} blocks, {unique} unique; "
              f"global pool vs {args.instances} local pools; 'mooncake' = {args.instances} x "
              f"{args.local_tokens // args.block_tokens} blocks ({args.local_tokens} tokens)")
    print(markdown_report(results, bound, header))
    errors = [e for r in results for e in r.errors]
    checked = sum(1 for r in results if r.cell.policy == "lru")
    print(f"\nLRU check (BlockPool == OrderedDict, every pool): "
          f"{'FAILED' if errors else 'exact'} in {checked} replays")
    for e in errors:
        print("  " + e)
    if args.plot:
        plot(results, bound, args.plot)
    print(f"{len(cells)} replays in {time.perf_counter() - start:.0f} s with {args.jobs} jobs")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
