"""`--kv-pool mooncake-store` against a real `mooncake_master`: two prefill engines on two
"nodes" (each with its own node store, each mounting a segment into the store), the store as
their prefix cache and index. Outputs are checked against transformers, and the blocks the
store returns against those the computing node holds."""

from __future__ import annotations

import time

import pytest
import torch

from tests.markers import starts
from tests.real_parts import MOONCAKE_HINT, import_real_part

import_real_part("mooncake.store", "Mooncake Store", MOONCAKE_HINT)

from pdcluster.deploy.cli import _overrides, _parser  # noqa: E402
from pdcluster.deploy.config import load_config  # noqa: E402
from pdcluster.engine.config import BUNDLED_MODEL, EngineConfig  # noqa: E402
from pdcluster.engine.protocol import PrefillRequest, SamplingParams  # noqa: E402
from pdcluster.kvstore.handoff import PrefixPlan  # noqa: E402
from pdcluster.engine.runner import ModelRunner  # noqa: E402
from pdcluster.kvstore.client import KVStoreClient  # noqa: E402
from pdcluster.kvstore.config import KVStoreConfig  # noqa: E402
from pdcluster.kvstore.transport.pool.connector import PoolConnector  # noqa: E402
from pdcluster.engine.core.hashing import block_keys, make_namespace  # noqa: E402
from pdcluster.kvstore.index import KVIndexUnavailableError, Location, open_index  # noqa: E402
from pdcluster.kvstore.index.mooncake_store import POOL_LOCATION, MooncakeStoreIndex  # noqa: E402
from pdcluster.kvstore.mooncake_store import MooncakeStoreClient, MooncakeStoreError  # noqa: E402
from pdcluster.prefill_worker.instance import prefill as run_prefill, prefill_core  # noqa: E402
from pdcluster.router.cost_model import load_cost_model  # noqa: E402
from tests.engine_loops import started, stop  # noqa: E402
from tests.kvstore.lru_block_store import lru_server  # noqa: E402
from tests.kvstore.mooncake_master import MooncakeMaster  # noqa: E402
from tests.handoffs import handoff

PARAMS = SamplingParams(max_tokens=2, temperature=0)
SEGMENT = 32 << 20


@pytest.fixture(scope="module")
@starts("server")
def master(tmp_path_factory):
    server = MooncakeMaster(tmp_path_factory.mktemp("mooncake"))
    server.start()
    yield server
    server.stop()


class Node:
    """A prefill engine with its own node store, whose pool is the Mooncake Store."""

    def __init__(self, name: str, index_url: str) -> None:
        self.server = lru_server(KVStoreConfig())
        self.server.start()
        self.client = KVStoreClient(self.server.address)
        self.index = open_index(index_url, segment_bytes=SEGMENT, buffer_bytes=8 << 20)
        self.connector = PoolConnector(name, self.client, self.server.address, self.client,
                                       self.index)
        self.engine = started(lambda: prefill_core(
            ModelRunner(EngineConfig(model=str(BUNDLED_MODEL), num_kv_blocks=64)),
            self.connector, name, 0, self.index, name))

    def close(self) -> None:
        stop(self.engine)
        self.index.close()
        self.client.close()
        self.server.stop()


@pytest.fixture(scope="module")
def nodes(master):
    a, b = (Node(name, f"mooncake://{master.address}") for name in ("node-a", "node-b"))
    yield a, b
    b.close()
    a.close()


def planned(request_id: str, prompt: list[int], keys: tuple[bytes, ...], index,
            cache_salt: str | None = None) -> PrefillRequest:
    """The request with the plan a Conductor makes from `index`."""
    locations = index.longest_prefix(list(keys))
    plan = PrefixPlan(keys, tuple(tuple(locs) for locs in locations), len(locations))
    return PrefillRequest(request_id, tuple(prompt), PARAMS, cache_salt=cache_salt,
                          kv_transfer_params={"prefix_plan": plan})


def put_done(node: Node, count: int, timeout_s: float = 10.0) -> None:
    """Wait until `node` put `count` blocks into the store (after the request's params)."""
    deadline = time.monotonic() + timeout_s
    while node.connector.stats()["kv_mooncake_store_puts_total"] < count:
        assert time.monotonic() < deadline, node.connector.stats()
        time.sleep(0.05)


