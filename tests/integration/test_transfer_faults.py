"""Transfer faults: every fetch has a deadline; a timed-out or failed attempt
is retried once from another holder of the blocks, then the decode recomputes the prompt. The
output never changes and every block comes back, on both sides.

Real prefill and decode engines, a real KV store over gRPC, real threads; the faults come from
real parts too — a TCP server that accepts connections and never answers (a stalled store), a
layer-stream piece removed from the store — except one fault-injecting backend whose first
receiver never moves (a transfer that hangs until its deadline), as a fake is allowed to do.
"""

from __future__ import annotations

import queue
import time

import pytest

from pdcluster.decode_worker.instance import decode_core
from pdcluster.engine.core.engine_core import EngineCore
from pdcluster.engine.core.stats import SchedulerStats
from tests.engines import fetch_of, submit_decode
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.protocol import (KV_LOAD_FAILED, DecodeRequest, FinishReason, PrefillRequest,
                                       PrefillResult, SamplingParams)
from pdcluster.engine.runner import ModelRunner
from pdcluster.kvstore.client import KVStoreClient
from pdcluster.kvstore.config import KVStoreConfig, KVTransferConfig
from pdcluster.kvstore.transport.layer_stream.connector import LayerStreamConnector
from pdcluster.kvstore.transport.multi import MultiConnector
from pdcluster.kvstore.transport.pool.connector import PoolConnector
from pdcluster.kvstore.transport.base import KVReceiver, KVTransferBackend
from pdcluster.kvstore.transport.pool.grpc_backend import GrpcTransferBackend
from tests.kvstore.local_peers import LocalStreamPeers
from pdcluster.prefill_worker.instance import prefill as run_prefill, prefill_core
from tests.kvstore.lru_block_store import lru_server
from tests.engine_loops import started, stop
from tests.handoffs import handoff, with_handoff
from tests.markers import starts
from tests.tracing import TracedFetch

TIMEOUT_S = 1.0
STORY = ("Once upon a time, there was a little boy named Tim. Tim had a big red ball. He liked "
         "to play with it in the park every day with his friend Sue. ")
GREEDY = SamplingParams(max_tokens=16, temperature=0)
SEEDED = SamplingParams(max_tokens=16, temperature=0.9, seed=7, ignore_eos=True)


class _LostAnnounces:
    """A decode peer whose announces go nowhere (the stream's pieces wait in the store)."""

    def expect_layer_stream(self, announce) -> None:
        pass

    def cancel_layer_stream(self, request_id: str) -> None:
        pass


class _HangingReceiver(KVReceiver):
    """Fault injection: starts, then never moves; only its deadline ends it."""

    def start(self, request, dest) -> None:
        self._accept(request, dest, TIMEOUT_S)


class _HangFirst(KVTransferBackend):
    """gRPC, except that receivers number ``hang`` (1 = the first) hang."""

    name = "grpc"

    def __init__(self, config: KVTransferConfig, hang: set[int]) -> None:
        super().__init__(config)
        self.real, self.hang, self.calls = GrpcTransferBackend(config), hang, 0

    def create_receiver(self) -> KVReceiver:
        self.calls += 1
        return _HangingReceiver() if self.calls in self.hang else self.real.create_receiver()

    def close(self) -> None:
        self.real.close()


@pytest.fixture(scope="module")
@starts("server")
def store():
    """A real KV store (gRPC, no auth) and a client of it."""
    server = lru_server(KVStoreConfig(tail_ttl_s=60))
    server.start()
    try:
        with KVStoreClient(server.address) as client:
            yield server, client
    finally:
        server.stop()


@pytest.fixture(scope="module")
def prefill(store):
    """A prefill engine that streams layers (chunks of 32 tokens) to the peer 'lost'."""
    runner = ModelRunner(EngineConfig(num_kv_blocks=128, max_num_batched_tokens=32))
    server, client = store
    connector = MultiConnector([
        PoolConnector("node-f", client, server.address, client),
        LayerStreamConnector(client, server.address, LocalStreamPeers({"lost": _LostAnnounces()}),
                             "prefill-f", 10, 32)])
    engine = started(lambda: prefill_core(runner, connector, "prefill-f", 0))
    yield engine
    stop(engine)


