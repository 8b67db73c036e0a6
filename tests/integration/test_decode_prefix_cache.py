"""The decode worker's own prefix cache: a finished turn's blocks stay in its device cache, the
next turn from a prefill fetches only the blocks after them (incremental transfer), and a
prompt computed on the decode (colocated) starts after them. Prefill engine → gRPC KV store →
decode engine in one process (no Ray); outputs against transformers' greedy generate."""

from __future__ import annotations

import time

import pytest

from pdcluster.decode_worker.instance import decode_core
from pdcluster.engine.config import BUNDLED_MODEL, EngineConfig
from pdcluster.engine.protocol import DecodeRequest, FinishReason, PrefillRequest, SamplingParams
from pdcluster.engine.runner import ModelRunner
from pdcluster.kvstore.client import KVStoreClient
from pdcluster.kvstore.config import KVStoreConfig, KVTransferConfig
from pdcluster.kvstore.transport.fetch import FetchConnector
from pdcluster.kvstore.transport.pool.connector import PoolConnector, PoolLoadConnector
from pdcluster.engine.core.hashing import block_keys, make_namespace
from pdcluster.engine.core.kv_events import BlockStored
from pdcluster.kvstore.index import Location, MemoryIndex
from pdcluster.prefill_worker.instance import prefill as run_prefill, prefill_core
from tests.engine_loops import started, stop
from tests.integration.test_decode_publish import run_decode
from tests.kvstore.lru_block_store import lru_server
from tests.handoffs import handoff
from tests.markers import starts

NODE = "node-c"
BS = 16


@pytest.fixture(scope="module")
@starts("server")
def engines():
    server = lru_server(KVStoreConfig())
    server.start()
    client = KVStoreClient(server.address)
    config = EngineConfig(model=str(BUNDLED_MODEL), num_kv_blocks=128)
    index = MemoryIndex()
    index.heartbeat(NODE, 600)
    prefill = started(lambda: prefill_core(
        ModelRunner(config), PoolConnector(NODE, client, server.address, client), "p", 0))
    decode = started(lambda: decode_core(ModelRunner(config), "d", 0,
                                          FetchConnector(KVTransferConfig(timeout_s=5)),
                                          index=index, node_id=NODE))
    yield prefill, decode, index
    stop(decode)
    stop(prefill)
    client.close()
    server.stop()


def keys_of(tokens: list[int]) -> list[bytes]:
    return block_keys(tokens, BS, make_namespace("stories260K", None))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def disaggregated(engines, request_id: str, prompt: list[int], n: int):
    prefill, decode, _ = engines
    result = run_prefill(prefill, PrefillRequest(request_id, tuple(prompt), greedy(n)))
    deltas = run_decode(decode, DecodeRequest(request_id, tuple(prompt), greedy(n), result))
    return result, [result.first_token] + [t for d in deltas for t in d.token_ids]


def test_the_next_turn_fetches_only_what_the_decode_does_not_hold(engines, hf):
    _, decode, index = engines
    prompt = hf.encode("Once upon a time, there was a little girl named Lily.")
    fetched = decode.stats().kv_connector_stats["kv_bytes_fetched_total"]
    first, out = disaggregated(engines, "i1", prompt, 40)
    assert out == hf.greedy(prompt, 40)
    first_bytes = decode.stats().kv_connector_stats["kv_bytes_fetched_total"] - fetched
    first_blocks = handoff(first).num_blocks
    per_block = first_bytes // first_blocks
    assert per_block * first_blocks == first_bytes > 0
    held = keys_of(prompt + out[:-1])  # the KV the finished sequence held, now cached
    mine = Location(NODE, "device", "d")
    deadline = time.monotonic() + 10  # the events go out in batches, off the loop
    while not all(mine in locs for locs in index.lookup(held)):
        assert time.monotonic() < deadline, index.lookup(held)
        time.sleep(0.02)

    follow = prompt + out + hf.encode(" She went to the park.", add_special_tokens=False)
    reused = decode.stats().kv_blocks_reused_total
    fetched = decode.stats().kv_connector_stats["kv_bytes_fetched_total"]
    second, out2 = disaggregated(engines, "i2", follow, 8)
    assert out2 == hf.greedy(follow, 8)
    skipped = decode.stats().kv_blocks_reused_total - reused
    assert skipped == len(held)
    moved = handoff(second).num_blocks - skipped
    assert (decode.stats().kv_connector_stats["kv_bytes_fetched_total"] - fetched
            == moved * per_block)
    assert 2 * moved < handoff(second).num_blocks