def test_store_client_round_trip_between_two_clients(master):
    mounted = MooncakeStoreClient(master.address, segment_bytes=SEGMENT, buffer_bytes=1 << 20)
    pure = MooncakeStoreClient(master.address, buffer_bytes=1 << 20)  # mounts nothing
    try:
        blocks = torch.randn(40, 2, 16, 4, 8)  # 16 KiB each: 64 per staging round
        keys = [bytes([i]) * 32 for i in range(40)]
        assert pure.put(keys, blocks) == 40  # placed in the only mounted segment
        assert mounted.put(keys[:3], blocks[:3]) == 3  # held already: stored
        assert mounted.longest_prefix(keys + [b"\xff" * 32]) == 40
        assert pure.exists([keys[5], b"\xfe" * 32]) == [True, False]
        out = torch.zeros_like(blocks)
        assert mounted.get(keys, out) == 40 and torch.equal(out, blocks)
        gap = torch.zeros(3, 2, 16, 4, 8)
        assert pure.get([keys[0], b"\xfd" * 32, keys[1]], gap) == 1
        assert torch.equal(gap[0], blocks[0]) and not gap[1:].any()
    finally:
        pure.close()
        mounted.close()
    with pytest.raises(MooncakeStoreError, match="unreachable"):
        MooncakeStoreClient("127.0.0.1:9", connect_timeout_s=1)


def test_a_prefix_computed_on_one_node_is_reused_on_the_other(nodes, hf):
    a, b = nodes
    prompt = hf.encode("Once upon a time, there was a little girl named Lily. " * 5)
    warm = run_prefill(a.engine, PrefillRequest("warm", tuple(prompt), PARAMS))
    keys = handoff(warm).block_keys
    assert len(keys) >= 3, len(prompt)
    put_done(a, len(keys))
    # the store holds what node a computed, block for block
    stored = torch.empty((len(keys), a.engine.runner.wire_kv.block_nbytes), dtype=torch.uint8)
    assert b.index.block_store.get(list(keys), stored) == len(keys)
    assert torch.equal(stored, a.client.get_blocks(list(keys)))

    assert b.index.longest_prefix(list(keys)) == [[POOL_LOCATION]] * len(keys)
    free = b.engine.kv.num_free_blocks
    reused = run_prefill(b.engine, planned("reused", prompt, keys, b.index))
    assert reused.num_cached_tokens == len(keys) * 16
    assert reused.first_token == warm.first_token == hf.greedy(prompt, 1)[0]
    stats = b.engine.stats()
    assert stats.prefix_cache_hit_tokens_total.get("mooncake_store") == len(keys) * 16
    assert stats.num_prefill_tokens_total == len(prompt) - len(keys) * 16
    assert b.engine.kv.num_free_blocks >= free - len(keys)  # G1 keeps the prefix
    for node, result in ((a, warm), (b, reused)):
        node.client.release_tail(handoff(result).tail_handle)


def test_a_tenant_never_reuses_another_tenants_blocks(nodes, hf):
    a, b = nodes
    prompt = hf.encode("Tom had a small boat. He sailed it on the lake with his dad. " * 4)
    before = a.connector.stats()["kv_mooncake_store_puts_total"]
    first = run_prefill(a.engine, PrefillRequest("t1", tuple(prompt), PARAMS, cache_salt="tenant-1"))
    put_done(a, before + len(handoff(first).block_keys))
    assert b.index.lookup(list(handoff(first).block_keys)) == [[POOL_LOCATION]] * len(handoff(first).block_keys)
    # the Conductor's keys for tenant 2 (the same prompt): none of them is in the store
    salted = tuple(block_keys(prompt, 16, make_namespace(b.engine.model_id, "tenant-2")))
    assert len(salted) == len(handoff(first).block_keys) and set(salted).isdisjoint(handoff(first).block_keys)
    assert b.index.longest_prefix(list(salted)) == []
    other = run_prefill(b.engine, planned("t2", prompt, salted, b.index, cache_salt="tenant-2"))
    assert handoff(other).block_keys == salted
    assert other.num_cached_tokens == 0 and other.first_token == first.first_token
    # tenant 1 on node b does reuse its own blocks
    again = run_prefill(b.engine, planned("t1b", prompt, handoff(first).block_keys, b.index, "tenant-1"))
    assert again.num_cached_tokens == len(handoff(first).block_keys) * 16
    for node, result in ((a, first), (b, other), (b, again)):
        node.client.release_tail(handoff(result).tail_handle)


