"""Same-node G2 reads: a worker process copies leased host-arena slots into its own tensor.

The owner (this process) fills a :class:`kvstore.arena.HostArena` and leases the slots; a worker
process (multiprocessing spawn) attaches an :class:`kvstore.arena.view.ArenaView` and times
``read_into(slots, out)`` into a preallocated tensor, for requests of 64 KiB to 64 MiB. In the
same worker, interleaved with it, it times a plain copy between two private preallocated buffers
of the same size (``torch`` ``copy_``, and ``numpy.copyto``): the memcpy bandwidth the read is
compared with. Target: read_into >= 0.5x memcpy.

Slots are read in arena order (``contiguous``: consecutive slots coalesce into one copy) and in a
random order (``scattered``: one copy per slot). Times are medians over repeats (>= 5, ~0.2 s per
measurement); GB/s is 1e9 bytes/s. ``lease us`` is the owner's acquire+release of the request's
keys in-process (the metadata work, RPC excluded).

Usage: .venv/bin/python benchmarks/shm_read.py [--block-kib 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import random
import statistics
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REQUEST_SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def median_seconds(fn, min_reps: int = 5, budget_s: float = 0.2) -> float:
    fn()  # warm up: first touch of pages
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def worker(spec: dict, requests: list[dict], threads: int, conn) -> None:
    """Attach, time read_into and memcpy for each request, send rows back over ``conn``."""
    import numpy as np
    import torch

    from pdcluster.kvstore.arena.view import ArenaView

    torch.set_num_threads(threads)
    rows = []
    with ArenaView(spec["name"], spec["num_slots"], spec["block_nbytes"]) as view:
        for req in requests:
            nbytes = req["nbytes"]
            out = torch.empty(nbytes, dtype=torch.uint8)
            src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
            src_np, dst_np = src.numpy(), dst.numpy()
            row = {"nbytes": nbytes, "num_slots": len(req["contiguous"])}
            # interleave, so load from other processes hits both alike
            for rnd in range(2):
                for name, fn in (
                    ("memcpy_torch", lambda: dst.copy_(src)),
                    ("memcpy_numpy", lambda: np.copyto(dst_np, src_np)),
                    ("contiguous", lambda: view.read_into(req["contiguous"], out)),
                    ("scattered", lambda: view.read_into(req["scattered"], out)),
                ):
                    t = median_seconds(fn)
                    row[name] = t if rnd == 0 else min(row[name], t)
            view.read_into(req["scattered"], out)
            row["sha256"] = hashlib.sha256(out.numpy().tobytes()).hexdigest()
            rows.append(row)
    conn.send(rows)
    conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--block-kib", type=int, default=64, help="slot size (one KV block)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in the worker")
    args = parser.parse_args()

    import torch

    from pdcluster.kvstore.arena import HostArena
    from pdcluster.kvstore.arena.view import ArenaView

    block_nbytes = args.block_kib << 10
    max_slots = max(REQUEST_SIZES) // block_nbytes
    arena = HostArena(2 * max_slots * block_nbytes, block_nbytes, node_id="bench")
    try:
        keys = [i.to_bytes(32, "little") for i in range(arena.num_slots)]
        slots = arena.reserve(keys)
        data = torch.randint(0, 256, (arena.num_slots, block_nbytes), dtype=torch.uint8)
        with ArenaView(arena.shm_name, arena.num_slots, block_nbytes) as view:
            view.write_from(slots, data)
        arena.commit(keys, slots)

        rng = random.Random(0)
        requests, leases, expected = [], [], []
        for nbytes in REQUEST_SIZES:
            n = max(1, nbytes // block_nbytes)
            first = rng.randrange(arena.num_slots - n + 1)
            contiguous = arena.acquire(keys[first : first + n])
            scattered_keys = rng.sample(keys, n)
            scattered = arena.acquire(scattered_keys)
            requests.append({"nbytes": n * block_nbytes, "contiguous": contiguous,
                             "scattered": scattered})
            leases += [contiguous, scattered]
            idx = torch.tensor([int.from_bytes(k, "little") for k in scattered_keys])
            expected.append(hashlib.sha256(data[idx].numpy().tobytes()).hexdigest())
            t = median_seconds(lambda: arena.release(arena.acquire(scattered_keys)))
            requests[-1]["lease_us"] = t * 1e6

        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        spec = {"name": arena.shm_name, "num_slots": arena.num_slots, "block_nbytes": block_nbytes}
        proc = ctx.Process(target=worker, args=(spec, requests, args.threads, child))
        proc.start()
        rows = parent.recv()
        proc.join()
        for lease in leases:
            arena.release(lease)
    finally:
        arena.close()

    gbps = lambda nbytes, s: nbytes / s / 1e9  # noqa: E731
    print(f"block {args.block_kib} KiB, worker torch threads {args.threads}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}\n")
    print("| request | slots | memcpy torch GB/s | memcpy numpy GB/s | read_into contiguous GB/s "
          "| ratio | read_into scattered GB/s | ratio | lease us |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row, req, want in zip(rows, requests, expected):
        assert row["sha256"] == want, "worker read different bytes"
        nb = row["nbytes"]
        memcpy = gbps(nb, row["memcpy_torch"])
        contig, scat = gbps(nb, row["contiguous"]), gbps(nb, row["scattered"])
        size = f"{nb >> 20} MiB" if nb >= 1 << 20 else f"{nb >> 10} KiB"
        print(f"| {size} | {row['num_slots']} | {memcpy:.2f} | {gbps(nb, row['memcpy_numpy']):.2f} "
              f"| {contig:.2f} | {contig / memcpy:.2f}x | {scat:.2f} | {scat / memcpy:.2f}x "
              f"| {req['lease_us']:.0f} |")


if __name__ == "__main__":
    main()
