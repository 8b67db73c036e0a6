"""Decode-side publish (kvstore.transport.pool.publish): a finished sequence's reply blocks reach
the KV store under the keys a prefill computes for the next turn, which then loads them instead
of recomputing them. Prefill engine → gRPC KV store → decode engine in one process (no Ray);
outputs against transformers' greedy generate, blocks against the store and the counters."""

from __future__ import annotations

import threading
import time

import pytest

from pdcluster.decode_worker.instance import decode_core
from pdcluster.engine.core.engine_core import EngineCore
from tests.engines import submit_decode
from pdcluster.engine.config import BUNDLED_MODEL, EngineConfig
from pdcluster.engine.protocol import DecodeRequest, FinishReason, PrefillRequest, SamplingParams
from pdcluster.engine.runner import ModelRunner
from pdcluster.kvstore.client import KVStoreClient
from pdcluster.kvstore.config import KVStoreConfig, KVTransferConfig
from pdcluster.kvstore.transport.fetch import FetchConnector
from pdcluster.kvstore.handoff import PrefixPlan
from pdcluster.kvstore.transport.pool.connector import PoolConnector
from pdcluster.kvstore.transport.pool.publish import PublishConnector
from pdcluster.engine.core.hashing import block_keys, make_namespace
from pdcluster.kvstore.index import Location
from pdcluster.prefill_worker.instance import prefill as run_prefill, prefill_core
from tests.engine_loops import started, stop
from tests.kvstore.lru_block_store import lru_server
from tests.handoffs import handoff
from tests.markers import starts

NODE = "node-d"
BS = 16


class FailingStore:
    """A node store whose puts fail (a dead store actor, a full arena)."""

    def put(self, keys, blocks):
        raise ConnectionError("store unreachable")


@pytest.fixture(scope="module")
@starts("server")
def cluster():
    server = lru_server(KVStoreConfig())
    server.start()
    client = KVStoreClient(server.address)
    config = EngineConfig(model=str(BUNDLED_MODEL), num_kv_blocks=128)
    prefill = started(lambda: prefill_core(
        ModelRunner(config), PoolConnector(NODE, client, server.address, client), "p", 0))
    publisher = PublishConnector(client)
    decode = started(lambda: decode_core(ModelRunner(config), "d", 0,
                                          FetchConnector(KVTransferConfig(timeout_s=5)),
                                          publisher=publisher))
    yield prefill, decode, publisher, client
    stop(decode)
    stop(prefill)
    client.close()
    server.stop()


def run_decode(decode: EngineCore, request: DecodeRequest, abort_after: int | None = None
               ) -> list:
    """The request's TokenDeltas; with abort_after, the request is aborted once that many
    deltas came."""
    deltas, done = [], threading.Event()

    def emit(delta):
        deltas.append(delta)
        if abort_after is not None and len(deltas) == abort_after:
            decode.abort(request.request_id)
        if delta.finish_reason is not None:
            done.set()

    submit_decode(decode, request, emit)
    assert done.wait(60)
    return deltas


def offered(publisher: PublishConnector) -> int:
    stats = publisher.stats()
    return stats["kv_blocks_published_total"] + stats["kv_publish_failures_total"]


def wait_offered(publisher: PublishConnector, count: int) -> None:
    """Until `count` blocks were offered in all (the engine hands a sequence's blocks over
    just after its last delta), then until their puts ended."""
    deadline = time.monotonic() + 30
    while offered(publisher) < count:
        assert time.monotonic() < deadline, publisher.stats()
        time.sleep(0.01)
    publisher.flush(30)


def turn(cluster, request_id: str, prompt: list[int], max_tokens: int, salt: str | None = None,
         plan: PrefixPlan | None = None, abort_after: int | None = None):
    """Prefill then decode `prompt` (greedy, ignore_eos); once a normally ended sequence's
    new blocks were offered and put: (PrefillResult, every token, the last delta)."""
    prefill, decode, publisher, _ = cluster
    before = offered(publisher)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    result = run_prefill(prefill, PrefillRequest(request_id, tuple(prompt), params, salt,
                                            kv_transfer_params={"prefix_plan": plan}))
    deltas = run_decode(decode, DecodeRequest(request_id, tuple(prompt), params, result, salt),
                        abort_after)
    out = [result.first_token] + [t for d in deltas for t in d.token_ids]
    if deltas[-1].finish_reason is not FinishReason.ABORT:
        new = len(keys_of(prompt + out[:-1], salt)) - len(handoff(result).block_keys)
        wait_offered(publisher, before + new)
    return result, out, deltas[-1]


def keys_of(tokens: list[int], salt: str | None = None) -> list[bytes]:
    return block_keys(tokens, BS, make_namespace("stories260K", salt))