def test_an_unreachable_store_costs_a_recompute(nodes, hf):
    a, _ = nodes
    prompt = hf.encode("One day, a big dog named Max found a red ball in the park. " * 3)
    dead = MooncakeStoreIndex("127.0.0.1:9", connect_timeout_s=1)
    with pytest.raises(KVIndexUnavailableError):
        dead.longest_prefix([b"\x01" * 32])
    # a plan naming the store's blocks, on a node whose store client cannot connect
    engine = started(lambda: prefill_core(
        ModelRunner(EngineConfig(model=str(BUNDLED_MODEL), num_kv_blocks=64)),
        PoolConnector("node-c", a.client, a.server.address, a.client, dead), "c", 0))
    try:
        keys = tuple(bytes([i + 1]) * 32 for i in range(len(prompt) // 16))
        plan = PrefixPlan(keys, tuple((POOL_LOCATION,) for _ in keys), len(keys))
        result = run_prefill(engine, PrefillRequest("dead", tuple(prompt), PARAMS,
                                               kv_transfer_params={"prefix_plan": plan}))
        assert result.num_cached_tokens == 0 and result.first_token == hf.greedy(prompt, 1)[0]
        assert engine.stats().kv_load_failures_total == {"recompute": 1, "fail": 0}
        a.client.release_tail(handoff(result).tail_handle)
    finally:
        stop(engine)


def test_kv_pool_flags_and_the_pool_cost():
    def config(*flags):
        return load_config(None, _overrides(_parser().parse_args(["serve", *flags])))

    cfg = config("--kv-pool", "mooncake-store", "--mooncake-master", "10.0.0.5:50051",
                 "--mooncake-store-protocol", "rdma")
    assert cfg.kvpool.index_url == "mooncake://10.0.0.5:50051"
    assert cfg.kvpool.index_options("0.0.0.0") == {
        "bind_host": "0.0.0.0", "protocol": "rdma", "segment_bytes": cfg.kvpool.dram_cache_bytes,
        "buffer_bytes": 64 << 20}
    assert config().kvpool.index_options("127.0.0.1") == {}
    with pytest.raises(ValueError, match="--mooncake-master"):
        config("--kv-pool", "mooncake-store")
    assert Location("mooncake-store", "mooncake_store").encode() == "mooncake-store|mooncake_store|"
    cost = load_cost_model("mooncake-70b")
    measured = cost.with_transfer_paths({"pool:mooncake-store": {"latency_s": 0.5,
                                                                 "bytes_per_s": 1e9}})
    assert cost.for_pool("mooncake-store") is cost  # nothing measured: the model's figures
    assert measured.for_pool("mooncake-store").t_load_tokens(0, 1000) == pytest.approx(
        0.5 + 1000 * cost.kv_bytes_per_token / 1e9)


def test_profile_measures_loading_from_the_store(master):
    from pdcluster.deploy.profile import transfer_figures
    from pdcluster.deploy.profile_transfer import BLOCK_COUNTS, measure_pool
    from pdcluster.engine.kv_cache import PagedKVCache

    cache = PagedKVCache.attention(2, 16, 16, 2, 8, torch.float32, "cpu")
    rows = measure_pool("mooncake-store", cache, master.address, repeats=1)
    assert [b for b, _ in rows] == [n * cache.block_nbytes for n in BLOCK_COUNTS if n <= 16]
    assert all(s > 0 for _, s in rows) and transfer_figures(rows)["bytes_per_s"] > 0
    # the blocks landed: the source's seeded blocks, in blocks 0..15
    expected = torch.randint(0, 256, (16, cache.block_nbytes), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(0))
    assert torch.equal(cache.read_blocks(list(range(16))), expected)
    with pytest.raises(ValueError, match="--kv-pool"):
        measure_pool("lmcache", cache, master.address)
