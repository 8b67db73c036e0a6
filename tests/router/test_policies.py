"""Scheduling policies on hand-built contexts (router.policies)."""

from __future__ import annotations

import pytest

from pdcluster.kvstore.index import Location
from pdcluster.router.cost_model import MOONCAKE_70B
from pdcluster.router.policies import POLICIES, make_policy, prefix_hits
from pdcluster.router.policies.base import (DecodeLoad, PrefillCandidate, RouteContext, estimate,
                                            local_plan)
from pdcluster.router.policies.cache_aware import (CacheAwarePrefill, KVCacheCentricPrefill,
                                                   TBTDecode)

B = 512


def ctx(prefills, decodes=(DecodeLoad("d0"),), tokens=20 * B, global_blocks=0):
    return RouteContext("r", tokens, B, global_blocks, tuple(prefills), tuple(decodes),
                        MOONCAKE_70B)


def test_prefix_hits_count_own_device_blocks_and_node_tiers():
    locs = [[Location("n0", "device", "p0"), Location("n1", "host")],
            [Location("n0", "host")],
            [Location("n1", "ssd")]]
    hits = prefix_hits(locs, [("p0", "n0"), ("p1", "n0"), ("p2", "n1"), ("p3", None)])
    # another instance's device blocks do not count: p1 shares p0's node but not its G1
    assert hits == {"p0": (1, 2), "p1": (0, 0), "p2": (0, 1), "p3": (0, 0)}


def test_estimate_follows_the_cost_model():
    cand = PrefillCandidate("p0", "n0", queue_s=2.0, device_blocks=2, local_blocks=6)
    plan = estimate(ctx([cand]), cand, 6)
    cost = MOONCAKE_70B
    expected = cost.t_transfer_tokens(4 * B) + cost.t_prefill(14 * B, 6 * B)
    assert plan.exec_s == pytest.approx(expected)
    assert plan.ttft_s == pytest.approx(2.0 + expected)
    # at least one token is computed: a fully cached prompt still prefills its last block
    assert estimate(ctx([cand], tokens=6 * B), cand, 6).cached_blocks == 5


def test_cache_aware_prefers_its_prefix_until_the_queue_outweighs_it():
    holder = PrefillCandidate("p0", "n0", 0.0, 0, 16)
    other = PrefillCandidate("p1", "n1", 0.0, 0, 0)
    assert CacheAwarePrefill().select(ctx([holder, other])).instance_id == "p0"
    busy = PrefillCandidate("p0", "n0", 30.0, 0, 16)
    assert CacheAwarePrefill().select(ctx([busy, other])).instance_id == "p1"


def test_kvcache_centric_pulls_the_prefix_to_an_idle_instance():
    busy_holder = PrefillCandidate("p0", "n0", 1.0, 0, 16)
    idle = PrefillCandidate("p1", "n1", 0.0, 0, 0)
    c = ctx([busy_holder, idle], global_blocks=16)
    local = CacheAwarePrefill().select(c)
    plan = KVCacheCentricPrefill().select(c)
    assert plan.instance_id == "p1" and plan.pull and plan.pulled_blocks == 16
    assert plan.ttft_s < local.ttft_s


def test_balancing_threshold_keeps_a_nearly_as_long_local_prefix():
    cand = PrefillCandidate("p0", "n0", 0.0, 0, 12)
    c = ctx([cand], global_blocks=14)
    assert KVCacheCentricPrefill(balancing_threshold=1.0).select(c).pulled_blocks == 2
    assert KVCacheCentricPrefill(balancing_threshold=1.5).select(c).pulled_blocks == 0
    with pytest.raises(ValueError):
        KVCacheCentricPrefill(balancing_threshold=0.5)


def test_ties_go_to_the_instance_holding_the_prefix_in_device_memory():
    host_only = PrefillCandidate("p0", "n0", 0.0, 0, 4)
    device = PrefillCandidate("p1", "n0", 0.0, 4, 4)
    assert KVCacheCentricPrefill().select(ctx([host_only, device], global_blocks=4)) \
        .instance_id == "p1"


