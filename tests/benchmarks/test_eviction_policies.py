"""Eviction policies of the cache-hit benchmark (benchmarks/eviction): lifecycle, LRU order,
leaf-first, each policy's rule, and the prefix-hit replay of PolicyCache on hand-computed traces."""

from __future__ import annotations

import random

import pytest

from benchmarks.eviction import (DEFAULT_EVICTION, EVICTION_POLICIES, ARCPolicy, LFUDAPolicy,
                                 LRUPolicy, PolicyCache, S3FIFOPolicy, make_policy)
from pdcluster.engine.core.kv_events import BlockRemoved, BlockStored

ALL = sorted(EVICTION_POLICIES)


def released(policy, *keys):
    """Insert ``keys`` as one chain (each the parent of the next) and release them tail-first."""
    parent = None
    for k in keys:
        policy.on_insert(k, parent)
        parent = k
    for k in reversed(keys):
        policy.on_release(k)


def test_registry_and_default():
    assert DEFAULT_EVICTION in EVICTION_POLICIES
    assert isinstance(make_policy("lru", 8), LRUPolicy)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("nope", 8)


@pytest.mark.parametrize("name", ALL)
def test_lifecycle_errors(name):
    p = make_policy(name, 8)
    p.on_insert("a")
    with pytest.raises(ValueError):
        p.on_insert("a")
    with pytest.raises(LookupError):
        p.victim()  # "a" is referenced
    with pytest.raises(ValueError):
        p.on_remove("a")
    p.on_release("a")
    with pytest.raises(ValueError):
        p.on_release("a")
    with pytest.raises(KeyError):
        p.on_hit("zz")
    assert len(p) == 1 and p.num_evictable == 1 and p.is_evictable("a")
    p.on_remove("a")
    assert len(p) == 0 and "a" not in p
    with pytest.raises(KeyError):
        p.on_remove("a")


@pytest.mark.parametrize("name", ALL)
def test_referenced_entries_are_never_victims(name):
    p = make_policy(name, 8)
    for k in "abcd":
        p.on_insert(k)
    for k in "bd":
        p.on_release(k)
    p.on_hit("b")  # referenced again
    assert p.victim() == "d"
    with pytest.raises(LookupError):
        p.victim()
    assert len(p) == 3 and p.num_evictable == 0


@pytest.mark.parametrize("name", ALL)
def test_leaf_first_parent_waits_for_its_children(name):
    p = make_policy(name, 8)
    released(p, "root", "mid", "leaf")
    p.on_hit("root")  # the root is the hottest, but no policy may take "mid" before "leaf"
    p.on_release("root")
    assert [p.victim(), p.victim(), p.victim()] == ["leaf", "mid", "root"]
    assert len(p) == 0


def test_lru_order_is_release_order():
    p = LRUPolicy()
    for k in "abc":
        p.on_insert(k)                  # no parents: independent entries
    for k in "cba":
        p.on_release(k)                 # c is least recent
    released(p, "x")
    p.on_hit("c")
    p.on_release("c")                   # a hit makes "c" most recent
    assert [p.victim() for _ in range(4)] == ["b", "a", "x", "c"]


def test_lru_parent_rejoins_first_in_line():
    p = LRUPolicy()
    released(p, "a", "b")
    released(p, "x")
    p.on_hit("a")
    p.on_release("a")                   # "a" is newest but still the parent of cached "b"
    assert p.victim() == "b"
    assert p.victim() == "a"            # next in line once its last child went
    assert p.victim() == "x"


def test_s3fifo_one_hit_wonder_goes_to_ghost_and_returns_to_main():
    p = S3FIFOPolicy(capacity=10, small_ratio=0.2)   # S target: 2 entries
    for k in "abc":
        p.on_insert(k)
        p.on_release(k)
    p.on_hit("a")
    p.on_release("a")
    assert p.victim() == "b"            # "a" was referenced: moved to M; "b" evicted into G
    p.on_insert("b")
    p.on_release("b")
    assert p._queue_of["b"] == 1        # a ghost hit enters M directly


def test_arc_ghost_hit_grows_t1_target():
    p = ARCPolicy(capacity=4)
    for k in "ab":
        p.on_insert(k)
        p.on_release(k)
    assert p.victim() == "a"            # T1 LRU
    assert p._p == 0
    p.on_insert("a")                    # hit in B1
    assert p._p == 1.0 and p._list["a"] == 1


def test_lfuda_frequency_and_aging():
    p = LFUDAPolicy()
    for k in "xy":
        p.on_insert(k)
        p.on_release(k)
    for _ in range(2):
        p.on_hit("x")
        p.on_release("x")
    assert p.victim() == "y"            # priority 0 + 1 < 0 + 3
    assert p._age == 1
    p.on_insert("z")
    p.on_release("z")                   # priority 1 + 1 = 2 < x's 3
    assert p.victim() == "z"
    assert LFUDAPolicy(exponent=0.5)._exponent == 0.5


