"""The PD decider (router.pd_decider) on hand-built contexts, and inside the Conductor."""

from __future__ import annotations

import pytest

from pdcluster.engine.core.hashing import block_keys, make_namespace
from pdcluster.kvstore.index import Location, MemoryIndex
from pdcluster.router.admission import SLO
from pdcluster.router.conductor import (Conductor, Instance, InstanceRegistry, PrefixKeyer,
                                        RouteRequest)
from pdcluster.router.cost_model import STORIES260K_CPU, CostModel
from pdcluster.router.pd_decider import PDDecider
from pdcluster.router.policies.base import DecodeLoad, PrefillCandidate, PrefillPlan, RouteContext

B = 16
# round numbers: a forward costs 1 ms + 1 ms per token, a step 10 ms + 1 ms per sequence,
# the transfer 2 ms + 1 ms per 1000 bytes (100 bytes per token: 0.1 ms per token)
COST = CostModel("toy", prefill_base_s=1e-3, prefill_per_token_s=1e-3, prefill_attention_s=0,
                 step_base_s=10e-3, step_per_context_token_s=0, step_per_sequence_s=1e-3,
                 kv_bytes_per_token=100, transfer_bytes_per_s=1e6, transfer_latency_s=2e-3,
                 dram_cache_tokens=10**6, decode_kv_tokens=10**6)


def decide(spec: str, tokens: int, queue_s: float = 0.0, batch: int = 0,
           cached_blocks: int = 0, slo: SLO = SLO()) -> bool:
    ctx = RouteContext("r", tokens, B, 0, (PrefillCandidate("p0", None, queue_s),),
                       (DecodeLoad("d0", batch, 0, None, cached_blocks),), COST)
    exec_s = COST.t_prefill(tokens)
    plan = PrefillPlan("p0", 0, 0, exec_s, queue_s + exec_s)
    return PDDecider.parse(spec).local(ctx, plan, ctx.decodes[0], slo)


def test_parse():
    assert str(PDDecider.parse("threshold:64")) == "threshold:64"
    assert PDDecider.parse(" cost ") == PDDecider("cost")
    for bad in ("sometimes", "threshold:", "threshold:-1", "threshold:x"):
        with pytest.raises(ValueError, match="--pd-decider"):
            PDDecider.parse(bad)


def test_always_never_and_threshold_on_tokens_the_decode_does_not_hold():
    assert decide("always", 10) is False and decide("never", 5000) is True
    assert decide("threshold:64", 64) and not decide("threshold:64", 65)
    # 100 tokens, 4 blocks (64) cached on the decode: 36 uncached
    assert decide("threshold:40", 100, cached_blocks=4)
    # at least the last token is computed: 64 cached blocks of a 64-token prompt count 3
    assert not decide("threshold:0", 64, cached_blocks=4)


def test_cost_weighs_the_stall_of_the_running_batch_against_the_remote_path():
    loose = SLO(tbt_s=0.2)
    # idle decode: local 101 ms against remote 101 ms + a 12 ms transfer
    assert decide("cost", 100)
    # 3 sequences decoding: 4 × 101 ms of delays against 113 ms
    assert not decide("cost", 100, batch=3, slo=loose)
    # ... unless the prefill instances are queued up: 4 × 101 = 404 <= 300 + 113
    assert decide("cost", 100, batch=3, queue_s=0.3, slo=loose)
    # ... and unless the stall breaks the TBT SLO: a 14 ms step + 101 ms > 100 ms
    assert not decide("cost", 100, batch=3, queue_s=0.3, slo=SLO(tbt_s=0.1))
    # a prompt mostly in the decode's cache: 4 × (1 + 20 ms) against 101 + 2 + 2 ms
    assert decide("cost", 100, batch=3, cached_blocks=5)


def test_the_conductor_counts_its_decisions_and_plans_no_prefill_for_local_ones():
    reg = InstanceRegistry()
    reg.add(Instance("p0", "prefill", None))
    reg.add(Instance("d0", "decode", None))
    index = MemoryIndex()
    index.heartbeat("n", 1e9)
    conductor = Conductor(reg, "cache_aware", index=index,
                          keyer=PrefixKeyer(B, "stories260K"), cost_model=STORIES260K_CPU,
                          pd_decider="threshold:40")
    prompt = list(range(3, 3 + 100))
    index.add(block_keys(prompt, B, make_namespace("stories260K")), Location("n", "host"))
    long = conductor.route(RouteRequest("long", tuple(prompt)))
    assert not long.local and long.kv_plan is not None
    queued = conductor.loads.prefill_queue_s("p0")
    assert queued > 0
    index.add(block_keys(prompt, B, make_namespace("stories260K")), Location("n", "device", "d0"))
    short = conductor.route(RouteRequest("short", tuple(prompt + [1, 2])))
    assert short.local and short.kv_plan is None
    assert conductor.pd_decisions == {"disaggregated": 1, "local": 1}
    # a local request takes no prefill instance's time
    assert conductor.loads.prefill_queue_s("p0") <= queued
