"""Reference simulations and the parallel sweep of ``benchmarks/cache_hit.py``.

``ordered_dict_lru_hits`` (an independent LRU) checks the BlockPool replays; ``belady_hits`` is
the offline optimum; a sweep is a list of ``Cell`` replays run on a process pool.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Sequence

from benchmarks.cache_hit_sim import Keys, Replay, Request, replay, trace_requests
from pdcluster.loadtest.trace import TraceRecord

ORACLE = "belady (offline)"


def ordered_dict_lru_hits(requests: Sequence[Keys], capacity: int) -> int:
    """Independent LRU reference: a plain OrderedDict, least recent first.

    Same replay rule: prefix hits, the request's cached blocks are held while its missing ones
    are inserted (the least recent other block goes), then all become most recent tail-first.
    """
    lru: OrderedDict[bytes, None] = OrderedDict()
    hits = 0
    for keys in requests:
        n = 0
        while n < len(keys) and keys[n] in lru:
            n += 1
        hits += n
        held = [k for k in keys if k in lru]
        for k in held:
            del lru[k]
        in_use = len(held)
        for _ in range(len(keys) - len(held)):
            if len(lru) + in_use >= capacity:
                lru.popitem(last=False)
            in_use += 1
        for k in reversed(keys):
            lru[k] = None
    return hits


def belady_hits(requests: Sequence[Keys], capacity: int) -> int:
    """Offline optimum (Belady's MIN) under the same replay rule, for reference.

    The victim is the unreferenced block used again furthest in the future, the deeper one on
    ties; as a block is never used without its parent, parents outlive their children.
    """
    never = len(requests)
    next_use: list[list[int]] = [[] for _ in requests]
    upcoming: dict[bytes, int] = {}
    for i in range(len(requests) - 1, -1, -1):
        next_use[i] = [upcoming.get(k, never) for k in requests[i]]
        for k in requests[i]:
            upcoming[k] = i
    cached: dict[bytes, tuple[int, int]] = {}  # unreferenced block -> (next use, depth)
    heap: list[tuple[int, int, bytes]] = []    # (-next use, -depth, key), stale items skipped
    hits = 0
    for i, keys in enumerate(requests):
        n = 0
        while n < len(keys) and keys[n] in cached:
            n += 1
        hits += n
        for k in keys:
            cached.pop(k, None)
        while len(cached) > capacity - len(keys):
            use, depth, k = heapq.heappop(heap)
            if cached.get(k) == (-use, -depth):
                del cached[k]
        for depth, (k, use) in enumerate(zip(keys, next_use[i])):
            cached[k] = (use, depth)
            heapq.heappush(heap, (-use, -depth, k))
    return hits


def check_lru(requests: Sequence[Request], result: Replay, capacity: int) -> list[str]:
    """Mismatches between a BlockPool LRU replay and the OrderedDict reference, per pool."""
    errors = []
    for n, routed in enumerate(result.routes):
        expected = ordered_dict_lru_hits([requests[i].keys for i in routed], capacity)
        if expected != result.instance_hits[n]:
            errors.append(f"capacity {capacity}, pool {n}: BlockPool {result.instance_hits[n]}"
                          f" != OrderedDict {expected}")
    return errors


@dataclass(frozen=True)
class Cell:
    """One replay of the sweep: a mode (global or local + routing), a policy, a capacity."""

    mode: str
    policy: str
    column: str
    capacity: int  # blocks per pool
    instances: int
    routing: str
    prefill_blocks_per_s: float = 10.0
    chain_aware: bool = True


@dataclass(frozen=True)
class CellResult:
    cell: Cell
    hit_ratio: float
    max_load: float  # requests of the busiest pool / mean requests per pool
    errors: tuple[str, ...]
    seconds: float


def sweep_cells(policies: Sequence[str], fractions: Sequence[float], unique_blocks: int,
                instances: int, local_blocks: int, routings: Sequence[str],
                prefill_blocks_per_s: float, oracle: bool = True, chain_aware: bool = True
                ) -> list[Cell]:
    columns = [(f"{f:.0%}", round(f * unique_blocks)) for f in fractions]
    columns.append(("mooncake", instances * local_blocks))
    modes = [("global", 1, "round_robin")] + [(f"local/{r}", instances, r) for r in routings]
    cells = [Cell(mode, policy, column, total // n, n, routing, prefill_blocks_per_s, chain_aware)
             for mode, n, routing in modes for policy in policies for column, total in columns]
    if oracle:  # after the global rows
        at = len(policies) * len(columns)
        cells[at:at] = [Cell("global", ORACLE, column, total, 1, "round_robin")
                        for column, total in columns]
    return cells


_REQUESTS: list[Request] = []  # a sweep worker's copy of the trace


def _load_worker(records: list[TraceRecord]) -> None:
    _REQUESTS[:] = trace_requests(records)


def run_cell(cell: Cell, requests: Sequence[Request] | None = None, check: bool = True
             ) -> CellResult:
    """Replay one cell; LRU cells are checked against the OrderedDict reference."""
    requests = _REQUESTS if requests is None else requests
    start = time.perf_counter()
    if cell.policy == ORACLE:
        hits = belady_hits([r.keys for r in requests], cell.capacity)
        return CellResult(cell, hits / sum(len(r.keys) for r in requests), 1.0, (),
                          time.perf_counter() - start)
    result = replay(requests, cell.policy, cell.capacity, cell.instances, cell.routing,
                    cell.prefill_blocks_per_s, cell.chain_aware)
    errors = check_lru(requests, result, cell.capacity) if check and cell.policy == "lru" else []
    loads = [len(r) for r in result.routes]
    return CellResult(cell, result.hit_ratio, max(loads) * len(loads) / max(1, sum(loads)),
                      tuple(errors), time.perf_counter() - start)


def run_sweep(records: list[TraceRecord], cells: Sequence[Cell], jobs: int) -> list[CellResult]:
    # Longest cells first (cache-aware, then small capacities) so the workers finish together.
    order = sorted(range(len(cells)), key=lambda i: (cells[i].routing != "cache_aware",
                                                     cells[i].capacity))
    if jobs <= 1:
        _load_worker(records)
        done = {i: run_cell(cells[i]) for i in order}
    else:
        with ProcessPoolExecutor(jobs, initializer=_load_worker, initargs=(records,)) as pool:
            futures = {i: pool.submit(run_cell, cells[i]) for i in order}
            done = {i: f.result() for i, f in futures.items()}
    return [done[i] for i in range(len(cells))]
