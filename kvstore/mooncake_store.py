"""KV blocks in a Mooncake Store (`--kv-pool mooncake-store`): one client of a running
`mooncake_master`.

Mooncake Store keeps objects by string key in memory segments that its clients mount (each
prefill worker mounts `--dram-cache-gb`; the gateway's and the node stores' clients mount none)
and moves them with Mooncake's Transfer Engine. The store decides placement, replicas,
eviction and leases; it answers whether a key exists, not where. A block is one object: key
``pdcluster/<block key hex>`` (the block key already hashes the model and the tenant's
`cache_salt`, so tenants and models never share an object), value the block in the KV pool's
wire layout ([layers, K|V, block_size, num_kv_heads, head_dim], kvstore.layout).

Puts and gets go through one host staging buffer registered with the store once: a batch
larger than the buffer moves in several rounds. The client is thread-safe (one lock around the
buffer).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Sequence

import torch

from pdcluster.kvstore.errors import KVStoreError

log = logging.getLogger(__name__)

KEY_PREFIX = "pdcluster/"
_MISSING = ("--kv-pool mooncake-store needs Mooncake Store's client: pip install "
            "'pdcluster[mooncake]' (or [mooncake-cuda]), and the OS package libibverbs1")
#: the store's error code for a put of a key it holds already (ErrorCode::OBJECT_ALREADY_EXISTS)
_ALREADY_EXISTS = -705


class MooncakeStoreError(KVStoreError):
    """The Mooncake Store client could not be set up or a batch failed as a whole."""


def store_key(key: bytes) -> str:
    """The Mooncake Store object key of a block key."""
    return KEY_PREFIX + key.hex()


class MooncakeStoreClient:
    """One client of the Mooncake Store whose master is at `master` ("host:port").

    bind_host: where this client's Transfer Engine listens
        (kvstore.transport.mooncake.te_bind confines it there); a wildcard advertises this
        node's Ray IP. protocol: "tcp" | "rdma".
    segment_bytes: memory this client mounts into the store (0: none, a pure client).
    buffer_bytes: the registered staging buffer; a batch moves in rounds of at most this.

    connect_timeout_s: how long the master may take to accept a connection; the store's own
        setup waits on an unreachable master far longer, so it is probed first.

    Raises MooncakeStoreError: the `mooncake` package is missing, or the client could not
    connect to the master (then nothing of it stays open).
    """

    def __init__(self, master: str, bind_host: str = "127.0.0.1", protocol: str = "tcp",
                 segment_bytes: int = 0, buffer_bytes: int = 64 << 20,
                 connect_timeout_s: float = 5.0) -> None:
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise MooncakeStoreError(_MISSING) from exc
        from pdcluster.kvstore.transport.mooncake.te import advertised_host
        from pdcluster.kvstore.transport.mooncake.te_bind import confine_listeners

        master_host, _, port = master.rpartition(":")
        try:
            socket.create_connection((master_host.strip("[]"), int(port)), connect_timeout_s).close()
        except (OSError, ValueError) as exc:
            raise MooncakeStoreError(f"Mooncake Store master {master!r} unreachable: {exc}") \
                from exc
        confine_listeners(bind_host)
        self.master = master
        self._store = MooncakeDistributedStore()
        host = advertised_host(bind_host)
        if self._store.setup(host, "P2PHANDSHAKE", segment_bytes, buffer_bytes, protocol, "",
                             master) != 0:
            raise MooncakeStoreError(f"Mooncake Store client on {host} could not set up with "
                                     f"the master at {master} over {protocol}")
        self._buffer = torch.empty(buffer_bytes, dtype=torch.uint8)
        if self._store.register_buffer(self._buffer.data_ptr(), buffer_bytes) != 0:
            self._store.close()
            raise MooncakeStoreError("Mooncake Store register_buffer failed")
        self._lock = threading.Lock()

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether the store holds its block now (it may evict it any time after).
        Raises MooncakeStoreError when the master cannot be asked."""
        if not keys:
            return []
        found = self._store.batch_is_exist([store_key(k) for k in keys])
        if any(f < 0 for f in found):
            raise MooncakeStoreError(f"batch_is_exist failed: codes {sorted(set(found))}")
        return [f == 1 for f in found]

    def longest_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys the store holds."""
        return next((i for i, held in enumerate(self.exists(keys)) if not held), len(keys))

    def put(self, keys: Sequence[bytes], blocks: torch.Tensor) -> int:
        """Store blocks[i] (contiguous, on CPU, [n, ...]) under keys[i]; a key held already
        counts as stored. Returns how many leading keys are stored (it stops at the first the
        store refused: full, or unreachable)."""
        return self._batches(keys, blocks, put=True)

    def get(self, keys: Sequence[bytes], out: torch.Tensor) -> int:
        """Fill out[i] (CPU, [n, ...] contiguous) with keys[i]'s block for the longest run of
        leading keys the store returns whole; returns its length."""
        return self._batches(keys, out, put=False)

    def _batches(self, keys: Sequence[bytes], blocks: torch.Tensor, put: bool) -> int:
        if not len(keys):
            return 0
        flat = blocks.reshape(len(keys), -1).view(torch.uint8)
        size = flat.shape[1]
        per_round = self._buffer.numel() // size
        if per_round == 0:
            raise MooncakeStoreError(f"a block of {size} bytes exceeds the staging buffer")
        done = 0
        with self._lock:
            base = self._buffer.data_ptr()
            while done < len(keys):
                n = min(per_round, len(keys) - done)
                names = [store_key(k) for k in keys[done:done + n]]
                ptrs, sizes = [base + i * size for i in range(n)], [size] * n
                staging = self._buffer[:n * size].view(n, size)
                if put:
                    staging.copy_(flat[done:done + n])
                    codes = self._store.batch_put_from(names, ptrs, sizes)
                    ok = [c == 0 or c == _ALREADY_EXISTS for c in codes]
                else:
                    codes = self._store.batch_get_into(names, ptrs, sizes)
                    ok = [c == size for c in codes]
                got = next((i for i, good in enumerate(ok) if not good), n)
                if not put:
                    flat[done:done + got].copy_(staging[:got])
                done += got
                if got < n:
                    log.debug("Mooncake Store %s stopped at %s: code %s",
                              "put" if put else "get", names[got], codes[got])
                    break
        return done

    def close(self) -> None:
        """Unmount this client's segment (the store drops the objects it held)."""
        self._store.close()
