"""benchmarks/cache_hit.py on the first 1,500 Mooncake trace records: the BlockPool LRU equals a
plain OrderedDict LRU exactly, and an unbounded cache hits exactly the trace's block reuse."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from benchmarks.eviction import DEFAULT_EVICTION, LRUPolicy, PolicyCache
from pdcluster.loadtest.trace import read_trace

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT.parent / "shared/traces/mooncake/conversation_trace.jsonl"
N = 1500


def _load_bench():
    path = ROOT / "benchmarks/cache_hit.py"
    spec = importlib.util.spec_from_file_location("cache_hit_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


@pytest.fixture(scope="module")
def records():
    if not TRACE.exists():
        pytest.skip(f"{TRACE} not present")
    return read_trace(TRACE, 0, N)


@pytest.fixture(scope="module")
def requests(records):
    return bench.trace_requests(records)


def reuse_by_hand(records) -> tuple[int, int]:
    """Blocks whose hash id appeared before, and all blocks: the infinite-cache bound."""
    seen, reused, total = set(), 0, 0
    for r in records:
        for h in r.hash_ids:
            reused += h in seen
            total += 1
            seen.add(h)
    return reused, total


def test_keys_are_chained_and_shared_exactly_where_hash_ids_are(records, requests):
    by_id = {}
    for r, req in zip(records, requests):
        assert len(req.keys) == len(r.hash_ids)
        for h, k in zip(r.hash_ids, req.keys):
            assert len(k) == 32
            assert by_id.setdefault(h, k) == k
    assert len(set(by_id.values())) == len(by_id)


def test_lru_blockpool_equals_ordered_dict_global_and_local(records, requests):
    unique = len({h for r in records for h in r.hash_ids})
    capacity = unique // 10
    result = bench.replay(requests, "lru", capacity)
    expected = bench.ordered_dict_lru_hits([r.keys for r in requests], capacity)
    assert result.hits == expected > 0
    policy_cache = PolicyCache(capacity, LRUPolicy())
    assert sum(policy_cache.serve(r.keys) for r in requests) == expected
    for routing in ("round_robin", "cache_aware"):
        local = bench.replay(requests, "lru", capacity // 4, instances=4, routing=routing)
        assert sorted(i for route in local.routes for i in route) == list(range(N))
        assert bench.check_lru(requests, local, capacity // 4) == []
        assert local.hits == sum(local.instance_hits)


def test_hand_computed_trace_on_blockpool():
    reqs = [bench.Request(0.0, tuple(k.encode() * 32 for k in r))
            for r in ("ABC", "ABD", "EF", "ABC", "EF")]
    cache = bench.BlockPoolCache(4)
    assert [cache.serve(r.keys) for r in reqs] == [0, 2, 0, 2, 1]
    assert bench.ordered_dict_lru_hits([r.keys for r in reqs], 4) == 3 + 2


@pytest.mark.parametrize("policy", sorted({"lru", DEFAULT_EVICTION}))
def test_infinite_capacity_hits_equal_trace_reuse(records, requests, policy):
    reused, total = reuse_by_hand(records)
    assert bench.infinite_cache_hits([r.hash_ids for r in records]) == reused
    result = bench.replay(requests, policy, capacity=total)
    assert (result.hits, result.blocks) == (reused, total)


def test_policies_bounded_by_belady(records, requests):
    reused, total = reuse_by_hand(records)
    capacity = total // 20
    oracle = bench.belady_hits([r.keys for r in requests], capacity)
    assert bench.belady_hits([r.keys for r in requests], total) == reused
    for policy in ("lru", DEFAULT_EVICTION):
        assert bench.replay(requests, policy, capacity).hits <= oracle <= reused


def test_cache_aware_routing_beats_round_robin_and_spreads_load(requests):
    capacity = 2000
    rr = bench.replay(requests, "lru", capacity, instances=4, routing="round_robin")
    aware = bench.replay(requests, "lru", capacity, instances=4, routing="cache_aware")
    assert aware.hits > rr.hits
    assert max(len(r) for r in aware.routes) < 0.5 * N


def test_main_prints_table_and_passes_check(capsys):
    if not TRACE.exists():
        pytest.skip(f"{TRACE} not present")
    code = bench.main(["--trace", str(TRACE), "--num-requests", "300", "--eviction",
                       f"lru,{DEFAULT_EVICTION}", "--capacities", "0.2,1.0", "--instances", "3",
                       "--local-tokens", "300000", "--jobs", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "| global | lru |" in out and "| local/cache_aware |" in out
    assert "LRU check (BlockPool == OrderedDict, every pool): exact" in out
