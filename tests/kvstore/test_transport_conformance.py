"""One conformance suite for every registered transport, both halves: the prefill's connector
offers a prompt's blocks (``request_finished``), the pool holds them too (as the pool connector
saves them), and the decode's FetchConnector takes them into reserved blocks through its
chain of sources. Parametrized over the transports of kvstore.transport.registry, plus one
defined only under tests/ (tests/kvstore/loopback_transport.py) and registered the same way,
and over block layouts (KV cache specs): GQA K/V; an MLA latent; and a spec with a second
group and an extra per-block tensor of another dtype (an int8 K/V with float32 scales beside a
draft model's bfloat16 group), which no transport is told the meaning of.

Each case: the whole prompt, tail block included, lands equal to the source's blocks; a
prefix the decode holds is skipped where the source pulls block by block and refused where it
pushes the whole prompt; an abort settles with nothing written afterwards; a source that never
sends fails at its deadline and the fetch falls back to the pool; and every one-shot hold on
the sending side (the store's tail, the offer) is let go of at the end.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import random
import time
from dataclasses import dataclass, field

import pytest
import torch

from pdcluster.engine.core.hashing import block_keys, make_namespace
from pdcluster.engine.kv_cache import PagedKVCache
from pdcluster.engine.kv_cache_spec import KVCacheGroupSpec, KVCacheSpec, KVCacheTensorSpec
from pdcluster.kvstore.config import KVTransferConfig
from pdcluster.kvstore.transport import registry
from pdcluster.kvstore.transport.base import TransferState
from pdcluster.kvstore.transport.fetch import FetchConnector, KVFetch
from tests.kvstore import loopback_transport
from tests.real_parts import MOONCAKE_HINT, require_real_part
from tests.integration.test_transfer_faults import store  # noqa: F401 — the store fixture

BLOCK_SIZE, LAYERS, NUM_BLOCKS = 4, 2, 24
NUM_FULL, NUM_TAIL_TOKENS = 5, 3  # the prompt: 5 full blocks, then a tail of 3 tokens

def _two_groups() -> KVCacheSpec:
    """int8 K and V with a float32 scale per head, and a draft's bfloat16 K and V."""
    kv = (BLOCK_SIZE, 2, 6)
    target = KVCacheGroupSpec("attention", LAYERS, (
        KVCacheTensorSpec("k", torch.int8, kv, 1), KVCacheTensorSpec("v", torch.int8, kv, 1),
        KVCacheTensorSpec("kv_scale", torch.float32, (2, 2), 1)))
    draft = KVCacheGroupSpec("draft", 1, (
        KVCacheTensorSpec("k", torch.bfloat16, (BLOCK_SIZE, 1, 8), 1),
        KVCacheTensorSpec("v", torch.bfloat16, (BLOCK_SIZE, 1, 8), 1)))
    return KVCacheSpec(BLOCK_SIZE, (target, draft))


LAYOUTS = {"gqa": KVCacheSpec.attention(LAYERS, BLOCK_SIZE, 2, 8, torch.float32),
           "mla": KVCacheSpec.attention(LAYERS, BLOCK_SIZE, 1, 24, torch.float32, kv_parts=1),
           "two-groups": _two_groups()}
TIMEOUT_S = 2.0
TRANSPORTS = [*registry.TRANSPORTS, "loopback"]


@dataclass
class Prompt:
    """A prompt's blocks offered by one transport's prefill half, and the pool's copy."""

    source: PagedKVCache
    ids: list[int]
    params: dict
    prefill: object = None  # the transport's prefill connector (None: the pool alone)
    held: list = field(default_factory=list)  # what to close at the end


class _Request:
    """What a prefill's connectors read of a finished request."""

    def __init__(self, request_id: str) -> None:
        self.request_id, self.runs_alone, self.max_tokens = request_id, False, 8
        self.kv_transfer_params = {"decode_peer": "decode-0"}
        self.block_keys, self.block_table, self.num_computed_tokens = (), [], 0


@pytest.fixture
def loopback(monkeypatch):
    """The test-only transport, registered through the registry and nowhere else."""
    monkeypatch.setitem(registry.TRANSPORTS, "loopback", loopback_transport.LOOPBACK)
    monkeypatch.setitem(registry.KV_CONNECTORS, "loopback",
                        f"{loopback_transport.__name__}:LoopbackConnector")


