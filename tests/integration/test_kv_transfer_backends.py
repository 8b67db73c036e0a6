"""Prefill engine → transfer backend → decode engine in one process (no Ray): the torch pair
path (gloo between the two engines' threads), its fallback to the KV store, draining a push
nobody fetches, aborts, and the fake backend's injected failures. Outputs against HF.

The pair between two Ray actor processes, through the launcher and the Conductor, is in
tests/multinode/test_kv_transfer_torch.py.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pdcluster.decode_worker.instance import decode_core
from pdcluster.engine.core.engine_core import EngineCore
from pdcluster.engine.core.stats import SchedulerStats
from tests.engines import submit_decode
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.protocol import (DecodeRequest, FinishReason, PrefillRequest, PrefillResult,
                                       SamplingParams)
from pdcluster.engine.runner import ModelRunner
from pdcluster.kvstore.client import KVStoreClient
from pdcluster.kvstore.transport.fetch import FetchConnector, KVFetch
from pdcluster.kvstore.config import KVStoreConfig, KVTransferConfig
from pdcluster.kvstore.transport.multi import MultiConnector
from pdcluster.kvstore.transport.pool.connector import PoolConnector
from pdcluster.kvstore.transport.torch_pair.push import TorchPushConnector
from pdcluster.kvstore.transport.base import TransferState
from tests.kvstore.fake_transfer import FakeTransferBackend
from pdcluster.prefill_worker.instance import prefill as run_prefill, prefill_core
from tests.kvstore.lru_block_store import lru_server
from tests.engine_loops import started, stop
from tests.handoffs import handoff, with_handoff
from tests.markers import starts

TORCH = KVTransferConfig(backend="torch", timeout_s=10)
STORY = ("Once upon a time, there was a little boy named Tim. Tim had a big red ball. He liked "
         "to play with it in the park every day with his friend Sue.")


@pytest.fixture(scope="module")
@starts("server")
def store():
    server = lru_server(KVStoreConfig())
    server.start()
    client = KVStoreClient(server.address)
    yield server, client
    client.close()
    server.stop()


@pytest.fixture(scope="module")
def prefill(store):
    server, client = store
    connector = MultiConnector([PoolConnector("local-node", client, server.address, client),
                                TorchPushConnector(TORCH, send_deadline_s=20, device="cpu")])
    engine = started(lambda: prefill_core(ModelRunner(EngineConfig(num_kv_blocks=128)),
                                           connector, "prefill-0", 0))
    yield engine
    stop(engine)


def decode_engine(worker_id: str, transfer: KVTransferConfig, num_kv_blocks: int = 128,
                  store=None, kv_cache_layout: str = "auto",
                  fetch: type[FetchConnector] = FetchConnector) -> EngineCore:
    runner = ModelRunner(EngineConfig(num_kv_blocks=num_kv_blocks,
                                      kv_cache_layout=kv_cache_layout))
    return started(lambda: decode_core(runner, worker_id, 0, fetch(transfer, store=store)))


@pytest.fixture(scope="module")
def decode_torch():
    engine = decode_engine("decode-t", TORCH)
    yield engine
    stop(engine)


def run_decode(decode: EngineCore, result: PrefillResult, prompt: list[int],
               params: SamplingParams, abort: bool = False):
    deltas, done = [], threading.Event()

    def emit(delta):
        deltas.append(delta)
        if delta.finish_reason is not None:
            done.set()

    submit_decode(decode, DecodeRequest(result.request_id, tuple(prompt), params, result), emit)
    if abort:
        decode.abort(result.request_id)
    assert done.wait(60)
    return [result.first_token] + [t for d in deltas for t in d.token_ids], deltas[-1]


def generate(prefill: EngineCore, decode: EngineCore, request_id: str, prompt: list[int],
             max_tokens: int = 16, **kwargs):
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    result = run_prefill(prefill, PrefillRequest(request_id, tuple(prompt), params,
                                            kv_transfer_params={"decode_peer": decode.worker_id}))
    return (result, *run_decode(decode, result, prompt, params, **kwargs))


def settled(decode: EngineCore, client: KVStoreClient, timeout_s: float = 10.0
            ) -> SchedulerStats:
    """The decode's stats once every block is free and the store holds no tail."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = decode.stats()
        if (stats.num_free_blocks == stats.num_blocks and stats.num_active == 0
                and client.stats()["num_tails"] == 0):
            return stats
        assert time.monotonic() < deadline, (stats, client.stats())
        time.sleep(0.02)