def test_a_prompt_computed_on_the_decode_starts_after_its_cached_blocks(engines, hf):
    _, decode, _ = engines
    prompt = hf.encode("One day, a little dog named Max found a big red ball in the garden.")
    params = greedy(12)
    first = run_decode(decode, DecodeRequest("c1", tuple(prompt), params))
    out = [t for d in first for t in d.token_ids]
    assert out == hf.greedy(prompt, 12) and first[0].num_cached_tokens == 0
    follow = prompt + out + hf.encode(" The end.", add_special_tokens=False)
    queried = decode.stats().prefix_cache_queried_tokens_total
    second = run_decode(decode, DecodeRequest("c2", tuple(follow), params))
    assert [t for d in second for t in d.token_ids] == hf.greedy(follow, 12)
    cached = len(keys_of(prompt + out[:-1])) * BS
    assert second[0].num_cached_tokens == cached > 0
    assert all(d.num_cached_tokens is None for d in second[1:])
    stats = decode.stats()
    assert stats.prefix_cache_queried_tokens_total - queried == len(follow)
    assert stats.num_free_blocks == stats.num_blocks  # cached blocks are free to evict


def test_an_aborted_sequence_leaves_no_reply_blocks_cached(engines, hf):
    _, decode, _ = engines
    prompt = hf.encode("The sun was shining and the birds were singing in the tall trees.")
    deltas = run_decode(decode, DecodeRequest("a1", tuple(prompt), greedy(60)), abort_after=30)
    assert deltas[-1].finish_reason is FinishReason.ABORT
    out = [t for d in deltas for t in d.token_ids]
    prompt_blocks = len(keys_of(prompt))
    reply_keys = keys_of(prompt + out[:-1])[prompt_blocks:]
    assert reply_keys and all(decode.pool.get_cached_block(k) is None for k in reply_keys)


@starts("server")
def test_a_prompt_computed_on_the_decode_loads_its_prefix_from_the_pool(engines, hf):
    """A decode that never saw the prompt (the PD decider kept the conversation's next turn
    local on another decode) loads what the pool holds of it, as a prefill would, and
    computes only the rest; without its pool connector it computes the whole prompt."""
    prefill, _, index = engines
    client = prefill.connector.store_client
    prompt = hf.encode("Lily and her mom went to the park to fly a big blue kite in the wind. "
                       "The kite went up and up, and Lily laughed and ran after it.")
    warm = run_prefill(prefill, PrefillRequest("pool-warm", tuple(prompt), greedy(1)))
    keys = handoff(warm).block_keys
    index.apply_events(Location(NODE, "host"), [BlockStored(keys)])  # the store's report
    config = EngineConfig(model=str(BUNDLED_MODEL), num_kv_blocks=64)
    loading = started(lambda: decode_core(
        ModelRunner(config), "d-pool", 0, FetchConnector(KVTransferConfig(timeout_s=5)),
        prefix_loader=PoolLoadConnector(NODE, None, "", client, index)))
    alone = started(lambda: decode_core(ModelRunner(config), "d-alone", 0,
                                         FetchConnector(KVTransferConfig(timeout_s=5))))
    try:
        follow = prompt + hf.encode(" They ran.", add_special_tokens=False)
        got = run_decode(loading, DecodeRequest("pool-local", tuple(follow), greedy(12)))
        want = run_decode(alone, DecodeRequest("pool-alone", tuple(follow), greedy(12)))
        assert [t for d in got for t in d.token_ids] == hf.greedy(follow, 12)
        assert [t for d in want for t in d.token_ids] == hf.greedy(follow, 12)
        assert got[0].num_cached_tokens == len(keys) * BS > 0 == want[0].num_cached_tokens
        stats = loading.stats()
        # by the tier the store reports (over gRPC in this process: "remote")
        hits = stats.prefix_cache_hit_tokens_total
        assert hits["device"] == 0 and sum(hits.values()) == len(keys) * BS
        assert stats.num_free_blocks == stats.num_blocks
    finally:
        stop(alone)
        stop(loading)
        client.release_tail(handoff(warm).tail_handle)
