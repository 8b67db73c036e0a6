"""KV block-transfer throughput: grpc and torch/gloo against a raw TCP socket, over loopback.

    .venv/bin/python benchmarks/transfer.py [--sizes 64K,256K,1M,4M,16M,64M] [--block-kib 64]
        [--floor] [--mooncake [--te-split 4,16] [--te-write] [--kv-cache-layouts layer,cross-layer]]

Each request moves ``size`` bytes (``size / block`` blocks) from a server process to this
process into a preallocated buffer, request/response, one request at a time:

* raw: one TCP connection; the client sends an 8-byte size, the server ``sendall``s that many
  bytes from a preallocated buffer, the client ``recv_into``s its preallocated buffer.
* grpc: a KVStoreServer (with a token, like a cluster) holding the blocks; a
  GrpcTransferBackend receiver fetches them by key into a preallocated tensor.
* grpc floor (``--floor``): what grpcio itself costs, no pdcluster code: a bare server holding
  one prebuilt message per size answers each request on one long-lived bidirectional stream
  (identity serializers); the client copies the reply into the same preallocated buffer.
* gloo: a TorchPairChannel; the client sends a 16-byte request tensor, the server answers with
  a TorchKVSender, a TorchTransferBackend receiver receives into a preallocated tensor.
* Mooncake Transfer Engine (``--mooncake``; the ``pdcluster[mooncake]`` extra, TCP transport,
  P2PHANDSHAKE metadata, so no metadata server): both sides register their buffers once; the
  client pulls. ``te`` is TE's best pattern, one contiguous read of ``size`` bytes; ``te-blocks``
  reads the same bytes as one batch of ``block``-sized reads from scattered source blocks
  into consecutive destination blocks, the pattern a paged cache gives a connector.
  ``te-split N`` reads the contiguous bytes as N concurrent reads (``--te-split``; async, each
  polled without blocking every ``_POLL_S``): TE's TCP transport moves each on its own
  connection. ``--te-write`` adds ``te-write N``: the same bytes pushed (written) into the
  server's memory as N concurrent async writes, the pattern of a prefill-side write mode.
  ``pdc-te`` is pdcluster's ``--kv-transfer mooncake`` path: a MooncakeConnector offered the
  request's blocks of a paged cache (8 layers), and a MooncakeTransferBackend receiver reads
  them into consecutive blocks of the client's registered paged cache and writes the release
  word. ``pdc-te scattered`` is the same into scattered destination blocks (a cache's free
  blocks under LRU order, the usual case). ``churned`` takes its destination blocks as the
  decode's block pool hands them out after churn (`_churned_tables`: requests of 8-64 blocks
  arriving, growing and leaving; engine.core.block_pool.BlockPool with the run window that
  layout gets by default, engine.config.EngineConfig.resolved_block_run_window). Each runs
  for every cache layout of ``--kv-cache-layouts`` (engine.kv_cache), both ends alike:
  ``layer`` (a layer-major region; a read per layer, K|V and run of blocks, or staged) and
  ``cross-layer`` (a block-major region; a read per run of blocks). "best TE" is the fastest
  of ``te`` and the ``te-split`` rows; "best pair" the faster of grpc and gloo.

GB/s = 1e9 bytes per second; each cell is the median of ``--rounds`` rounds that interleave the
backends (the load of a shared machine swings), ``--min-time`` seconds per cell in all.
The bar the KV pool aims at: grpc >= 0.5x raw at >= 1 MiB. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import multiprocessing as mp
import os
import random
import socket
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pdcluster.engine.core.hashing import block_keys, make_namespace  # noqa: E402
from pdcluster.kvstore.config import KVStoreConfig, KVTransferConfig  # noqa: E402
from pdcluster.kvstore.layout import BlockLayout  # noqa: E402
from pdcluster.kvstore.server import channel_options  # noqa: E402
from pdcluster.kvstore.tail_store import TailStore  # noqa: E402
from pdcluster.kvstore.transport.base import FetchRequest  # noqa: E402
from tests.kvstore.tensor_dest import TensorDest, wait  # noqa: E402

TOKEN = "benchmark-token"
_REQUEST_TAG, _DATA_TAG = 1, 2
_POLL_S = 1e-4  # how often a finished transfer is looked for (transfers are polled)


def _keys(num_blocks: int) -> list[bytes]:
    return block_keys(list(range(num_blocks)), 1, make_namespace("transfer-benchmark"))


def _blocks(num_blocks: int, block_elems: int) -> torch.Tensor:
    return torch.randn(num_blocks, block_elems, generator=torch.Generator().manual_seed(0))


# ---- server processes ---------------------------------------------------------------------

def _raw_server(ready: mp.Queue, max_bytes: int) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    ready.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = memoryview(bytearray(os.urandom(1 << 20)) * (max_bytes >> 20 or 1))
    while header := conn.recv(8):
        conn.sendall(payload[:int.from_bytes(header, "little")])


class _HeldBlocks(TailStore):
    """The grpc server's blocks in a dict (kvstore.server.BlockStore), so the cells time the
    transfer, not a store (a node's TieredNodeStore adds one arena copy per block read)."""

    def __init__(self) -> None:
        super().__init__(capacity_bytes=1 << 20, tail_ttl_s=60.0)
        self.blocks: dict[bytes, tuple[bytes, BlockLayout]] = {}

    def put(self, key: bytes, payload: bytes, layout: BlockLayout) -> None:
        self.blocks[key] = (payload, layout)

    def get_many(self, keys) -> list[tuple[bytes, BlockLayout] | None]:
        return [self.blocks.get(k) for k in keys]

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "num_blocks": len(self.blocks), "evictions": 0}