def decode_engine(backend: KVTransferBackend | None = None,
                  kv_load_failure_policy: str = "recompute") -> EngineCore:
    runner = ModelRunner(EngineConfig(num_kv_blocks=64))
    transfer = KVTransferConfig(timeout_s=TIMEOUT_S)
    return started(lambda: decode_core(runner, "decode-f", 0,
                                        TracedFetch(transfer, store=backend),
                                        kv_load_failure_policy=kv_load_failure_policy))


def prefill_for(prefill: EngineCore, request_id: str, prompt: list[int],
                params: SamplingParams, stream: bool) -> PrefillResult:
    return run_prefill(prefill, PrefillRequest(request_id, tuple(prompt), params,
                                          kv_transfer_params={"decode_peer": "lost"} if stream else None))


def decode(engine: EngineCore, result: PrefillResult, prompt: list[int],
           params: SamplingParams) -> list[int]:
    deltas: queue.SimpleQueue = queue.SimpleQueue()
    submit_decode(engine, DecodeRequest(result.request_id, tuple(prompt), params, result),
                       deltas.put)
    tokens = [result.first_token]
    while True:
        delta = deltas.get(timeout=60)
        tokens += delta.token_ids
        if delta.finish_reason is not None:
            assert delta.error is None, delta.error
            return tokens


def assert_settled(engine: EngineCore, prefill: EngineCore, client: KVStoreClient
                   ) -> SchedulerStats:
    deadline = time.monotonic() + 10
    while True:
        stats, pstats = engine.stats(), prefill.stats()
        state = (stats.num_free_blocks == stats.num_blocks, stats.num_active == 0,
                 pstats.num_free_blocks == pstats.num_blocks,
                 client.stats()["num_tails"] == 0)
        if all(state):
            return stats
        assert time.monotonic() < deadline, (state, stats, client.stats())
        time.sleep(0.02)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_hung_transfer_times_out_and_the_retry_succeeds(prefill, store, hf, params):
    _, client = store
    prompt = hf.encode(STORY * 2)
    clean_engine, faulty = decode_engine(), _HangFirst(KVTransferConfig(timeout_s=TIMEOUT_S),
                                                       hang={1})
    engine = decode_engine(faulty)
    try:
        want = decode(clean_engine, prefill_for(prefill, "clean", prompt, params, False),
                      prompt, params)
        start = time.monotonic()
        got = decode(engine, prefill_for(prefill, "hung", prompt, params, False), prompt, params)
        assert got == want and time.monotonic() - start >= TIMEOUT_S  # waited for the deadline
        if params is GREEDY:
            assert got == hf.greedy(prompt, 16)
        stats = assert_settled(engine, prefill, client)
        assert stats.kv_connector_stats["num_fetch_retries_total"] == 1
        assert stats.num_fetch_recomputes_total == 0
        assert faulty.calls == 2 and fetch_of(engine).kv_timings["hung"]["paths"] == ["grpc", "grpc"]
        assert stats.kv_connector_stats["kv_transfer_errors_by_backend"] == {"grpc": {"timeout": 1}}
        clean = assert_settled(clean_engine, prefill, client)
        assert clean.kv_connector_stats["kv_transfer_errors_by_backend"] == {}
    finally:
        stop(engine)
        stop(clean_engine)