def _cache(layout: str, cross_layer: bool = False) -> PagedKVCache:
    return PagedKVCache(LAYOUTS[layout], NUM_BLOCKS, "cpu",
                        "cross-layer" if cross_layer else "layer")


def _transfer(name: str) -> KVTransferConfig:
    backend = name if name in ("grpc", "torch", "mooncake") else "grpc"
    extra = ({"source_buffer_bytes": 8 << 20, "receive_buffer_bytes": 8 << 20}
             if backend == "mooncake" else {})
    return KVTransferConfig(backend=backend, timeout_s=TIMEOUT_S, kv_connector_extra_config=extra)


def _offer(name: str, layout: str, store, tag: str, withhold: bool = False) -> Prompt:
    """The prompt's blocks in a source cache, saved to the pool (keys + tail, as the pool
    connector saves them) and offered by transport ``name``'s prefill connector."""
    if name == "mooncake":
        require_real_part("Mooncake's Transfer Engine",
                          importlib.util.find_spec("mooncake") is not None, MOONCAKE_HINT)
    server, client = store
    source = _cache(layout, cross_layer=name == "mooncake")
    source.write_blocks(list(range(NUM_BLOCKS)),
                        torch.randint(0, 256, (NUM_BLOCKS, source.block_nbytes), dtype=torch.uint8,
                                      generator=torch.Generator().manual_seed(len(tag))))
    ids = random.Random(tag).sample(range(NUM_BLOCKS), NUM_FULL + 1)
    keys = block_keys(list(range(NUM_FULL * BLOCK_SIZE)), BLOCK_SIZE,
                      make_namespace(f"conformance-{tag}-{layout}"))
    blocks = source.read_blocks(ids)
    client.put_blocks(keys, blocks[:NUM_FULL])
    handle = f"tail:{tag}-{layout}-{time.monotonic_ns()}"
    client.put_tail(handle, blocks[NUM_FULL], NUM_TAIL_TOKENS)
    params = {"kv_address": server.address, "block_keys": tuple(keys), "tail_handle": handle,
              "num_tail_tokens": NUM_TAIL_TOKENS}
    prompt = Prompt(source, ids, params)
    if name == registry.POOL:
        return prompt
    connector = registry.connector_class(registry.TRANSPORTS[name].connectors[0])
    if name == "torch":
        prefill = connector(_transfer(name), send_deadline_s=TIMEOUT_S, device="cpu")
    elif name == "mooncake":
        prefill = connector(_transfer(name), lease_s=60)
    else:
        prefill = connector()
        prefill.withhold = withhold
    prefill.register_kv_caches(source)
    _, offered = prefill.request_finished(_Request(tag), ids)
    assert offered, f"{name} offered nothing"
    if withhold and name == "torch":  # a tag the sender never sends under
        offered = {**offered, "pair_tag": offered["pair_tag"] + 1000}
    if withhold and name == "mooncake":  # a region whose lease has ended
        offered = {**offered, "kv_region": dataclasses.replace(offered["kv_region"],
                                                                expires_at=0.0)}
    prompt.params.update(offered)
    prompt.prefill = prefill
    return prompt


def _decode(name: str, layout: str) -> FetchConnector:
    transfer = _transfer(name)
    backend = loopback_transport.LoopbackBackend(transfer) if name == "loopback" else None
    connector = FetchConnector(transfer, backend=backend)
    connector.register_kv_caches(_cache(layout))
    return connector


def _settle(fetch: KVFetch) -> TransferState:
    deadline = time.monotonic() + 30
    while not (state := fetch.poll()).done:
        assert time.monotonic() < deadline, "the fetch never settled"
        time.sleep(0.005)
    return state


def _tails(store) -> int:
    return store[1].stats()["num_tails"]


def _released(store, before: int) -> None:
    """The store's tail count is back to ``before`` (the drop goes over gRPC in the
    background; the bound is a hang guard, generous for a loaded machine)."""
    deadline = time.monotonic() + 60
    while _tails(store) > before:
        assert time.monotonic() < deadline, "the prompt's tail was never let go of"
        time.sleep(0.01)


def _close(decode: FetchConnector, prompt: Prompt) -> None:
    decode.close()
    if prompt.prefill is not None:
        prompt.prefill.close()


