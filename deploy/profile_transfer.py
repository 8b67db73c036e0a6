"""A KV connector's transfer cost, measured for `pdcluster profile --kv-transfer NAME`.

A source process on this node holds a request's blocks the way a prefill worker does for that
connector, and this process receives them the way a decode worker does, into a paged cache of
the profiled model's layout, through the connector's own transfer backend:

    grpc      a node's KV store (TieredNodeStore: the shared-memory arena) behind its gRPC
              server; a GrpcTransferBackend receiver pulls the blocks by key
    torch     a TorchPairChannel (gloo): a TorchKVSender pushes, a TorchTransferBackend
              receiver receives
    mooncake  a MooncakeConnector's registered region; a MooncakeTransferBackend receiver reads
              it into the registered cache with one TE batch

`pdcluster profile --kv-pool mooncake-store` measures the pool the same way (`measure_pool`):
a source process mounts a segment into the Mooncake Store at `--mooncake-master` and puts the
blocks; this process gets them through its own store client into the cache, as a prefill's
pool connector loads a prefix.

Each sample is the median time of moving n blocks (n in BLOCK_COUNTS), start to SUCCESS. Two
processes on one node: across nodes the same code measures a real network only when run on a
cluster (not done here).
"""

from __future__ import annotations

import multiprocessing as mp
import secrets
import statistics
import time
from collections.abc import Callable

import torch

from pdcluster.engine.core.hashing import block_keys, make_namespace
from pdcluster.engine.kv_cache import PagedKVCache
from pdcluster.engine.kv_cache_spec import KVCacheSpec
from pdcluster.kvstore.config import PREFER_CROSS_LAYER_BLOCKS, KVStoreConfig, KVTransferConfig
from pdcluster.kvstore.transport.base import FetchRequest, KVReceiver
from pdcluster.kvstore.transport.dest import CacheDest

#: Blocks per sampled transfer
BLOCK_COUNTS = (1, 4, 16, 64)
CONNECTORS = ("grpc", "torch", "mooncake")
_POLL_S = 1e-4
_SOURCE_TIMEOUT_S = 120.0


def _keys(n: int) -> list[bytes]:
    return block_keys(list(range(n)), 1, make_namespace("pdcluster-profile"))


def _blocks(n: int, spec: KVCacheSpec) -> torch.Tensor:
    """n blocks of random bytes, uint8 [n, block_nbytes]."""
    return torch.randint(0, 256, (n, spec.block_nbytes), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(0))


def _source_cache(spec: KVCacheSpec, n: int, layout: str) -> PagedKVCache:
    cache = PagedKVCache(spec, n, "cpu", layout)
    cache.write_blocks(list(range(n)), _blocks(n, spec))
    return cache


# ---- source processes (spawned) -----------------------------------------------------------

def _grpc_source(ready: mp.Queue, stop, spec, n: int, token: str) -> None:
    from pdcluster.kvstore.client import KVStoreClient
    from pdcluster.kvstore.layout import BlockLayout
    from pdcluster.kvstore.node_store import TieredNodeStore
    from pdcluster.kvstore.server import KVStoreServer

    layout = BlockLayout("uint8", (spec.block_nbytes,))
    store = TieredNodeStore("profile", layout, 2 * n * layout.nbytes + (1 << 20), None, 0,
                            None, 1 << 20, 3600.0)
    config = KVStoreConfig(token=token)
    server = KVStoreServer(config, store=store)
    server.start()
    try:
        with KVStoreClient(server.address, token=token) as client:
            client.put_blocks(_keys(n), _blocks(n, spec))
        ready.put(server.address)
        stop.wait()
    finally:
        server.stop()
        store.close()  # its shared-memory arena goes with it


def _torch_source(ready: mp.Queue, stop, spec, n: int, token: str) -> None:
    from pdcluster.kvstore.transport.torch_pair.backend import TorchKVSender
    from pdcluster.kvstore.transport.torch_pair.channel import TorchPairChannel

    blocks = _blocks(n, spec)
    channel = TorchPairChannel(0, "127.0.0.1", 0, timeout_s=60.0, token=token)
    ready.put(channel.address)
    channel.connect()
    request = torch.empty(2, dtype=torch.int64)
    while True:  # a request [n, tag]; n = 0: done
        channel.wait(channel.recv(request, 1), 3600.0)
        if int(request[0]) == 0:
            channel.close()
            return
        sender = TorchKVSender(channel)
        sender.start(blocks[:int(request[0])], int(request[1]), 60.0)
        while not sender.poll().done:
            time.sleep(_POLL_S)


