"""The prefill engine over its KV connector (kvstore.transport.registry): prefix loads the Conductor
planned, saves to a real gRPC KV store, and the faults a connector can report. Outputs are
checked against transformers; blocks against their count before each request."""

from __future__ import annotations

import pytest

from pdcluster.engine.config import BUNDLED_MODEL, EngineConfig
from pdcluster.engine.protocol import PrefillRequest, SamplingParams
from pdcluster.kvstore.handoff import PrefixPlan
from pdcluster.engine.runner import ModelRunner
from pdcluster.kvstore.client import KVStoreClient
from pdcluster.kvstore.config import KVStoreConfig, KVTransferConfig
from pdcluster.kvstore.transport.registry import KV_CONNECTORS, connector_class, prefill_connector_names
from pdcluster.engine.core.kv_connector import KVConnector
from pdcluster.kvstore.errors import KVLoadError, KVTransferError
from pdcluster.kvstore.index import Location
from pdcluster.kvstore.transport.pool.connector import PoolConnector
from pdcluster.prefill_worker.instance import prefill as run_prefill, prefill_core, submit_prefill
from tests.engine_loops import started, stop
from tests.kvstore.faulty_connector import FaultyConnector
from tests.kvstore.lru_block_store import lru_server
from tests.handoffs import handoff
from tests.markers import starts

NODE = "node-c"
PARAMS = SamplingParams(max_tokens=2, temperature=0)


@pytest.fixture(scope="module")
@starts("server")
def store():
    server = lru_server(KVStoreConfig())
    server.start()
    client = KVStoreClient(server.address)
    yield server, client
    client.close()
    server.stop()


@pytest.fixture
def engine(store):
    """A prefill engine whose pool connector is wrapped in a FaultyConnector (no fault yet)."""
    server, client = store
    faulty = FaultyConnector(PoolConnector(NODE, client, server.address, client))
    engine = started(lambda: prefill_core(
        ModelRunner(EngineConfig(model=str(BUNDLED_MODEL), num_kv_blocks=64)), faulty, "p", 0))
    yield engine, faulty
    stop(engine)


def planned(request_id: str, prompt: list[int], keys: tuple[bytes, ...]) -> PrefillRequest:
    """The request with the plan a Conductor makes when this node's G2 holds ``keys``."""
    plan = PrefixPlan(keys, tuple((Location(NODE, "host"),) for _ in keys), len(keys))
    return PrefillRequest(request_id, tuple(prompt), PARAMS, kv_transfer_params={"prefix_plan": plan})


def test_registry_builds_every_connector_by_name():
    assert {"pool", "layer", "torch"} <= set(KV_CONNECTORS)
    for name in KV_CONNECTORS:
        assert issubclass(connector_class(name), KVConnector)
    def names(backend: str, streaming: str, tp_size: int) -> list[str]:
        transfer = KVTransferConfig(backend=backend, streaming=streaming)
        return prefill_connector_names(transfer, tp_size)
    assert names("grpc", "request", 1) == ["pool"]
    assert names("torch", "layer", 1) == ["pool", "layer", "torch"]
    assert names("mooncake", "layer", 1) == ["pool", "layer-mooncake", "mooncake"]
    assert names("grpc", "layer", 2) == ["pool"]  # per-layer needs TP=1


def test_a_planned_load_is_reused_and_a_failed_one_is_recomputed(engine, store, hf):
    engine, faulty = engine
    client = store[1]
    prompt = hf.encode("Once upon a time, there was a little girl named Lily. " * 3)
    warm = run_prefill(engine, PrefillRequest("warm", tuple(prompt), PARAMS))
    assert engine.reset_prefix_cache()  # G1 forgets: the prefix is in the store only
    free = engine.kv.num_free_blocks

    loaded = run_prefill(engine, planned("loaded", prompt, handoff(warm).block_keys))
    assert loaded.num_cached_tokens == len(handoff(warm).block_keys) * 16 > 0
    assert loaded.first_token == warm.first_token == hf.greedy(prompt, 1)[0]
    assert engine.reset_prefix_cache()

    faulty.fail_loads = True
    recomputed = run_prefill(engine, planned("recomputed", prompt, handoff(warm).block_keys))
    assert recomputed.num_cached_tokens == 0
    assert recomputed.first_token == warm.first_token
    assert engine.stats().num_prefill_tokens_total == 2 * len(prompt) + (
        len(prompt) - loaded.num_cached_tokens)
    assert engine.kv.num_free_blocks == free
    assert engine.stats().kv_load_failures_total == {"recompute": 1, "fail": 0}
    for result in (warm, loaded, recomputed):
        client.release_tail(handoff(result).tail_handle)


def test_a_failed_load_ends_the_request_under_the_fail_policy(store, hf):
    server, client = store
    faulty = FaultyConnector(PoolConnector(NODE, client, server.address, client))
    engine = started(lambda: prefill_core(
        ModelRunner(EngineConfig(model=str(BUNDLED_MODEL), num_kv_blocks=64)), faulty, "p", 0,
        kv_load_failure_policy="fail"))
    try:
        prompt = hf.encode("Tom had a small boat. He sailed it on the lake with his dad. " * 3)
        warm = run_prefill(engine, PrefillRequest("warm-f", tuple(prompt), PARAMS))
        assert engine.reset_prefix_cache()
        free = engine.kv.num_free_blocks
        faulty.fail_loads = True
        with pytest.raises(KVLoadError, match="injected load failure"):
            run_prefill(engine, planned("failed", prompt, handoff(warm).block_keys))
        assert engine.kv.num_free_blocks == free  # every block back
        assert engine.stats().kv_load_failures_total == {"recompute": 0, "fail": 1}
        faulty.fail_loads = False  # the engine goes on serving
        assert run_prefill(engine, PrefillRequest("after", tuple(prompt), PARAMS)).first_token == \
            warm.first_token
        client.release_tail(handoff(warm).tail_handle)
        client.release_tail("tail:after")
    finally:
        stop(engine)


def test_a_failed_save_fails_the_result_after_the_first_token(engine, store, hf):
    engine, faulty = engine
    faulty.fail_saves = {"lost"}
    free = engine.kv.num_free_blocks
    prompt = hf.encode("One day, a big dog named Max found a red ball in the park.")
    first, result = submit_prefill(engine, PrefillRequest("lost", tuple(prompt), PARAMS))
    assert first.result(timeout=60).token == hf.greedy(prompt, 1)[0]
    with pytest.raises(KVTransferError, match="injected save failure"):
        result.result(timeout=60)
    assert engine.kv.num_free_blocks == free
    store[1].release_tail("tail:lost")
