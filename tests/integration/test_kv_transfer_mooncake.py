"""Prefill engine → Mooncake Transfer Engine → decode engine in one process (no Ray), over TE's
real TCP transport: the read into the decode's registered cache and through host staging, the
region's release and lease, the fallback to the KV store when the source is gone or its lease
too short, a full staging buffer, aborts, and the quarantine of blocks a read may still write
(TE slowed down by a wrapper: a real TE read cannot be made slow on demand). Outputs against HF.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import random
import signal
import threading
import time

import psutil
import pytest
import torch

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.core.stats import SchedulerStats
from pdcluster.engine.kv_cache import PagedKVCache
from pdcluster.engine.kv_cache_spec import KVCacheSpec
from pdcluster.engine.protocol import PrefillRequest, SamplingParams
from pdcluster.engine.runner import ModelRunner
from pdcluster.kvstore.config import KVTransferConfig
from pdcluster.kvstore.transport.fetch import FetchConnector, KVFetch
from pdcluster.kvstore.transport.multi import MultiConnector
from pdcluster.kvstore.errors import BlockLayoutError, KVTransferError
from pdcluster.kvstore.transport.base import FetchRequest, TransferState
from pdcluster.kvstore.transport.dest import CacheDest
from pdcluster.kvstore.transport.pool.connector import PoolConnector
from pdcluster.prefill_worker.instance import prefill as run_prefill, prefill_core
from pdcluster.engine.core.engine_core import EngineCore
from tests.engine_loops import started, stop
from tests.engines import fetch_of
from tests.faults import PerturbingFetch
from tests.integration.test_kv_transfer_backends import (  # noqa: F401 — the store fixture
    STORY, _free_port, decode_engine, generate, run_decode, settled, store)
from tests.handoffs import handoff, with_handoff

from tests.real_parts import MOONCAKE_HINT, import_real_part

import_real_part("mooncake.engine", "Mooncake's Transfer Engine", MOONCAKE_HINT)

from pdcluster.kvstore.transport.mooncake import backend as mooncake  # noqa: E402
from pdcluster.kvstore.transport.mooncake.backend import MooncakeTransferBackend, RemoteRegion  # noqa: E402
from pdcluster.kvstore.transport.mooncake.connector import MooncakeConnector, RegionAllocator  # noqa: E402
from pdcluster.kvstore.transport.mooncake.settings import MooncakeSettings  # noqa: E402

MOONCAKE = KVTransferConfig(backend="mooncake", timeout_s=10,
                            kv_connector_extra_config={"source_buffer_bytes": 32 << 20})


def prefill_engine(store, transfer: KVTransferConfig, lease_s: float = 60.0,
                   kv_cache_layout: str = "auto") -> EngineCore:
    server, client = store
    connector = MultiConnector([PoolConnector("local-node", client, server.address, client),
                                MooncakeConnector(transfer, lease_s)])
    config = EngineConfig(num_kv_blocks=128, kv_cache_layout=kv_cache_layout)
    return started(lambda: prefill_core(ModelRunner(config), connector, "prefill-mc", 0))


@pytest.fixture(scope="module")
def prefill(store):
    engine = prefill_engine(store, MOONCAKE)
    yield engine
    stop(engine)


@pytest.fixture(scope="module")
def decode():
    engine = decode_engine("decode-mc", MOONCAKE)
    yield engine
    stop(engine)


def released(prefill: EngineCore, count: int, timeout_s: float = 30.0) -> SchedulerStats:
    """The prefill's stats once ``count`` regions were released (its loop reclaims them);
    ``timeout_s`` only against a region never released: generous for a loaded machine."""
    deadline = time.monotonic() + timeout_s
    while ((stats := prefill.stats())
           .kv_connector_stats["kv_mooncake_regions_released_total"] < count):
        assert time.monotonic() < deadline, stats
        time.sleep(0.02)
    return stats


def test_te_carries_every_block_into_the_cache_and_output_matches_hf(prefill, decode, store,
                                                                       hf):
    _, client = store
    prompt = hf.encode(STORY)
    assert len(prompt) > 32 and len(prompt) % 16  # full blocks and a tail
    before = dict(decode.stats().kv_connector_stats["kv_bytes_fetched_by_backend"])
    base = prefill.stats().kv_connector_stats["kv_mooncake_regions_released_total"]
    result, tokens, _ = generate(prefill, decode, "mc-1", prompt, 24)
    assert isinstance(handoff(result).kv_region, RemoteRegion) and tokens == hf.greedy(prompt, 24)
    stats = settled(decode, client)  # every block back, the store's tail released
    moved = {k: v - before.get(k, 0)
             for k, v in stats.kv_connector_stats["kv_bytes_fetched_by_backend"].items()}
    num_blocks = -(-len(prompt) // 16)
    assert moved == {"mooncake": num_blocks * decode.runner.kv_cache.block_nbytes}
    assert released(prefill, base + 1).kv_connector_stats["kv_mooncake_regions_leased"] == 0


def test_cross_layer_caches_move_whole_blocks_and_output_matches_hf(store, hf):
    """Both workers on cross-layer caches (what `serve --kv-transfer mooncake` picks): the
    region is block-major, read straight into the decode's registered cache, and the decode
    continues token for token as HF."""
    _, client = store
    prefill = prefill_engine(store, MOONCAKE, kv_cache_layout="cross-layer")
    decode = decode_engine("decode-mc-cross", MOONCAKE, kv_cache_layout="cross-layer")
    try:
        prompt = hf.encode(STORY)
        result, tokens, _ = generate(prefill, decode, "mc-cross", prompt, 24)
        assert isinstance(handoff(result).kv_region, RemoteRegion) and handoff(result).kv_region.block_major
        assert tokens == hf.greedy(prompt, 24)
        stats = settled(decode, client)
        assert stats.kv_connector_stats["kv_bytes_fetched_by_backend"] == {
            "mooncake": -(-len(prompt) // 16) * decode.runner.kv_cache.block_nbytes}
        assert released(prefill, 1).kv_connector_stats["kv_mooncake_regions_leased"] == 0
    finally:
        stop(decode)
        stop(prefill)


def test_decode_output_depends_on_the_bytes_te_moved(prefill, store, hf):
    """The decode's next tokens come from the KV that arrived: with V perturbed on arrival
    (the fault hook keeps the blocks on the staged path, where it applies) they change."""
    _, client = store
    prompt = hf.encode("Lily and Ben went to the park. " + STORY)
    decode = decode_engine("decode-mc-perturbed", MOONCAKE, fetch=PerturbingFetch)
    try:
        fetch_of(decode).v_perturbation = 5.0
        _, tokens, _ = generate(prefill, decode, "mc-perturbed", prompt, 12)
        assert tokens != hf.greedy(prompt, 12)
        stats = settled(decode, client)
        assert set(stats.kv_connector_stats["kv_bytes_fetched_by_backend"]) == {"mooncake"}
    finally:
        stop(decode)


@pytest.mark.parametrize("fault", ["dead source", "silent source", "lease too short"])
def test_unreachable_region_falls_back_to_the_store(prefill, store, hf, fault, request):
    """A source nobody listens at, one that accepts and never answers (TE's handshake would
    block for a minute: the fetch gives up at its deadline), a lease that ends too soon."""
    _, client = store
    prompt = hf.encode("The cat sat on the mat. " + STORY)
    params = SamplingParams(max_tokens=12, temperature=0)
    transfer = KVTransferConfig(backend="mooncake", timeout_s=5)
    decode = decode_engine("decode-mc-fb", transfer)
    try:
        result = run_prefill(prefill, PrefillRequest(f"fb-{fault}", tuple(prompt), params))
        region = handoff(result).kv_region
        if fault == "dead source":
            region = dataclasses.replace(region, session=f"127.0.0.1:{_free_port()}")
        elif fault == "silent source":
            region = dataclasses.replace(region,
                                         session=request.getfixturevalue("stalled_address"))
        else:
            region = dataclasses.replace(region, expires_at=time.time() + 3)
        start = time.monotonic()
        tokens, last = run_decode(decode, with_handoff(result, kv_region=region), prompt,
                                  params)
        assert tokens == hf.greedy(prompt, 12) and last.error is None
        # given up at the fetch's 5 s deadline, not after TE's minute-long handshake (a
        # generous 6x of the deadline; which failure it was is counted below)
        assert time.monotonic() - start < 6 * transfer.timeout_s
        stats = settled(decode, client)
        assert set(stats.kv_connector_stats["kv_bytes_fetched_by_backend"]) == {"grpc"}
        kind = "timeout" if fault == "silent source" else "error"
        assert stats.kv_connector_stats["kv_transfer_errors_by_backend"] == {"mooncake": {kind: 1}}
        assert stats.kv_connector_stats["num_fetch_retries_total"] == 1
    finally:
        stop(decode)


def test_full_buffer_and_unfetched_regions(store, hf):
    """A request that finds no room in the staging buffer is not offered (its decode reads the
    store); one whose decode finishes it at admission has its region released; one nobody
    reads is reclaimed when its lease ends."""
    _, client = store
    prompt = hf.encode("One day, a big dog " + STORY)
    block_nbytes = ModelRunner(EngineConfig(num_kv_blocks=4)).kv_cache.block_nbytes
    num_blocks = -(-len(prompt) // 16)
    tight = MOONCAKE.model_copy(update={"kv_connector_extra_config": {
        "source_buffer_bytes": num_blocks * block_nbytes}})
    prefill = prefill_engine(store, tight, lease_s=1.0)
    decode = decode_engine("decode-mc-full", MOONCAKE)
    small = decode_engine("decode-mc-small", MOONCAKE, num_kv_blocks=4)
    params = SamplingParams(max_tokens=8, temperature=0)
    try:
        held = run_prefill(prefill, PrefillRequest("held", tuple(prompt), params))
        full = run_prefill(prefill, PrefillRequest("full", tuple(prompt), params))
        assert handoff(held).kv_region is not None and handoff(full).kv_region is None
        assert prefill.stats().kv_connector_stats["kv_mooncake_buffer_full_total"] == 1
        client.release_tail(handoff(held).tail_handle)  # nobody will read "held"
        tokens, _ = run_decode(decode, full, prompt, params)
        assert tokens == hf.greedy(prompt, 8)
        assert (set(settled(decode, client).kv_connector_stats["kv_bytes_fetched_by_backend"])
                == {"grpc"})
        time.sleep(1.2)  # its lease ends
        stats = prefill.stats()
        assert stats.kv_connector_stats["kv_mooncake_regions_expired_total"] == 1
        assert stats.kv_connector_stats["kv_mooncake_regions_leased"] == 0

        # needs more blocks than the worker has: finished at admission, the region released
        result, _, last = generate(prefill, small, "too-big", prompt, 40)
        assert handoff(result).kv_region is not None and "KV blocks" in last.error
        released(prefill, 1)
        settled(small, client)
    finally:
        for engine in (small, decode, prefill):
            stop(engine)


def test_aborts_bring_every_block_back(prefill, decode, store, hf):
    _, client = store
    prompt = hf.encode("The sun was hot. " + STORY)
    for i in range(3):
        _, _, last = generate(prefill, decode, f"mc-abort-{i}", prompt, 16, abort=True)
        settled(decode, client)
    _, tokens, _ = generate(prefill, decode, "mc-after-aborts", prompt, 16)
    assert tokens == hf.greedy(prompt, 16)
    settled(decode, client)


class SlowTE:
    """A Transfer Engine that reports each read its backend's ``delay_s`` (read at each check:
    a test may change it) after it was submitted: the read has landed, but TE has not said so,
    which is when a real read may still be writing."""

    def __init__(self, engine, backend: "SlowBackend", submitted: dict[int, float]) -> None:
        self._engine, self._backend, self._submitted = engine, backend, submitted

    @property
    def delay_s(self) -> float:
        return self._backend.delay_s

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def batch_transfer_async_read(self, *args):
        batch = self._engine.batch_transfer_async_read(*args)
        self._submitted[batch] = time.monotonic()
        return batch

    def transfer_check_status(self, batch):
        if time.monotonic() - self._submitted.get(batch, -1e9) < self.delay_s:
            return 0
        return self._engine.transfer_check_status(batch)


class SlowBackend(MooncakeTransferBackend):
    delay_s = 0.5
    submitted: dict[int, float] = {}

    def engine(self):
        return SlowTE(super().engine(), self, self.submitted)


def _source(num_blocks: int = 6, layout: str = "layer"):
    """A source cache of random blocks, and the MooncakeConnector offering them."""
    cache = PagedKVCache.attention(2, 16, 4, 2, 8, torch.float32, "cpu", layout=layout)
    for layer in range(2):
        cache.k[layer].normal_()
        cache.v[layer].normal_()
    connector = MooncakeConnector(MOONCAKE, lease_s=60)
    connector.register_kv_caches(cache)
    request = type("R", (), {"request_id": "r", "runs_alone": False, "max_tokens": 4,
                             "kv_transfer_params": None})
    ids = random.Random(0).sample(range(16), num_blocks)
    _, params = connector.request_finished(request, ids)
    return cache, connector, ids, params["kv_region"]


@pytest.mark.parametrize(("direct", "table", "max_direct"), [
    (True, [7, 8, 9, 10, 11, 12], 64),  # consecutive: read straight into the cache
    (True, [3, 4, 5, 11, 0, 19], 64),  # a few runs: straight in, a read per cache region and run
    (True, [3, 4, 5, 11, 0, 19], 0),  # staged, then a copy per run
    (True, [3, 9, 5, 11, 0, 19], 0),  # staged, then an index copy (many runs)
    (False, [3, 4, 5, 11, 0, 19], 64),  # no registered cache: staged, then dest.write_tensor
], ids=["consecutive", "runs", "staged-runs", "staged-scattered", "write-callback"])
@pytest.mark.parametrize(("source_layout", "dest_layout"), [
    ("layer", "layer"), ("cross-layer", "cross-layer"), ("cross-layer", "layer"),
    ("layer", "cross-layer")])
def test_region_lands_block_for_block_in_any_table(direct, table, max_direct, source_layout,
                                                   dest_layout, monkeypatch):
    """Scattered source blocks, destination tables consecutive or with runs and gaps, either
    cache layout on either side: every block equals its source block, read straight into the
    registered cache or staged (one read, landed once TE reports it)."""
    monkeypatch.setattr(mooncake, "MAX_DIRECT_READS", max_direct)
    cache, connector, ids, region = _source(layout=source_layout)
    assert region.block_major == (source_layout == "cross-layer")
    dst = PagedKVCache.attention(2, 20, 4, 2, 8, torch.float32, "cpu", layout=dest_layout)
    backend = MooncakeTransferBackend(MOONCAKE)
    dest = CacheDest(lambda s, b: dst.write_blocks(table[s:s + len(b)], b), table,
                     dst if direct else None, (dst.block_nbytes,), torch.uint8)
    receiver = backend.create_receiver()
    receiver.start(FetchRequest(region.session, (b"k",) * 5, "tail", 3, region=region), dest)
    while not receiver.poll().done:
        time.sleep(0.005)
    assert receiver.result() == len(ids) * cache.block_nbytes
    assert torch.equal(dst.read_blocks(table), cache.read_blocks(ids))
    # straight into the cache where it is registered, laid out as the region and few runs
    staged = not (direct and max_direct and source_layout == dest_layout)
    assert (backend._buffer_bytes > 0) == staged
    untouched = [b for b in range(20) if b not in table]
    assert not dst.read_blocks(untouched).any()
    with pytest.raises(BlockLayoutError):
        backend.create_receiver().start(
            FetchRequest(region.session, (b"k",) * 4, region=region), dest)


def test_receive_buffers_are_reused_smallest_first_and_capped():
    backend = MooncakeTransferBackend(MOONCAKE.model_copy(update={"kv_connector_extra_config": {
        "receive_buffer_bytes": 5 << 20}}))
    small, large = backend.take_buffer(1 << 20), backend.take_buffer(3 << 20)
    assert (small.numel(), large.numel()) == (1 << 20, 4 << 20)  # powers of two from 1 MiB
    beyond = backend.take_buffer(2 << 20)  # 1 + 4 MiB kept: a buffer for this read alone
    assert beyond.numel() == 2 << 20
    for buffer in (small, large, beyond):
        backend.give_buffer(buffer)
    again = backend.take_buffer(2 << 20)  # the smallest idle one that fits, not a new one
    assert again.data_ptr() == large.data_ptr()
    assert backend.take_buffer(1000).data_ptr() == small.data_ptr()
    assert backend.take_buffer(1000).data_ptr() not in (small.data_ptr(), large.data_ptr())


@pytest.mark.parametrize("event", ["abort", "deadline"])
def test_blocks_stay_quarantined_until_te_reports(event):
    """An abort or a deadline while a read is in flight does not settle the fetch: it settles,
    FAILED, only once TE returned, and KVFetch.abort says bytes may still land."""
    cache, connector, ids, region = _source()
    runner_cache = PagedKVCache.attention(2, 20, 4, 2, 8, torch.float32, "cpu")
    backend = SlowBackend(MOONCAKE.model_copy(update={"timeout_s": 0.2}))
    backend.delay_s = 60.0  # TE reports only once the test lets it (below)
    fetch_connector = FetchConnector(MOONCAKE, backend=backend)
    fetch_connector.register_kv_caches(runner_cache)
    result = {"kv_address": "127.0.0.1:1", "block_keys": (b"k",) * 5, "tail_handle": "tail",
              "num_tail_tokens": 3, "kv_region": region}
    fetch = KVFetch(fetch_connector, "r", list(range(6)), result)
    assert fetch.path == "mooncake"
    time.sleep(0.3)  # the read is done, TE has not said so; the 0.2 s deadline has passed
    if event == "abort":
        assert fetch.abort() is False
    assert fetch.poll() is TransferState.TRANSFERRING
    backend.delay_s = 0.0  # now TE reports the read
    deadline = time.monotonic() + 30  # against a fetch that never settles
    while not (state := fetch.receiver.poll()).done:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert state is TransferState.FAILED
    fetch_connector.close()


def test_a_read_te_never_reports_fails_at_te_timeout_and_its_buffer_is_not_reused(monkeypatch):
    """TE's own timeout passes with a staged read unreported: the receiver settles FAILED (as
    TE's sync reads give up), and its receive buffer, which the read may still write, is
    never handed out again."""
    monkeypatch.setattr(mooncake, "MAX_DIRECT_READS", 0)
    cache, connector, ids, region = _source()
    dst = PagedKVCache.attention(2, 20, 4, 2, 8, torch.float32, "cpu")
    backend = SlowBackend(MOONCAKE)
    backend.delay_s = 60.0
    backend.te_timeout_s = 0.3  # TE's own floor is 5 s
    table = [3, 9, 5, 11, 0, 19]
    dest = CacheDest(lambda s, b: None, table, dst, (dst.block_nbytes,), torch.uint8)
    receiver = backend.create_receiver()
    start = time.monotonic()  # before the read is submitted: start() may take the 0.3 s itself
    receiver.start(FetchRequest(region.session, (b"k",) * 5, "tail", 3, region=region), dest)
    while not (state := receiver.poll()).done:
        # failed by TE's 0.3 s timeout, long before the read's 60 s report (a generous bound)
        assert time.monotonic() - start < 30
        time.sleep(0.01)
    assert state is TransferState.FAILED and time.monotonic() - start >= 0.3
    with pytest.raises(KVTransferError, match="timed out"):
        receiver.result()
    abandoned = backend._abandoned[0].data_ptr()
    assert backend.take_buffer(region.nbytes).data_ptr() != abandoned


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_a_source_that_stops_answering_fails_the_read_at_te_timeout(staged, monkeypatch):
    """A real hung transfer: the source process (TE handshake done, one read served) is
    stopped, so a read's request is sent and nothing ever comes back. Past the fetch's
    deadline the receiver stays quarantined; it settles FAILED once TE's own timeout passed,
    and a receive buffer the read may still write is never reused."""
    from pdcluster.deploy.profile_transfer import _mooncake_source

    monkeypatch.setattr(mooncake, "MAX_DIRECT_READS", 0 if staged else 64)
    ctx = multiprocessing.get_context("spawn")
    ready, stop_source = ctx.Queue(), ctx.Event()
    spec = KVCacheSpec.attention(2, 4, 2, 8, torch.float32)
    proc = ctx.Process(target=_mooncake_source, args=(ready, stop_source, spec, 16, ""),
                       daemon=True)
    proc.start()
    backend = MooncakeTransferBackend(MOONCAKE)
    backend.te_timeout_s = 1.0  # TE's own floor is 5 s
    dst = PagedKVCache.attention(2, 40, 4, 2, 8, torch.float32, "cpu", layout="cross-layer")  # as the source

    def read(region, table, deadline_s):
        dest = CacheDest(lambda s, b: None, table, dst, (dst.block_nbytes,), torch.uint8)
        receiver = backend.create_receiver()
        start = time.monotonic()  # before the read is submitted, which start() may be slow at
        receiver.start(FetchRequest(region.session, (b"k",) * region.num_blocks, region=region,
                                    deadline_s=deadline_s), dest)
        while not (state := receiver.poll()).done:
            # TE's 1 s timeout ends a hung read (a generous 30x; its handshake's minute is more)
            assert time.monotonic() - start < 30 * backend.te_timeout_s
            time.sleep(0.01)
        return receiver, state, time.monotonic() - start

    try:
        regions = ready.get(timeout=60)
        # the handshake, and a read served (a deadline a loaded machine cannot miss)
        _, state, _ = read(regions[4], [0, 1, 2, 3], 30.0)
        assert state is TransferState.SUCCESS
        _stop(proc.pid)
        receiver, state, elapsed = read(regions[16], list(range(20, 36)), 0.3)
        assert state is TransferState.FAILED and elapsed >= 1.0  # not at the 0.3 s deadline
        with pytest.raises(KVTransferError, match="timed out"):
            receiver.result()
        assert len(backend._abandoned) == (1 if staged else 0)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        stop_source.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def _stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every one of its threads has stopped: the signal is
    only delivered as each thread is next scheduled, and a TE thread still running could
    serve one more read on a loaded machine."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = [psutil.Process(t.id).status() for t in psutil.Process(pid).threads()]
        if all(state == psutil.STATUS_STOPPED for state in states):
            return
        time.sleep(0.01)
    pytest.fail(f"process {pid} did not stop: {states}")


def test_region_allocator_against_an_occupancy_map():
    """Random allocations and frees: no two live ranges overlap, each lies inside the buffer,
    and an allocation fails only when no aligned free run of that size exists (checked against
    a byte map kept independently)."""
    rng = random.Random(1)
    capacity = 64 * 100
    allocator = RegionAllocator(capacity)
    used = bytearray(capacity // 64)  # one entry per 64-byte unit
    live: list[tuple[int, int]] = []
    for _ in range(2000):
        if live and rng.random() < 0.45:
            offset, nbytes = live.pop(rng.randrange(len(live)))
            allocator.free(offset, nbytes)
            units = -(-nbytes // 64)
            used[offset // 64:offset // 64 + units] = bytes(units)
            continue
        nbytes = rng.randint(1, 64 * 12)
        units = -(-nbytes // 64)
        offset = allocator.allocate(nbytes)
        fits = any(not any(used[i:i + units]) for i in range(len(used) - units + 1))
        assert (offset is not None) == fits
        if offset is not None:
            assert offset % 64 == 0 and offset + units * 64 <= capacity
            assert not any(used[offset // 64:offset // 64 + units])
            used[offset // 64:offset // 64 + units] = b"\1" * units
            live.append((offset, nbytes))
    assert allocator.free_bytes == used.count(0) * 64


def test_kv_transfer_mooncake_flags():
    from pdcluster.deploy.cli import _overrides, _parser
    from pdcluster.deploy.config import load_config

    args = _parser().parse_args(["serve", "--kv-transfer", "mooncake",
                                 "--kv-transfer-buffer-bytes", "1048576",
                                 "--kv-receive-buffer-bytes", "0"])
    transfer = load_config(None, _overrides(args)).transfer
    settings = MooncakeSettings.of(transfer)
    assert (transfer.backend, settings.source_buffer_bytes) == ("mooncake", 1 << 20)
    assert settings.receive_buffer_bytes == 0 and settings.protocol == "tcp"
    # a key the transport does not take, or a section for one that takes none: refused by name
    with pytest.raises(ValueError, match="source_buffer"):
        load_config(None, {"transfer": {"backend": "mooncake",
                                        "kv_connector_extra_config": {"source_buffer": 1}}})
    with pytest.raises(ValueError, match="grpc takes no kv_connector_extra_config"):
        load_config(None, {"transfer": {"kv_connector_extra_config": {"protocol": "tcp"}}})


def test_concurrent_reads_share_one_engine(prefill, decode, store, hf):
    _, client = store
    prompts = [hf.encode(f"{name} had a red ball. " + STORY) for name in ("Tom", "Amy", "Max")]
    outputs: dict[int, list[int]] = {}

    def run(i: int) -> None:
        outputs[i] = generate(prefill, decode, f"mc-c{i}", prompts[i], 10)[1]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert all(outputs[i] == hf.greedy(prompts[i], 10) for i in range(3))
    settled(decode, client)


def test_runs_of_a_block_table():
    """(request position, first block, count) per run of consecutive block ids."""
    assert mooncake._runs([7, 8, 9, 3, 4, 12], 20) == [(0, 7, 3), (3, 3, 2), (5, 12, 1)]
    assert mooncake._runs([5, 4, 3], 20) == [(0, 5, 1), (1, 4, 1), (2, 3, 1)]  # descending
    assert mooncake._runs([], 4) == []
    with pytest.raises(BlockLayoutError, match="block id 20 outside"):
        mooncake._runs([1, 20], 20)
    with pytest.raises(BlockLayoutError, match="block id -1 outside"):
        mooncake._runs([0, -1], 4)
