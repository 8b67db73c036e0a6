"""Layer streams over Mooncake's Transfer Engine (``--kv-streaming layer --kv-transfer
mooncake``), prefill and decode engines in one process over TE's real TCP transport: the
prefill writes each layer's piece into a leased region of its registered staging buffer while
it computes, the decode peer (announced first, as over Ray) reads the pieces over TE as they
come. Outputs against HF; regions, blocks and store tails back to baseline; a region is never
freed while its writer may still write.
"""

from __future__ import annotations

import queue
import time

import pytest

from pdcluster.decode_worker.instance import decode_core
from pdcluster.engine.core.stats import SchedulerStats
from tests.engines import fetch_of, submit_decode
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.protocol import DecodeRequest, PrefillRequest, SamplingParams
from pdcluster.engine.runner import ModelRunner
from pdcluster.kvstore.client import KVStoreClient
from pdcluster.kvstore.config import KVTransferConfig
from pdcluster.kvstore.transport.multi import MultiConnector
from pdcluster.kvstore.transport.layer_stream.connector import LayerStreamConnector
from pdcluster.kvstore.transport.pool.connector import PoolConnector
from pdcluster.engine.core.request import RequestAborted
from pdcluster.prefill_worker.instance import prefill as run_prefill, prefill_core
from tests.engine_loops import started, stop
from tests.integration.test_transfer_faults import store  # noqa: F401 — the store fixture
from tests.kvstore.local_peers import LocalStreamPeers
from tests.handoffs import handoff
from tests.tracing import TracedFetch

from tests.real_parts import MOONCAKE_HINT, import_real_part

import_real_part("mooncake.engine", "Mooncake's Transfer Engine", MOONCAKE_HINT)

from pdcluster.kvstore.transport.mooncake.connector import (  # noqa: E402
    MooncakeConnector, RegionSource, RegionStreamSender)

MOONCAKE = KVTransferConfig(backend="mooncake", streaming="layer", timeout_s=10,
                            kv_connector_extra_config={"source_buffer_bytes": 32 << 20})
STORY = ("Once upon a time, there was a little boy named Tim. Tim had a big red ball. He liked "
         "to play with it in the park every day with his friend Sue. ")
GREEDY = SamplingParams(max_tokens=16, temperature=0)


@pytest.fixture(scope="module")
def engines(store):
    """A prefill streaming layers over TE (chunks of 32 tokens) to the decode peer
    'decode-te', whose fetch connector reads them over TE."""
    server, client = store
    peers = LocalStreamPeers()
    regions = RegionSource(MOONCAKE, lease_s=60)
    prefill = started(lambda: prefill_core(
        ModelRunner(EngineConfig(num_kv_blocks=128, max_num_batched_tokens=32)),
        MultiConnector([
            PoolConnector("node-te", client, server.address, client),
            LayerStreamConnector(client, server.address, peers, "prefill-te", 10, 32, regions),
            MooncakeConnector(MOONCAKE, 60, regions)]),
        "prefill-te", 0))
    decode = started(lambda: decode_core(ModelRunner(EngineConfig(num_kv_blocks=64)),
                                          "decode-te", 0, TracedFetch(MOONCAKE),
                                          peers=peers, layer_streams=True))
    peers.workers.update({"decode-te": decode, "prefill-te": prefill})
    yield prefill, decode, regions
    stop(decode)
    stop(prefill)


def generate(prefill, decode, request_id: str, prompt: list[int], abort_after: int = 0):
    """Prefill with the decode as its stream's peer, then decode; returns (tokens, last
    delta). ``abort_after``: abort the request once that many tokens came."""
    result = run_prefill(prefill, PrefillRequest(request_id, tuple(prompt), GREEDY,
                                            kv_transfer_params={"decode_peer": "decode-te"}))
    deltas: queue.SimpleQueue = queue.SimpleQueue()
    submit_decode(decode, DecodeRequest(request_id, tuple(prompt), GREEDY, result), deltas.put)
    tokens = [result.first_token]
    while True:
        delta = deltas.get(timeout=60)
        tokens += delta.token_ids
        if abort_after and len(tokens) >= abort_after:
            decode.abort(request_id)
            abort_after = 0
        if delta.finish_reason is not None:
            return result, tokens, delta


def settled(prefill, decode, regions: RegionSource, client: KVStoreClient) -> SchedulerStats:
    deadline = time.monotonic() + 10
    while True:
        stats, pstats = decode.stats(), prefill.stats()
        regions.reclaim()
        state = (stats.num_free_blocks == stats.num_blocks, stats.num_active == 0,
                 pstats.num_free_blocks == pstats.num_blocks, regions.num_leased == 0,
                 client.stats()["num_tails"] == 0)
        if all(state):
            return stats
        assert time.monotonic() < deadline, (state, stats, client.stats())
        time.sleep(0.02)