def _grpc_server(ready: mp.Queue, num_blocks: int, block_elems: int) -> None:
    from pdcluster.kvstore.client import KVStoreClient
    from pdcluster.kvstore.server import KVStoreServer

    server = KVStoreServer(KVStoreConfig(token=TOKEN), _HeldBlocks())
    server.start()
    with KVStoreClient(server.address, token=TOKEN) as client:
        client.put_blocks(_keys(num_blocks), _blocks(num_blocks, block_elems))
    ready.put(server.address)
    time.sleep(1e6)


def _floor_server(ready: mp.Queue, sizes: list[int]) -> None:
    from concurrent import futures

    import grpc

    replies = {size: os.urandom(size) for size in sizes}

    def fetch(requests, context):
        for request in requests:
            yield replies[int.from_bytes(request, "little")]
    options = channel_options(-1)  # unlimited message size
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=options)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "floor", {"Fetch": grpc.stream_stream_rpc_method_handler(fetch)}),))
    ready.put(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
    server.start()
    server.wait_for_termination()


def _gloo_server(ready: mp.Queue, num_blocks: int, block_elems: int, chunk_bytes: int) -> None:
    from pdcluster.kvstore.transport.torch_pair.backend import TorchKVSender
    from pdcluster.kvstore.transport.torch_pair.channel import TorchPairChannel

    blocks = _blocks(num_blocks, block_elems)
    channel = TorchPairChannel(0, "127.0.0.1", 0, timeout_s=60.0, token=TOKEN,
                               chunk_bytes=chunk_bytes)
    ready.put(channel.address)
    channel.connect()
    request = torch.empty(2, dtype=torch.int64)
    while True:
        channel.wait(channel.recv(request, _REQUEST_TAG), 3600.0)
        sender = TorchKVSender(channel)
        sender.start(blocks[:int(request[0])], _DATA_TAG, 60.0)
        wait(sender, interval_s=_POLL_S)
        sender.result()


def _te_engine():
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Mooncake TransferEngine.initialize failed")
    return engine


def _te_server(ready: mp.Queue, num_blocks: int, block_elems: int) -> None:
    engine = _te_engine()
    blocks = _blocks(num_blocks, block_elems)
    if engine.register_memory(blocks.data_ptr(), blocks.nbytes) != 0:
        raise RuntimeError("Mooncake register_memory failed")
    ready.put((f"127.0.0.1:{engine.get_rpc_port()}", blocks.data_ptr()))
    time.sleep(1e6)


def _pdc_cache(num_blocks: int, block_nbytes: int, layout: str):
    """A float32 paged cache of 8 layers whose wire block is ``block_nbytes``."""
    from pdcluster.engine.kv_cache import PagedKVCache

    span = block_nbytes // 16  # one block of one (layer, K|V)
    if span % (16 * 4 * 4):
        raise ValueError("the block size must be a multiple of 4 KiB for pdc-te")
    return PagedKVCache.attention(8, num_blocks, 16, 4, span // (16 * 4 * 4), torch.float32, "cpu",
                        layout=layout)


def _pdc_te_server(ready: mp.Queue, sizes: list[int], block_nbytes: int, layout: str) -> None:
    from pdcluster.kvstore.transport.mooncake.connector import MooncakeConnector

    num_blocks = max(sizes) // block_nbytes
    cache = _pdc_cache(num_blocks, block_nbytes, layout)
    for tensors in (cache.k, cache.v):
        for t in tensors:
            t.normal_()
    transfer = KVTransferConfig(backend="mooncake", kv_connector_extra_config={
        "source_buffer_bytes": sum(sizes) + (1 << 20)})
    connector = MooncakeConnector(transfer, lease_s=24 * 3600)
    connector.register_kv_caches(cache)
    request = type("R", (), {"request_id": "bench", "runs_alone": False, "max_tokens": 16,
                             "kv_transfer_params": None})
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    regions = {size: connector.request_finished(request, order[:size // block_nbytes])[1]
               ["kv_region"] for size in sizes}
    ready.put(regions)
    time.sleep(1e6)


def _churned_tables(num_blocks: int, sizes: list[int], run_window: int, seed: int = 3
                    ) -> dict[int, list[list[int]]]:
    """Block tables of ``sizes`` blocks (each at most a quarter of the pool), as a BlockPool
    of ``num_blocks`` with ``run_window`` hands them out once requests of 8-64 blocks (as many
    at once as 64-block requests would fill two thirds of the pool with; smaller ones in a
    small pool) have come, grown a block per 16 decode steps, and gone for a while: 16 tables
    per size."""
    from pdcluster.engine.core.block_pool import BlockPool

    rng = random.Random(seed)
    pool = BlockPool(num_blocks, run_window=run_window)
    live: list[list] = []  # [block table, steps left, tokens]
    largest = max(1, min(64, num_blocks // 16))
    concurrency = max(1, num_blocks * 2 // (3 * largest))
    tables: dict[int, list[list[int]]] = {n: [] for n in sizes}
    for step in range(4000):
        while len(live) < concurrency:
            tokens = rng.randint(min(8, largest) * 16, largest * 16)
            if -(-tokens // 16) > pool.num_free_blocks:
                break
            live.append([pool.allocate(-(-tokens // 16)), rng.randint(32, 256), tokens])
        if step >= 2400 and step % 100 == 0:  # the pool in steady state
            for n in sizes:
                while n > pool.num_free_blocks:  # the oldest requests end early
                    pool.free(live.pop(0)[0])
                table = pool.allocate(n)
                tables[n].append(table)
                pool.free(table)
        for seq in list(live):
            seq[1] -= 1
            seq[2] += 1
            if -(-seq[2] // 16) > len(seq[0]) and pool.num_free_blocks:
                seq[0] += pool.allocate(1)
            if seq[1] == 0:
                pool.free(seq[0])
                live.remove(seq)
    return tables


def _pdc_te_client(regions: dict, block_nbytes: int, layout: str,
                   tables: str = "consecutive") -> Callable[[int], None]:
    """Fetches into ``tables`` destination blocks: consecutive, scattered (a random
    permutation), or churned (`_churned_tables`, cycled through)."""
    from pdcluster.engine.config import EngineConfig
    from pdcluster.kvstore.transport.dest import CacheDest
    from pdcluster.kvstore.transport.mooncake.backend import MooncakeTransferBackend

    backend = MooncakeTransferBackend(KVTransferConfig(backend="mooncake", timeout_s=60.0))
    num_blocks = (4 if tables == "churned" else 2) * max(regions) // block_nbytes
    cache = _pdc_cache(num_blocks, block_nbytes, layout)
    spread = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(2)).tolist()
    counts = sorted({region.num_blocks for region in regions.values()})
    if tables == "churned":
        window = EngineConfig(kv_cache_layout=layout).resolved_block_run_window()
        churned = {n: itertools.cycle(t) for n, t in
                   _churned_tables(num_blocks, counts, window).items()}
    elif tables not in ("consecutive", "scattered"):
        raise ValueError(f"unknown destination tables {tables!r}")

    def fetch(size: int) -> None:
        region = regions[size]
        n = region.num_blocks
        table = (next(churned[n]) if tables == "churned" else spread[:n]
                 if tables == "scattered" else list(range(n)))
        dest = CacheDest(lambda start, blocks: None, table, cache, (cache.block_nbytes,),
                         torch.uint8)
        receiver = backend.create_receiver()
        receiver.start(FetchRequest(region.session, (b"k",) * region.num_blocks,
                                    region=region), dest)
        wait(receiver, interval_s=_POLL_S)
        assert receiver.result() == size
    return fetch


def _spawn(target, *args):
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    proc = ctx.Process(target=target, args=(ready, *args), daemon=True)
    proc.start()
    return proc, ready.get(timeout=120)


# ---- clients ------------------------------------------------------------------------------

def _raw_client(port: int, max_bytes: int) -> Callable[[int], None]:
    conn = socket.create_connection(("127.0.0.1", port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(max_bytes))

    def fetch(size: int) -> None:
        conn.sendall(size.to_bytes(8, "little"))
        got = 0
        while got < size:
            n = conn.recv_into(buf[got:size])
            if n == 0:
                raise ConnectionError("raw server closed the connection")
            got += n
    return fetch


def _floor_client(address: str, max_bytes: int) -> Callable[[int], None]:
    import queue

    import grpc

    options = channel_options(-1)  # unlimited message size
    channel = grpc.insecure_channel(address, options=options)
    requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    replies = channel.stream_stream("/floor/Fetch")(iter(requests.get, None))
    buf = memoryview(bytearray(max_bytes))

    def fetch(size: int) -> None:
        requests.put(size.to_bytes(8, "little"))
        buf[:size] = next(replies)
    return fetch


def _receiver_client(backend, address: str, dest: torch.Tensor, keys: list[bytes],
                     before: Callable[[int], None] | None = None) -> Callable[[int], None]:
    block_nbytes = dest[0].numel() * dest.element_size()

    def fetch(size: int) -> None:
        n = size // block_nbytes
        if before is not None:
            before(n)
        receiver = backend.create_receiver()
        receiver.start(FetchRequest(address, tuple(keys[:n]), tag=_DATA_TAG, deadline_s=60.0),
                       TensorDest(dest[:n]))
        wait(receiver, interval_s=_POLL_S)
        assert receiver.result() == size
    return fetch


def _te_clients(segment: str, remote_base: int, dest: torch.Tensor, block_nbytes: int,
                splits: list[int], writes: bool) -> dict[str, Callable[[int], None]]:
    engine = _te_engine()
    if engine.register_memory(dest.data_ptr(), dest.nbytes) != 0:
        raise RuntimeError("Mooncake register_memory failed")
    num_blocks = dest.nbytes // block_nbytes
    # a paged cache's blocks of one request: scattered over the source, consecutive here
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    local = [dest.data_ptr() + i * block_nbytes for i in range(num_blocks)]
    remote = [remote_base + b * block_nbytes for b in order]

    def contiguous(size: int) -> None:
        if engine.transfer_sync_read(segment, dest.data_ptr(), remote_base, size) != 0:
            raise RuntimeError("Mooncake read failed")

    def blocks(size: int) -> None:
        n = size // block_nbytes
        if engine.batch_transfer_sync_read(segment, local[:n], remote[:n],
                                           [block_nbytes] * n) != 0:
            raise RuntimeError("Mooncake batch read failed")

    def split(size: int, count: int, write: bool = False) -> None:
        piece = size // count
        submit = engine.batch_transfer_async_write if write else engine.batch_transfer_async_read
        batches = [submit(segment, [dest.data_ptr() + i * piece], [remote_base + i * piece],
                          [piece]) for i in range(count)]
        while batches:
            statuses = [engine.transfer_check_status(b) for b in batches]
            if any(s < 0 for s in statuses):
                raise RuntimeError("Mooncake split transfer failed")
            batches = [b for b, s in zip(batches, statuses) if s == 0]
            if batches:
                time.sleep(_POLL_S)

    blocks(dest.nbytes)  # the bytes land where they should before anything is timed
    if not torch.equal(dest, _blocks(num_blocks, dest.shape[1])[order]):
        raise RuntimeError("Mooncake batch read delivered the wrong bytes")
    clients = {"te": contiguous, "te-blocks": blocks}
    for count in splits:
        dest.zero_()
        split(dest.nbytes, count)
        if not torch.equal(dest, _blocks(num_blocks, dest.shape[1])):
            raise RuntimeError("Mooncake split read delivered the wrong bytes")
        clients[f"te-split{count}"] = functools.partial(split, count=count)
        if writes:
            clients[f"te-write{count}"] = functools.partial(split, count=count, write=True)
    return clients


def _measure(fetch: Callable[[int], None], size: int, min_time_s: float) -> float:
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_time_s or count < 2:
        fetch(size)
        count += 1
    return size * count / elapsed / 1e9


def _measure_interleaved(clients: dict[str, Callable[[int], None]], size: int,
                         min_time_s: float, rounds: int) -> dict[str, float]:
    """Median GB/s per client over ``rounds`` interleaved rounds (robust to load swings)."""
    for fetch in clients.values():
        fetch(size)  # warm-up
    samples: dict[str, list[float]] = {name: [] for name in clients}
    for _ in range(rounds):
        for name, fetch in clients.items():
            samples[name].append(_measure(fetch, size, min_time_s / rounds))
    return {name: statistics.median(v) for name, v in samples.items()}


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _human(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="64K,256K,1M,4M,16M,64M")
    parser.add_argument("--block-kib", type=int, default=64, help="bytes per KV block, KiB")
    parser.add_argument("--min-time", type=float, default=1.5, help="seconds per cell")
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved rounds per size; the table shows their median")
    parser.add_argument("--chunk-kib", type=int, default=KVTransferConfig().max_chunk_bytes >> 10)
    parser.add_argument("--streams", type=int, default=KVTransferConfig().num_streams)
    parser.add_argument("--min-stream-kib", type=int,
                        default=KVTransferConfig().min_stream_bytes >> 10)
    parser.add_argument("--no-gloo", action="store_true")
    parser.add_argument("--floor", action="store_true",
                        help="add bare grpcio on a persistent stream (no pdcluster code)")
    parser.add_argument("--mooncake", action="store_true",
                        help="add Mooncake's Transfer Engine over TCP: one contiguous read, "
                             "and a batch of block reads (pdcluster[mooncake] extra)")
    parser.add_argument("--te-split", default="4,16",
                        help="with --mooncake: bare TE reading the contiguous bytes as this "
                             "many concurrent reads (comma-separated counts)")
    parser.add_argument("--te-write", action="store_true",
                        help="with --mooncake: also bare TE pushing (writing) the same bytes "
                             "into the server's memory, split as --te-split says")
    parser.add_argument("--kv-cache-layouts", default="layer,cross-layer",
                        help="with --mooncake: the paged cache layouts pdc-te runs with "
                             "(comma-separated: layer, cross-layer)")
    args = parser.parse_args(argv)
    splits = [int(n) for n in args.te_split.split(",") if n]
    layouts = [name for name in args.kv_cache_layouts.split(",") if name]

    from pdcluster.kvstore.transport.pool.grpc_backend import GrpcTransferBackend
    from pdcluster.kvstore.transport.torch_pair.backend import TorchTransferBackend

    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    block_nbytes = args.block_kib << 10
    if any(s % block_nbytes for s in sizes):
        parser.error(f"every size must be a multiple of the block size ({args.block_kib} KiB)")
    max_bytes = max(sizes)
    num_blocks, block_elems = max_bytes // block_nbytes, block_nbytes // 4
    keys = _keys(num_blocks)
    dest = torch.empty(num_blocks, block_elems)
    dest.zero_()  # fault the pages in, like the raw client's preallocated buffer
    config = KVTransferConfig(max_chunk_bytes=args.chunk_kib << 10, num_streams=args.streams,
                              min_stream_bytes=args.min_stream_kib << 10, timeout_s=60.0)
    kv_config = KVStoreConfig(token=TOKEN)

    raw_proc, port = _spawn(_raw_server, max_bytes)
    grpc_proc, grpc_address = _spawn(_grpc_server, num_blocks, block_elems)
    clients = {"raw": _raw_client(port, max_bytes)}
    grpc_backend = GrpcTransferBackend(config, kv_config)
    clients["grpc"] = _receiver_client(grpc_backend, grpc_address, dest, keys)
    procs = [raw_proc, grpc_proc]
    if args.floor:
        floor_proc, floor_address = _spawn(_floor_server, sizes)
        procs.append(floor_proc)
        clients["floor"] = _floor_client(floor_address, max_bytes)
    if not args.no_gloo:
        gloo_proc, gloo_address = _spawn(_gloo_server, num_blocks, block_elems,
                                         config.max_chunk_bytes)
        procs.append(gloo_proc)
        torch_backend = TorchTransferBackend(config.model_copy(update={"backend": "torch"}),
                                             kv_config)
        channel = torch_backend.channel(gloo_address, 60.0)
        request = torch.zeros(2, dtype=torch.int64)

        def ask(n: int) -> None:
            request[0] = n
            channel.wait(channel.send(request, _REQUEST_TAG), 60.0)
        clients["gloo"] = _receiver_client(torch_backend, gloo_address, dest, keys, before=ask)

    if args.mooncake:
        te_proc, (segment, remote_base) = _spawn(_te_server, num_blocks, block_elems)
        procs.append(te_proc)
        te_dest = torch.zeros(num_blocks, block_elems)  # its own buffer, registered with TE
        clients |= _te_clients(segment, remote_base, te_dest, block_nbytes, splits,
                               args.te_write)
        for layout in layouts:
            pdc_proc, regions = _spawn(_pdc_te_server, sizes, block_nbytes, layout)
            procs.append(pdc_proc)
            clients[f"pdc-te {layout}"] = _pdc_te_client(regions, block_nbytes, layout)
            for tables in ("scattered", "churned"):
                clients[f"{tables} {layout}"] = _pdc_te_client(regions, block_nbytes, layout,
                                                               tables)

    print(f"block {args.block_kib} KiB, chunk {args.chunk_kib} KiB, grpc streams "
          f"{args.streams} (min {args.min_stream_kib} KiB each), {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}\n")
    header = "| size | raw socket GB/s | grpc GB/s | grpc/raw |"
    header += "" if args.no_gloo else " gloo GB/s | gloo/raw |"
    header += " grpc floor GB/s | floor/raw |" if args.floor else ""
    if args.mooncake:
        header += " TE GB/s | TE/raw | TE blocks GB/s | TE blocks/raw |"
        header += "".join(f" TE split {n} GB/s | TE split {n}/raw |" for n in splits)
        if args.te_write:
            header += "".join(f" TE write {n} GB/s | TE write {n}/raw |" for n in splits)
        pdc_rows = [f"{kind} {layout}" for layout in layouts
                    for kind in ("pdc-te", "scattered", "churned")]
        header += "".join(f" {name} GB/s | /best TE | /best pair |" for name in pdc_rows)
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    try:
        for size in sizes:
            gbps = _measure_interleaved(clients, size, args.min_time, args.rounds)
            row = (f"| {_human(size)} | {gbps['raw']:.2f} | {gbps['grpc']:.2f} | "
                   f"{gbps['grpc'] / gbps['raw']:.2f} |")
            if "gloo" in gbps:
                row += f" {gbps['gloo']:.2f} | {gbps['gloo'] / gbps['raw']:.2f} |"
            if "floor" in gbps:
                row += f" {gbps['floor']:.2f} | {gbps['floor'] / gbps['raw']:.2f} |"
            te_rows = ["te", "te-blocks", *(f"te-split{n}" for n in splits),
                       *(f"te-write{n}" for n in splits if args.te_write)]
            for name in te_rows:
                if name in gbps:
                    row += f" {gbps[name]:.2f} | {gbps[name] / gbps['raw']:.2f} |"
            if "te" in gbps:
                best = max(gbps[name] for name in te_rows
                           if name != "te-blocks" and not name.startswith("te-write"))
                pair = max(gbps["grpc"], gbps.get("gloo", 0.0))
                row += "".join(f" {gbps[name]:.2f} | {gbps[name] / best:.2f} | "
                               f"{gbps[name] / pair:.2f} |" for name in pdc_rows)
            print(row, flush=True)
    finally:
        grpc_backend.close()
        for proc in procs:
            proc.kill()


if __name__ == "__main__":
    main()