def test_torch_pair_carries_every_block_and_output_matches_hf(prefill, decode_torch, store, hf):
    _, client = store
    prompt = hf.encode(STORY)
    assert len(prompt) > 32 and len(prompt) % 16  # full blocks and a tail
    before = dict(decode_torch.stats().kv_connector_stats["kv_bytes_fetched_by_backend"])
    result, tokens, last = generate(prefill, decode_torch, "pair-1", prompt, 24)
    assert handoff(result).pair_address is not None and tokens == hf.greedy(prompt, 24)
    assert last.finish_reason is FinishReason.LENGTH
    stats = settled(decode_torch, client)  # the store's copy of the tail was released
    moved = {k: v - before.get(k, 0)
             for k, v in stats.kv_connector_stats["kv_bytes_fetched_by_backend"].items()}
    num_blocks = -(-len(prompt) // 16)
    assert moved == {"torch": num_blocks * decode_torch.runner.kv_cache.block_nbytes}
    # a second request reuses the pair, under the next tag
    again, tokens, _ = generate(prefill, decode_torch, "pair-2", prompt, 24)
    assert tokens == hf.greedy(prompt, 24)
    assert (handoff(again).pair_address, handoff(again).pair_tag) == (handoff(result).pair_address, handoff(result).pair_tag + 1)
    assert prefill.stats().kv_connector_stats["kv_pairs_opened_total"] == 1
    settled(decode_torch, client)


def test_broken_pair_falls_back_to_the_store(prefill, store, hf):
    _, client = store
    prompt = hf.encode("Lily and Ben went to the park. " + STORY)
    params = SamplingParams(max_tokens=12, temperature=0)
    transfer = KVTransferConfig(backend="torch", timeout_s=1)
    decode = decode_engine("decode-fb", transfer)
    try:
        result = run_prefill(prefill, PrefillRequest("fb", tuple(prompt), params))  # no push
        assert handoff(result).pair_address is None
        # nobody serves this pair: the torch receive fails within its 1 s setup timeout
        dead = with_handoff(result, pair_address=f"127.0.0.1:{_free_port()}")
        start = time.monotonic()
        tokens, last = run_decode(decode, dead, prompt, params)
        assert tokens == hf.greedy(prompt, 12) and last.error is None
        # the 1 s timeout ended the dead pair's attempt, not a hang (a generous 30x of it)
        assert time.monotonic() - start < 30 * transfer.timeout_s
        # the pair, then the store
        assert decode.stats().kv_connector_stats["num_fetch_retries_total"] >= 1
        stats = settled(decode, client)
        assert set(stats.kv_connector_stats["kv_bytes_fetched_by_backend"]) == {"grpc"}
    finally:
        stop(decode)


def test_abort_and_unfetched_pushes_keep_the_pair_healthy(prefill, decode_torch, store, hf):
    _, client = store
    prompt = hf.encode("The cat sat on the mat. " + STORY)
    generate(prefill, decode_torch, "pair-open", prompt, 4)  # its pair open, whatever ran before
    settled(decode_torch, client)
    pairs = prefill.stats().kv_connector_stats["kv_pairs_opened_total"]
    # aborted at once: either still waiting (the push is drained) or fetching (the receive is
    # let finish); either way the blocks come back and the pair lives on
    for i in range(3):
        _, _, last = generate(prefill, decode_torch, f"abort-{i}", prompt, 16, abort=True)
        assert last.finish_reason in (FinishReason.ABORT, FinishReason.LENGTH)
        settled(decode_torch, client)
    # finished at admission (needs more blocks than the worker has): the push is drained
    small = decode_engine("decode-small", TORCH, num_kv_blocks=4)
    try:
        result, _, last = generate(prefill, small, "too-big", prompt, 40)
        assert handoff(result).pair_address is not None
        assert last.finish_reason is FinishReason.ERROR and "KV blocks" in last.error
        short = hf.encode("The cat")
        _, tokens, _ = generate(prefill, small, "fits", short, 8)
        assert tokens == hf.greedy(short, 8)
        assert (set(settled(small, client).kv_connector_stats["kv_bytes_fetched_by_backend"])
                == {"torch"})
    finally:
        stop(small)
    _, tokens, _ = generate(prefill, decode_torch, "after-aborts", prompt, 16)
    assert tokens == hf.greedy(prompt, 16)
    # only decode-small's
    assert prefill.stats().kv_connector_stats["kv_pairs_opened_total"] == pairs + 1
    settled(decode_torch, client)


def test_injected_fetch_failure_retries_then_recomputes(prefill, store, hf):
    """Fake backend failing its first transfer: the fetch retries once (the fake's store has
    nothing: it fails again), then the decode recomputes the prompt; the output is still
    right, every reserved block is free and the store's tail released. The next transfer
    succeeds. (Timeouts and retries over real stores: tests/integration/test_transfer_faults.py.)"""
    _, client = store
    fake = FakeTransferBackend(fail_on_calls={1})
    decode = decode_engine("decode-fake", KVTransferConfig(), store=fake)
    prompt = hf.encode("One day, a big dog " + STORY)
    params = SamplingParams(max_tokens=12, temperature=0)
    try:
        first = run_prefill(prefill, PrefillRequest("fake-1", tuple(prompt), params))
        tokens, last = run_decode(decode, first, prompt, params)
        assert tokens == hf.greedy(prompt, 12) and last.error is None
        stats = settled(decode, client)
        assert stats.kv_connector_stats["num_fetch_retries_total"] == 1
        assert stats.num_fetch_recomputes_total == 1
        assert fake.calls == 2
        # the injected failure, then the retry's missing blocks: two errors, no timeout
        assert stats.kv_connector_stats["kv_transfer_errors_by_backend"] == {"fake": {"error": 2}}

        second = run_prefill(prefill, PrefillRequest("fake-2", tuple(prompt), params))
        blocks = client.get_blocks(list(handoff(second).block_keys))
        fake.blocks.update(zip(handoff(second).block_keys, blocks))
        fake.tails[handoff(second).tail_handle] = client.take_tail(handoff(second).tail_handle)
        tokens, last = run_decode(decode, second, prompt, params)
        assert tokens == hf.greedy(prompt, 12) and last.error is None
        stats = settled(decode, client)
        # the first request's blocks stayed in the decode's prefix cache: only the tail moves
        assert stats.kv_blocks_reused_total == len(handoff(second).block_keys)
        assert stats.kv_connector_stats["kv_bytes_fetched_by_backend"] == {
            "fake": 1 * decode.runner.kv_cache.block_nbytes}
        assert fake.calls == 3 and stats.num_fetch_recomputes_total == 1
    finally:
        stop(decode)


def test_abort_stops_writes_before_the_blocks_are_freed():
    runner = ModelRunner(EngineConfig(num_kv_blocks=8))
    cache = runner.kv_cache
    key = b"k" * 32
    fake = FakeTransferBackend(blocks={key: torch.ones(cache.block_nbytes, dtype=torch.uint8)},
                               delay_s=0.3)
    connector = FetchConnector(KVTransferConfig(), store=fake)
    connector.register_kv_caches(cache)
    result = {"kv_address": "127.0.0.1:1", "block_keys": (key,)}
    fetch = KVFetch(connector, "r", [3], result)
    assert fetch.poll() is TransferState.TRANSFERRING
    assert fetch.abort() is True  # nothing more will be written
    time.sleep(0.4)
    assert fetch.poll() is TransferState.FAILED and "aborted" in str(fetch.error)
    assert not cache.read_blocks([3]).any()
    assert connector.stats()["kv_bytes_fetched_total"] == 0

    done = KVFetch(connector, "r", [5], result)
    time.sleep(0.35)
    assert done.poll() is TransferState.SUCCESS
    assert torch.equal(cache.read_blocks([5])[0], torch.ones(cache.block_nbytes, dtype=torch.uint8))
    assert connector.bytes_by_backend == {"fake": cache.block_nbytes}
    connector.close()


def test_kv_transfer_flag():
    from pdcluster.deploy.cli import _overrides, _parser
    from pdcluster.deploy.config import load_config

    args = _parser().parse_args(["serve", "--kv-transfer", "torch"])
    assert load_config(None, _overrides(args)).transfer.backend == "torch"
    assert load_config(None, {}).transfer.backend == "grpc"
    for bad in ("fake", "nccl"):
        with pytest.raises(ValueError):
            load_config(None, {"transfer": {"backend": bad}})


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