def _mooncake_source(ready: mp.Queue, stop, spec, n: int, token: str) -> None:
    from pdcluster.kvstore.transport.mooncake.connector import MooncakeConnector
    from pdcluster.kvstore.transport.mooncake.source import region_of

    # both ends cross-layer, as `serve --kv-transfer mooncake` lays out its caches
    cache = _source_cache(spec, n, "cross-layer")
    nbytes = sum(BLOCK_COUNTS) * cache.block_nbytes + (1 << 20)
    connector = MooncakeConnector(KVTransferConfig(backend="mooncake",
                                                   kv_connector_extra_config={
                                                       "source_buffer_bytes": nbytes}),
                                  24 * 3600.0)
    connector.register_kv_caches(cache)
    request = type("Profiled", (), {"request_id": "profile", "runs_alone": False,
                                    "max_tokens": 16, "kv_transfer_params": None})
    ready.put({count: region_of(connector.request_finished(request, list(range(count)))[1])
               for count in BLOCK_COUNTS if count <= n})
    stop.wait()


def _mooncake_store_source(ready: mp.Queue, stop, spec, n: int,
                           master: str) -> None:
    from pdcluster.kvstore.mooncake_store import MooncakeStoreClient

    blocks = _blocks(n, spec)
    nbytes = blocks.numel() * blocks.element_size()
    client = MooncakeStoreClient(master, segment_bytes=2 * nbytes + (16 << 20),
                                 buffer_bytes=nbytes + (1 << 20))
    try:
        ready.put(client.put(_keys(n), blocks))
        stop.wait()
    finally:
        client.close()


_SOURCES = {"grpc": _grpc_source, "torch": _torch_source, "mooncake": _mooncake_source}
POOLS = ("mooncake-store",)


# ---- the receiving side --------------------------------------------------------------------

def _receive(receiver: KVReceiver, request: FetchRequest, dest: CacheDest) -> None:
    receiver.start(request, dest)
    while not receiver.poll().done:
        time.sleep(_POLL_S)
    receiver.result()  # raises the transfer's error


def _fetcher(name: str, source, cache: PagedKVCache, token: str
             ) -> tuple[Callable[[int], None], Callable[[], None]]:
    """(fetch n blocks into the cache, close)."""
    from pdcluster.kvstore.transport.registry import create_backend

    transfer = KVTransferConfig(backend=name, timeout_s=60.0)
    backend = create_backend(transfer, KVStoreConfig(token=token))
    keys, tags = _keys(max(BLOCK_COUNTS)), iter(range(2, 2**31))

    def dest(n: int) -> CacheDest:
        table = list(range(n))
        return CacheDest(lambda start, blocks: cache.write_blocks(
            table[start:start + len(blocks)], blocks), table, cache, (cache.block_nbytes,),
            torch.uint8)

    def ask_torch(n: int) -> FetchRequest:  # the source pushes n blocks under a fresh tag
        tag = next(tags)
        channel = backend.channel(source, 60.0)
        channel.wait(channel.send(torch.tensor([n, tag], dtype=torch.int64), 1), 60.0)
        return FetchRequest(source, tuple(keys[:n]), tag=tag)

    def end_torch() -> None:
        channel = backend.channel(source, 60.0)
        channel.wait(channel.send(torch.zeros(2, dtype=torch.int64), 1), 60.0)

    requests: dict[str, Callable[[int], FetchRequest]] = {
        "grpc": lambda n: FetchRequest(source, tuple(keys[:n])),
        "torch": ask_torch,
        "mooncake": lambda n: FetchRequest(source[n].session, tuple(keys[:n]), region=source[n]),
    }
    ends: dict[str, Callable[[], None]] = {"torch": end_torch}

    def fetch(n: int) -> None:
        _receive(backend.create_receiver(), requests[name](n), dest(n))

    def close() -> None:
        ends.get(name, lambda: None)()
        backend.close()
    return fetch, close