def test_pieces_go_over_te_as_layers_end_and_output_matches_hf(engines, store, hf):
    prefill, decode, regions = engines
    _, client = store
    prompt = hf.encode("Lily and Ben went to the park. " + STORY * 3)  # several chunks
    fetched = decode.stats().kv_connector_stats["kv_bytes_fetched_by_backend"]
    before = fetched.get("layer-mooncake", 0)
    result, tokens, last = generate(prefill, decode, "te-ls-1", prompt)
    assert last.error is None and tokens == hf.greedy(prompt, 16)
    stream = handoff(result).layer_stream
    assert stream is not None and stream.region is not None and len(stream.pieces) > 10
    timings = fetch_of(decode).kv_timings["te-ls-1"]
    assert timings["paths"] == ["layer"]
    assert len(timings["arrivals"]) == len(stream.pieces)
    stats = settled(prefill, decode, regions, client)
    assert stats.kv_connector_stats["kv_bytes_fetched_by_backend"]["layer-mooncake"] - before \
        == stream.region.offsets[-1]
    assert regions.regions_released_total >= 1 and regions.regions_expired_total == 0


def test_decode_output_depends_on_the_streamed_bytes(engines, store, hf):
    """The region's bytes are what the decode uses: each piece zeroed in the prefill's buffer
    after it is written and before it is published, and the output changes."""
    prefill, decode, regions = engines
    _, client = store
    prompt = hf.encode("The cat sat on the mat. " + STORY * 2)
    expected = hf.greedy(prompt, 16)
    leases = {}
    lease, set_progress = RegionSource.lease, RegionSource.set_progress

    def recorded(self, nbytes, pinned=False):
        leased = lease(self, nbytes, pinned)
        leases[leased.word] = leased
        return leased

    def zeroed_then_published(self, word: int, value: int) -> None:
        offsets = streams["te-ls-zero"].announce.region.offsets
        leases[word].view[offsets[value - 1]:offsets[value]].zero_()
        set_progress(self, word, value)

    streams = prefill.connector.connectors[1]._streams
    RegionSource.lease, RegionSource.set_progress = recorded, zeroed_then_published
    try:
        _, tokens, last = generate(prefill, decode, "te-ls-zero", prompt)
    finally:
        RegionSource.lease, RegionSource.set_progress = lease, set_progress
    assert last.error is None and tokens[0] == expected[0] and tokens != expected
    assert fetch_of(decode).kv_timings["te-ls-zero"]["paths"] == ["layer"]
    settled(prefill, decode, regions, client)


def test_aborts_bring_every_block_and_region_back(engines, store, hf):
    """The client leaves during decode; the prefill is aborted mid-stream, once it queued its
    second piece (the decode's reserved blocks and the region come back once the decode gave the
    stream up and the writer stopped); then a request streams as before."""
    prefill, decode, regions = engines
    _, client = store
    prompt = hf.encode("A bird sang in the tree. " + STORY * 3)
    _, _, last = generate(prefill, decode, "te-ls-client-left", prompt, abort_after=3)
    settled(prefill, decode, regions, client)

    put = RegionStreamSender.put

    def abort_at_second(self, index: int, piece) -> None:
        # the compute thread queues the pieces, so the abort lands while the prompt is still
        # computing; the writer's thread may lag behind, so an abort at its progress could
        # come once every chunk was computed, when the request is only sending
        put(self, index, piece)
        if index == 1:
            prefill.abort("te-ls-mid")

    RegionStreamSender.put = abort_at_second
    try:
        with pytest.raises(RequestAborted):
            run_prefill(prefill, PrefillRequest("te-ls-mid", tuple(prompt), GREEDY,
                                           kv_transfer_params={"decode_peer": "decode-te"}))
    finally:
        RegionStreamSender.put = put
    settled(prefill, decode, regions, client)
    assert regions.regions_expired_total == 0

    _, tokens, _ = generate(prefill, decode, "te-ls-after", prompt)
    assert tokens == hf.greedy(prompt, 16)
    settled(prefill, decode, regions, client)


def test_a_released_region_is_not_freed_while_its_writer_may_write():
    regions = RegionSource(MOONCAKE.model_copy(
        update={"kv_connector_extra_config": {"source_buffer_bytes": 1 << 20}}), 60)
    regions.start()
    pinned = regions.lease(1 << 19, pinned=True)
    regions.drop(pinned)  # its reader released it: still held while pinned
    assert regions.num_leased == 1 and regions.lease(1 << 20) is None
    regions.unpin(pinned)
    assert regions.num_leased == 0
    whole = regions.lease(1 << 20)
    assert whole is not None and whole.address == pinned.address
    regions.close()