pytestmark = pytest.mark.usefixtures("loopback")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", TRANSPORTS)
def test_the_whole_prompt_lands_and_the_sender_lets_go(name, layout, store):
    before = _tails(store)
    prompt = _offer(name, layout, store, "whole")
    decode = _decode(name, layout)
    try:
        chain = decode.chain(prompt.params)
        assert chain[-1].fallback and chain[0].name in (name, "pool")
        table = random.Random(1).sample(range(NUM_BLOCKS), NUM_FULL + 1)
        fetch = KVFetch(decode, "whole", table, prompt.params)
        assert _settle(fetch) is TransferState.SUCCESS, fetch.error
        assert len(fetch.paths) == 1
        assert torch.equal(decode.cache.read_blocks(table), prompt.source.read_blocks(prompt.ids))
        block_nbytes = decode.cache.block_nbytes
        assert decode.stats()["kv_bytes_fetched_total"] == (NUM_FULL + 1) * block_nbytes
        _released(store, before)
    finally:
        _close(decode, prompt)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", TRANSPORTS)
def test_a_prefix_held_is_skipped_by_a_pull_and_refused_by_a_push(name, layout, store):
    prompt = _offer(name, layout, store, "prefix")
    decode = _decode(name, layout)
    try:
        first = decode.chain(prompt.params)[0]
        table = list(range(NUM_FULL + 1))
        if first.pushed:
            with pytest.raises(ValueError, match="cannot skip"):
                KVFetch(decode, "prefix", table, prompt.params, skip_blocks=2)
            return
        fetch = KVFetch(decode, "prefix", table, prompt.params, skip_blocks=2)
        assert _settle(fetch) is TransferState.SUCCESS, fetch.error
        assert not decode.cache.read_blocks(table[:2]).any()  # held: not written
        assert torch.equal(decode.cache.read_blocks(table[2:]),
                           prompt.source.read_blocks(prompt.ids[2:]))
    finally:
        _close(decode, prompt)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", TRANSPORTS)
def test_an_abort_settles_and_nothing_is_written_after(name, layout, store):
    before = _tails(store)
    prompt = _offer(name, layout, store, "abort")
    decode = _decode(name, layout)
    try:
        table = list(range(NUM_FULL + 1))
        fetch = KVFetch(decode, "abort", table, prompt.params)
        fetch.abort()
        state = _settle(fetch)  # at once, or once an attempt it cannot cancel settles
        assert len(fetch.paths) == 1  # an aborted fetch is not retried
        landed = decode.cache.read_blocks(table).clone()
        time.sleep(0.3)
        assert torch.equal(decode.cache.read_blocks(table), landed)
        if state is TransferState.FAILED:
            assert "abort" in str(fetch.error)
            assert decode.stats()["kv_transfer_errors_by_backend"] == {}  # not a fault
        _released(store, before)
    finally:
        _close(decode, prompt)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", TRANSPORTS)
def test_a_source_that_fails_falls_back_to_the_pool(name, layout, store):
    before = _tails(store)
    prompt = _offer(name, layout, store, "fail", withhold=True)
    if name == registry.POOL:  # the pool's own failure: its keys gone, retried, then FAILED
        prompt.params["block_keys"] = tuple(bytes(32) for _ in prompt.params["block_keys"])
    decode = _decode(name, layout)
    try:
        table = list(range(NUM_FULL + 1))
        fetch = KVFetch(decode, "fail", table, prompt.params)
        state = _settle(fetch)
        errors = decode.stats()["kv_transfer_errors_by_backend"]
        assert len(fetch.paths) == 2 and sum(sum(k.values()) for k in errors.values()) >= 1
        if name == registry.POOL:
            assert state is TransferState.FAILED
        else:
            assert state is TransferState.SUCCESS, fetch.error
            assert fetch.paths[0] != fetch.paths[1] and fetch.paths[1] in ("grpc", "arena")
            assert torch.equal(decode.cache.read_blocks(table),
                               prompt.source.read_blocks(prompt.ids))
        _released(store, before)
    finally:
        _close(decode, prompt)


def test_the_test_transport_is_one_entry():
    """What the loopback needed outside tests/: nothing but its registry entries (set by the
    fixture); the decode built its source from them."""
    decode = _decode("loopback", "gqa")
    try:
        assert [s.name for s in decode.sources][-1] == "pool"
        assert "loopback" in [s.name for s in decode.sources]
    finally:
        decode.close()