@pytest.mark.parametrize("policy", [CacheAwarePrefill, KVCacheCentricPrefill])
def test_idle_instances_share_the_requests_and_every_replica_picks_the_same(policy):
    """Equal plans go by rendezvous hashing of the request id: spread over the idle instances,
    a third instance takes about a third from the two, and two policies (two gateways) that
    see the same loads choose alike."""
    def picks(policy_, n):
        cands = [PrefillCandidate(f"p{i}", "n0", 0.0) for i in range(n)]
        return [policy_.select(RouteContext(f"cmpl-{r}", 20 * B, B, 0, tuple(cands),
                                            (DecodeLoad("d0"),), MOONCAKE_70B)).instance_id
                for r in range(300)]

    two, three = picks(policy(), 2), picks(policy(), 3)
    assert 120 <= two.count("p0") <= 180
    assert 70 <= three.count("p2") <= 130
    # a request the new instance does not take stays where it was
    assert all(b == a for a, b in zip(two, three) if b != "p2")
    assert picks(policy(), 3) == three


def test_baselines():
    cands = [PrefillCandidate(f"p{i}", None, q) for i, q in enumerate((3.0, 1.0, 2.0))]
    decodes = [DecodeLoad("d0", 4, 9000), DecodeLoad("d1", 2, 1000)]
    c = ctx(cands, decodes)
    pre, dec = make_policy("least_loaded")
    assert pre.select(c).instance_id == "p1" and dec.select(c).instance_id == "d1"
    pre, dec = make_policy("round_robin")
    assert [pre.select(c).instance_id for _ in range(4)] == ["p0", "p1", "p2", "p0"]
    assert [dec.select(c).instance_id for _ in range(3)] == ["d0", "d1", "d0"]
    a, b = make_policy("random"), make_policy("random")
    assert [a[0].select(c).instance_id for _ in range(20)] == \
        [b[0].select(c).instance_id for _ in range(20)]
    assert set(POLICIES) == {"random", "round_robin", "least_loaded", "cache_aware",
                             "kvcache_centric"}
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("magic")


def test_tbt_decode_picks_the_fastest_step_among_those_with_room():
    full = DecodeLoad("d0", 1, 100, capacity_tokens=20 * B)
    busy = DecodeLoad("d1", 30, 900_000, capacity_tokens=10**7)
    light = DecodeLoad("d2", 10, 300_000, capacity_tokens=10**7)
    plan = TBTDecode().select(ctx([PrefillCandidate("p0", None, 0)], [full, busy, light]))
    assert plan.instance_id == "d2"
    assert plan.tbt_s == pytest.approx(MOONCAKE_70B.t_step(11, 300_000 + 20 * B + 1))


def test_tbt_decode_keeps_a_request_on_its_cache_until_the_load_is_too_uneven():
    cand = [PrefillCandidate("p0", None, 0)]
    idle = DecodeLoad("d0", 0, 0, capacity_tokens=10**7)
    tbt = {"idle": MOONCAKE_70B.t_step(1, 20 * B + 1)}
    # a little busier, holding 12 of the prompt's blocks: within the slack, it wins
    holder = DecodeLoad("d1", 2, 4 * B, capacity_tokens=10**7, cached_blocks=12)
    assert MOONCAKE_70B.t_step(3, 24 * B + 1) < 1.25 * tbt["idle"]
    assert TBTDecode().select(ctx(cand, [idle, holder])).instance_id == "d1"
    assert TBTDecode(affinity_slack=0).select(ctx(cand, [idle, holder])).instance_id == "d0"
    # far busier: the fastest step wins
    swamped = DecodeLoad("d1", 60, 400_000, capacity_tokens=10**7, cached_blocks=12)
    assert TBTDecode().select(ctx(cand, [idle, swamped])).instance_id == "d0"
    # the longer cached prefix first among those near enough
    more = DecodeLoad("d2", 1, 2 * B, capacity_tokens=10**7, cached_blocks=16)
    assert TBTDecode().select(ctx(cand, [idle, holder, more])).instance_id == "d2"
    with pytest.raises(ValueError):
        TBTDecode(affinity_slack=-1)


def test_local_plan_never_pulls():
    cand = PrefillCandidate("p0", "n0", 0.0, 0, 3)
    assert local_plan(ctx([cand], global_blocks=10), cand).pulled_blocks == 0
