"""The Conductor: routing over the registry with a real index, keys and admission."""

from __future__ import annotations

import pytest

from pdcluster.engine.core.hashing import block_keys, make_namespace
from pdcluster.kvstore.index import Location, MemoryIndex
from pdcluster.router.admission import SLO
from pdcluster.router.conductor import (Conductor, Instance, InstanceRegistry, NoInstanceError,
                                        PrefixKeyer, RequestRejected, RouteRequest)
from pdcluster.router.cost_model import STORIES260K_CPU
from pdcluster.router.policies.live_loads import LedgerLoads


def registry(prefills: int = 2, decodes: int = 3) -> InstanceRegistry:
    reg = InstanceRegistry()
    for i in range(prefills):
        reg.add(Instance(f"p{i}", "prefill", None))
    for i in range(decodes):
        reg.add(Instance(f"d{i}", "decode", None))
    return reg


def test_round_robin_cycles_each_role_independently():
    conductor = Conductor(registry(), "round_robin")
    picks = [conductor.route(RouteRequest(str(n), (1,))) for n in range(6)]
    assert [p.worker_id for p, _, _, _ in picks] == ["p0", "p1"] * 3
    assert [d.worker_id for _, d, _, _ in picks] == ["d0", "d1", "d2"] * 2


def test_no_instance_and_unknown_policy():
    reg = InstanceRegistry()
    reg.add(Instance("p0", "prefill", None))
    with pytest.raises(NoInstanceError):
        Conductor(reg).route(RouteRequest("r", (1,)))
    with pytest.raises(NoInstanceError):
        Conductor(reg).route_decode(RouteRequest("r", (1,)))
    with pytest.raises(ValueError, match="unknown policy"):
        Conductor(reg, "magic")
    with pytest.raises(ValueError, match="unknown admission"):
        Conductor(reg, admission="magic")


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def cache_aware_conductor(admission: str = "none", slo: SLO = SLO()):
    clock = Clock()
    index = MemoryIndex(clock=clock)
    index.heartbeat("node-a", 1e9)
    loads = LedgerLoads(STORIES260K_CPU, clock=clock)
    for p in ("p0", "p1"):
        loads.set_node(p, "node-a")
    conductor = Conductor(registry(), "kvcache_centric", loads=loads, index=index,
                          keyer=PrefixKeyer(16, "stories260K"), cost_model=STORIES260K_CPU,
                          admission=admission, slo=slo)
    return conductor, index, clock


def test_a_cached_prefix_draws_its_requests_and_load_spreads_the_rest():
    conductor, index, clock = cache_aware_conductor()
    prefix = list(range(3, 3 + 320))
    keys = block_keys(prefix, 16, make_namespace("stories260K"))
    index.add(keys, Location("node-a", "device", "p1"))
    for n in range(3):  # each finishes before the next: no queue
        p, _, _, _ = conductor.route(RouteRequest(f"s{n}", tuple(prefix + [7, n])))
        assert p.worker_id == "p1"
        conductor.prefill_done(f"s{n}")
    # a salted tenant's keys differ: no prefix is known for it
    burst = [conductor.route(RouteRequest(f"b{n}", tuple(range(100 + n, 400 + n)),
                                          cache_salt="t"))[0].worker_id for n in range(6)]
    assert burst.count("p0") == 3 and burst.count("p1") == 3


def test_rejections_raise_request_rejected_with_reason_and_retry_after():
    conductor, _, _ = cache_aware_conductor("arrival", SLO(ttft_s=0.5, tbt_s=1.0))
    admitted = 0
    with pytest.raises(RequestRejected) as info:
        for n in range(100):
            conductor.route(RouteRequest(f"r{n}", tuple(range(3, 480))))
            admitted += 1
    assert admitted >= 4  # ~0.16 s each on 2 instances fit a 0.5 s SLO a few times
    assert info.value.rejection.reason == "ttft_slo"
    assert info.value.rejection.retry_after_s >= 1
    assert isinstance(info.value, NoInstanceError)  # the pipeline's 503 path wraps it


def test_decide_over_explicit_ids_with_precomputed_keys():
    conductor, index, _ = cache_aware_conductor()
    keys = tuple(bytes([i]) * 32 for i in range(4))
    index.add(list(keys), Location("node-a", "host"))
    decision = conductor.decide(RouteRequest("r", (), block_keys=keys, num_tokens=80),
                                ["p0", "p1"], ["d0"])
    assert decision.prefill.cached_blocks == 4 and decision.decode.instance_id == "d0"
    assert decision.num_tokens == 80


def test_decode_caches_draw_their_conversations_and_no_prefill_loads_from_them():
    conductor, index, clock = cache_aware_conductor()
    history = list(range(3, 3 + 200))
    keys = block_keys(history, 16, make_namespace("stories260K"))
    index.add(keys, Location("node-a", "device", "d2"))  # the previous turn decoded on d2
    p, d, plan, local = conductor.route(RouteRequest("t2", tuple(history + [9, 9, 9])))
    assert d.worker_id == "d2"
    # a decode's device cache is no prefill's source: nothing to load, nothing planned
    assert plan.num_load_blocks == 0 and plan.locations == ()
    index.add(keys[:4], Location("node-a", "host"))
    _, _, plan, _ = conductor.route(RouteRequest("t3", tuple(history + [8])))
    assert plan.num_load_blocks == 4 and len(plan.locations) == 4
    # colocated, the decode choice sees the same caches
    assert conductor.route_decode(RouteRequest("c", tuple(history + [7]))).worker_id == "d2"