def test_stalled_store_is_retried_then_the_prompt_recomputed(prefill, store, hf,
                                                             stalled_address):
    _, client = store
    prompt = hf.encode(STORY * 3)
    engine = decode_engine()
    try:
        for params in (GREEDY, SEEDED):
            want = decode(engine, prefill_for(prefill, f"ok-{params.temperature}", prompt,
                                              params, False), prompt, params)
            result = prefill_for(prefill, f"stalled-{params.temperature}", prompt, params, False)
            client.release_tail(handoff(result).tail_handle)  # the stalled store is the only holder
            stalled = with_handoff(result, kv_address=stalled_address)
            assert decode(engine, stalled, prompt, params) == want
            timings = fetch_of(engine).kv_timings[result.request_id]
            assert timings["paths"] == ["grpc", "grpc"] and timings["failed"] is True
            if params is GREEDY:
                assert want == hf.greedy(prompt, 16)
        stats = assert_settled(engine, prefill, client)
        assert (stats.num_fetch_recomputes_total
                == 2 and stats.kv_connector_stats["num_fetch_retries_total"] == 2)
        # the first request left the prompt's full blocks in the decode's own prefix cache:
        # the three after it fetch only the rest, and the stalled ones recompute only that
        cached = (len(prompt) - 1) // 16 * 16
        assert stats.kv_blocks_reused_total == 3 * cached // 16
        assert stats.num_recomputed_tokens_total == 2 * (len(prompt) - cached)
        assert stats.kv_load_failures_total == {"recompute": 2, "fail": 0}
        # both attempts of both requests passed their deadline on the stalled store
        assert stats.kv_connector_stats["kv_transfer_errors_by_backend"] == {"grpc": {"timeout": 4}}
    finally:
        stop(engine)


def test_under_the_fail_policy_a_failed_fetch_ends_the_request(prefill, store, hf,
                                                               stalled_address):
    _, client = store
    prompt = hf.encode(STORY * 3)
    engine = decode_engine(kv_load_failure_policy="fail")
    try:
        result = prefill_for(prefill, "stalled-fail", prompt, GREEDY, False)
        client.release_tail(handoff(result).tail_handle)  # the stalled store is the only holder
        deltas: queue.SimpleQueue = queue.SimpleQueue()
        submit_decode(engine, DecodeRequest(result.request_id, tuple(prompt), GREEDY,
                                         with_handoff(result, kv_address=stalled_address)),
                           deltas.put)
        delta = deltas.get(timeout=60)
        assert delta.finish_reason is FinishReason.ERROR and delta.token_ids == ()
        assert delta.error_code == KV_LOAD_FAILED and "KV load failed" in delta.error
        stats = assert_settled(engine, prefill, client)  # every block back, on both sides
        assert stats.kv_load_failures_total == {"recompute": 0, "fail": 1}
        assert stats.num_fetch_recomputes_total == 0 and stats.num_recomputed_tokens_total == 0
        # the engine goes on serving
        ok = prefill_for(prefill, "after-fail", prompt, GREEDY, False)
        assert decode(engine, ok, prompt, GREEDY) == hf.greedy(prompt, 16)
    finally:
        stop(engine)


def test_stalled_layer_stream_falls_back_to_the_store(prefill, store, hf):
    """A piece of the layer stream never comes (removed from the store): the stream times out
    TIMEOUT_S after its last piece, the pieces left are dropped, and the request's KV comes
    from the store's keyed blocks and tail."""
    _, client = store
    prompt = hf.encode("Lily and Ben went to the park. " + STORY * 3)  # nothing cached
    engine = decode_engine()
    try:
        result = prefill_for(prefill, "ls-stall", prompt, GREEDY, True)
        stream = handoff(result).layer_stream
        assert stream is not None and len(stream.pieces) > 10
        middle = len(stream.pieces) // 2
        assert client.release_tail(stream.handle(middle))
        assert decode(engine, result, prompt, GREEDY) == hf.greedy(prompt, 16)
        timings = fetch_of(engine).kv_timings["ls-stall"]
        assert timings["paths"] == ["layer", "grpc"] and "failed" not in timings
        assert len(timings["arrivals"]) == middle  # every piece before the missing one
        stats = assert_settled(engine, prefill, client)  # the pieces after it were dropped
        assert stats.kv_connector_stats["num_fetch_retries_total"] == 1
        assert stats.num_fetch_recomputes_total == 0
    finally:
        stop(engine)