def _pool_fetcher(master: str, stored: int, cache: PagedKVCache
                  ) -> tuple[Callable[[int], None], Callable[[], None]]:
    """(get n blocks from the Mooncake Store into the cache, close)."""
    from pdcluster.kvstore.errors import KVStoreError
    from pdcluster.kvstore.mooncake_store import MooncakeStoreClient

    n_max = max(BLOCK_COUNTS)
    if stored < min(n_max, cache.num_blocks):
        raise KVStoreError(f"the Mooncake Store took {stored} of the profiled blocks")
    client = MooncakeStoreClient(master, buffer_bytes=n_max * cache.block_nbytes + (1 << 20))
    keys = _keys(n_max)

    def fetch(n: int) -> None:
        data = torch.empty((n, cache.block_nbytes), dtype=torch.uint8)
        if client.get(keys[:n], data) < n:
            raise KVStoreError("the Mooncake Store lost profiled blocks")
        cache.write_blocks(list(range(n)), data)
    return fetch, client.close


def measure_connector(name: str, cache: PagedKVCache, repeats: int = 5
                      ) -> list[tuple[int, float]]:
    """[(bytes, seconds)]: the median time to move n blocks of ``cache``'s layout over the
    connector ``name`` from a source process into ``cache`` (blocks 0..n-1), for each n in
    BLOCK_COUNTS that the cache holds. A connector that prefers cross-layer blocks
    (kvstore.config.PREFER_CROSS_LAYER_BLOCKS) moves them between cross-layer caches of the
    same dimensions, as a deployment with it lays its caches out.

    Raises:
        ValueError: an unknown connector name.
        KVStoreError: a transfer failed (e.g. ``mooncake`` without its extra).
    """
    if name not in _SOURCES:
        raise ValueError(f"--kv-transfer {name!r}: one of {', '.join(CONNECTORS)}")
    if name in PREFER_CROSS_LAYER_BLOCKS and cache.layout != "cross-layer":
        cache = PagedKVCache(cache.spec, min(cache.num_blocks, max(BLOCK_COUNTS)), cache.device,
                             layout="cross-layer")
    token = secrets.token_hex(16)
    return _measure(_SOURCES[name], token,
                    lambda source: _fetcher(name, source, cache, token), cache, repeats)


def measure_pool(backend: str, cache: PagedKVCache, master: str, repeats: int = 5
                 ) -> list[tuple[int, float]]:
    """[(bytes, seconds)] as measure_connector, for loading a prefix from the pool backend
    ``backend`` (a Mooncake Store at ``master``, "host:port").

    Raises:
        ValueError: an unknown backend.
        KVStoreError: the store could not be reached or lost the blocks.
    """
    if backend not in POOLS:
        raise ValueError(f"--kv-pool {backend!r}: one of {', '.join(POOLS)}")
    return _measure(_mooncake_store_source, master,
                    lambda stored: _pool_fetcher(master, stored, cache), cache, repeats)


def _measure(source, source_arg, fetcher, cache: PagedKVCache, repeats: int
             ) -> list[tuple[int, float]]:
    """Run ``source(ready, stop, spec, n, source_arg)`` in a spawned process,
    build ``fetch, close = fetcher(what it put on ready)`` here, and time fetch(n)."""
    counts = [n for n in BLOCK_COUNTS if n <= cache.num_blocks]
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=source, args=(ready, stop, cache.spec, max(counts), source_arg),
                       daemon=True)
    proc.start()
    try:
        fetch, close = fetcher(ready.get(timeout=_SOURCE_TIMEOUT_S))
        try:
            rows = []
            for n in counts:
                fetch(n)  # warm-up: channels, registrations
                samples = []
                for _ in range(repeats):
                    began = time.perf_counter()
                    fetch(n)
                    samples.append(time.perf_counter() - began)
                rows.append((n * cache.block_nbytes, statistics.median(samples)))
            return rows
        finally:
            close()
    finally:
        stop.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