def test_the_next_turn_loads_the_reply_the_decode_published(cluster, hf):
    prefill, decode, publisher, client = cluster
    assert prefill.model_id == decode.model_id == "stories260K"
    prompt = hf.encode("Once upon a time, there was a little girl named Lily.")
    before = publisher.stats()["kv_blocks_published_total"]
    first, out, last = turn(cluster, "t1", prompt, 50)
    assert out == hf.greedy(prompt, 50) and last.finish_reason is FinishReason.LENGTH
    # the KV the sequence holds: prompt and every output token but the last (never fed)
    keys = keys_of(prompt + out[:-1])
    assert keys[:len(handoff(first).block_keys)] == list(handoff(first).block_keys)
    assert client.exists(keys) == [True] * len(keys)
    published = publisher.stats()["kv_blocks_published_total"] - before
    assert published == len(keys) - len(handoff(first).block_keys) > 0
    assert decode.stats().num_free_blocks == decode.stats().num_blocks

    # turn 2: the prompt is turn 1's prompt, the reply and a new message; the prefill's own
    # G1 forgets, so the reply's blocks can only come from what the decode published
    follow = prompt + out + hf.encode(" She went to the park.", add_special_tokens=False)
    assert prefill.reset_prefix_cache()
    follow_keys = keys_of(follow)
    assert follow_keys[:len(keys)] == keys
    plan = PrefixPlan(tuple(follow_keys), tuple((Location(NODE, "host"),) for _ in keys),
                      len(keys))
    second, out2, _ = turn(cluster, "t2", follow, 8, plan=plan)
    assert second.num_cached_tokens == len(keys) * BS
    assert out2 == hf.greedy(follow, 8)
    for result in (first, second):
        client.release_tail(handoff(result).tail_handle)


def test_an_aborted_sequence_publishes_nothing(cluster, hf):
    _, decode, publisher, client = cluster
    prompt = hf.encode("Tom had a small boat. He sailed it on the lake with his dad.")
    before = publisher.stats()
    result, out, last = turn(cluster, "aborted", prompt, 200, abort_after=3)
    assert last.finish_reason is FinishReason.ABORT and len(out) < 200
    # a request after it publishes: the engine has passed the aborted one's end by then
    dog = hf.encode("A dog ran in the sun.")
    later, later_out, _ = turn(cluster, "after-abort", dog, 40)
    later_new = len(keys_of(dog + later_out[:-1])) - len(handoff(later).block_keys)
    assert publisher.stats()["kv_blocks_published_total"] == \
        before["kv_blocks_published_total"] + later_new  # none of the aborted one's
    assert publisher.stats()["kv_publish_failures_total"] == before["kv_publish_failures_total"]
    produced = keys_of(prompt + out[:-1])[len(handoff(result).block_keys):]
    assert not any(client.exists(produced))
    assert decode.stats().num_free_blocks == decode.stats().num_blocks
    for r in (result, later):
        client.release_tail(handoff(r).tail_handle)


def test_published_blocks_carry_the_tenant_s_salt(cluster, hf):
    _, _, _, client = cluster
    prompt = hf.encode("Ben had a red car. He drove it to the shop to buy milk.")
    result, out, _ = turn(cluster, "salted", prompt, 40, salt="tenant-a")
    tokens = prompt + out[:-1]
    salted, plain = keys_of(tokens, "tenant-a"), keys_of(tokens)
    assert len(salted) > len(handoff(result).block_keys)
    assert client.exists(salted) == [True] * len(salted)
    assert not any(client.exists(plain))
    client.release_tail(handoff(result).tail_handle)


def test_a_failed_publish_is_counted_and_the_request_is_unharmed(hf):
    publisher = PublishConnector(FailingStore())
    config = EngineConfig(model=str(BUNDLED_MODEL), num_kv_blocks=64)
    decode = started(lambda: decode_core(ModelRunner(config), "d-fail", 0,
                                          FetchConnector(KVTransferConfig(timeout_s=5)),
                                          publisher=publisher))
    try:
        prompt = hf.encode("A cat sat on the mat and looked at the sun.")
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        deltas = run_decode(decode, DecodeRequest("colocated", tuple(prompt), params))
        out = [t for d in deltas for t in d.token_ids]
        assert out == hf.greedy(prompt, 40)
        # colocated: no prefill published anything, so every full block was offered
        expected = len(keys_of(prompt + out[:-1]))
        wait_offered(publisher, expected)
        assert publisher.stats() == {"kv_blocks_published_total": 0,
                                     "kv_bytes_published_total": 0,
                                     "kv_publish_failures_total": expected}
        assert decode.stats().num_free_blocks == decode.stats().num_blocks
    finally:
        stop(decode)


def test_with_an_interval_full_blocks_go_out_while_the_sequence_runs(cluster, hf):
    """--kv-decode-publish-interval 1: each block goes out once full, so a sequence aborted
    mid-way has published its full blocks, whole, and nothing after them."""
    _, _, _, client = cluster
    publisher = PublishConnector(client)
    config = EngineConfig(model=str(BUNDLED_MODEL), num_kv_blocks=64)
    decode = started(lambda: decode_core(ModelRunner(config), "d-interval", 0,
                                          FetchConnector(KVTransferConfig(timeout_s=5)),
                                          publisher=publisher, publish_interval=1))
    try:
        prompt = hf.encode("The little red hen found a grain of wheat in the farmyard.")
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        deltas = run_decode(decode, DecodeRequest("running", tuple(prompt), params),
                            abort_after=45)
        assert deltas[-1].finish_reason is FinishReason.ABORT
        out = [t for d in deltas for t in d.token_ids]
        assert out == hf.greedy(prompt, len(out))
        full = keys_of(prompt + out[:-1])  # every block whose KV was whole before the abort
        publisher.flush(30)
        assert publisher.stats()["kv_blocks_published_total"] == len(full) >= 3
        assert client.exists(full) == [True] * len(full)
        assert not any(client.exists(keys_of(prompt + out + [3] * 16)[len(full):]))
    finally:
        stop(decode)


def test_request_finished_refuses_keys_and_blocks_that_disagree():
    publisher = PublishConnector(FailingStore())

    class Seq:
        block_keys = (b"a" * 32, b"b" * 32)

    with pytest.raises(ValueError, match="2 block keys for 1 blocks"):
        publisher.request_finished(Seq(), [0])
    publisher.close()