def test_replay_hand_computed_lru():
    cache = PolicyCache(4, LRUPolicy())
    trace = [("A", "B", "C"),   # 0 hits; LRU (oldest first): C B A
             ("A", "B", "D"),   # 2 hits; D fits: C D B A
             ("E", "F"),        # 0 hits; evicts C then D: B A F E
             ("A", "B", "C"),   # 2 hits; A, B referenced, C evicts F: E C B A
             ("E", "F")]        # 1 hit (F was evicted); E referenced, F evicts C: B A F E
    hits = [cache.serve(r) for r in trace]
    assert hits == [0, 2, 0, 2, 1]
    assert {k for k in "ABCDEF" if k in cache} == {"A", "B", "E", "F"}
    assert len(cache) == 4 and cache.evictions == 4


def test_replay_counts_only_the_leading_prefix():
    cache = PolicyCache(8, LRUPolicy())
    assert cache.serve(("p", "q")) == 0
    assert cache.serve(("r", "q")) == 0   # "q" is cached but follows a miss: not a hit
    assert cache.serve(("p", "q")) == 2
    assert len(cache) == 3


def test_replay_events_and_capacity_check():
    cache = PolicyCache(2, LRUPolicy())
    cache.serve(("a", "b"))
    cache.serve(("c",))
    assert cache.take_events() == [BlockStored(("a", "b"), None), BlockRemoved(("b",)),
                                   BlockStored(("c",), None)]
    assert cache.take_events() == []
    with pytest.raises(ValueError, match="exceeds capacity"):
        cache.serve(("x", "y", "z"))


def random_trace(rng: random.Random, n: int) -> list[tuple]:
    """Chained keys: conversations that grow, share a system-prompt block, or branch."""
    convs: list[list[int]] = []
    out = []
    next_id = 1
    for _ in range(n):
        if convs and rng.random() < 0.6:
            conv = rng.choice(convs)
            cut = rng.randint(1, len(conv))
            conv = conv[:cut] + list(range(next_id, next_id + rng.randint(1, 4)))
            convs.append(conv)
        else:
            conv = [0] + list(range(next_id, next_id + rng.randint(1, 6)))
            convs.append(conv)
        next_id += 10
        keys, parent = [], None
        for b in conv:  # chained: a key names the whole prefix
            parent = (parent, b)
            keys.append(parent)
        out.append(tuple(keys))
    return out


@pytest.mark.parametrize("name", ALL)
def test_random_replay_invariants(name):
    rng = random.Random(7)
    trace = random_trace(rng, 400)
    cap = 40
    cache = PolicyCache(cap, make_policy(name, cap))
    held: set = set()
    for keys in trace:
        hits = cache.serve(keys)
        expected = 0
        while expected < len(keys) and keys[expected] in held:
            expected += 1
        assert hits == expected
        for event in cache.take_events():
            if isinstance(event, BlockStored):
                held.update(event.keys)
            else:
                held.difference_update(event.keys)
        assert all(k in cache for k in keys)             # the whole request ends up cached
        assert len(cache) == len(held) <= cap            # events reproduce the cached set
        assert all(k in cache for k in held)
        # leaf-first: no cached block without its parent (keys are (parent, id) pairs)
        assert all(k[0] is None or k[0] in held for k in held)
    assert cache.policy.num_evictable <= len(cache)


def test_lru_replay_matches_plain_ordered_dict():
    from collections import OrderedDict

    trace = random_trace(random.Random(3), 500)
    cap = 30
    cache = PolicyCache(cap, LRUPolicy())
    lru: OrderedDict = OrderedDict()
    for keys in trace:
        n = 0
        while n < len(keys) and keys[n] in lru:
            n += 1
        held = [k for k in keys if k in lru]
        for k in held:
            del lru[k]
        for _ in range(len(keys) - len(held)):
            if len(lru) + len(held) >= cap:
                lru.popitem(last=False)
            held.append(None)
        for k in reversed(keys):
            lru[k] = None
        assert cache.serve(keys) == n
        assert set(lru) == {k for k in lru if k in cache} and len(lru) == len(cache)


@pytest.mark.parametrize("name", ["lru", "lfuda", "lfuda_sqrt"])
def test_recency_and_frequency_orders_are_already_leaf_first(name):
    """A parent is released after its children and referenced whenever they are, so these
    policies give the same hits with or without parents: a block pool need not pass them."""
    trace = random_trace(random.Random(11), 600)
    with_parents = PolicyCache(25, make_policy(name, 25))
    without = PolicyCache(25, make_policy(name, 25), chain_aware=False)
    assert [with_parents.serve(k) for k in trace] == [without.serve(k) for k in trace]
