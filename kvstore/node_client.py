"""A worker's handle on its own node's KV store: metadata over Ray RPC, bytes through the
node's shared-memory arena (DESIGN.md "Tiers": workers on the node read and write G2 directly;
only metadata goes over RPC)."""

from __future__ import annotations

from typing import Sequence

import ray
import torch

from kvstore.arena.view import ArenaView


MAX_BATCH = 64  # keys pinned per reserve or acquire, at most; fewer on a small arena


class NodeStoreClient:
    """publish() writes full blocks into G2; read() pins, copies out and unpins.

    Blocks are [n, *block_shape] tensors of the cluster's one block layout. Thread-safe as far
    as Ray handles and the arena are (each call pins its own slots).
    """

    def __init__(self, store_actor, timeout_s: float = 10.0) -> None:
        self.actor = store_actor
        self.timeout_s = timeout_s
        info = ray.get(store_actor.arena_info.remote(), timeout=timeout_s)
        self.view = ArenaView(info["shm_name"], info["num_slots"], info["block_nbytes"])
        self.batch = max(1, min(MAX_BATCH, info["num_slots"] // 4))

    def publish(self, keys: Sequence[bytes], blocks: torch.Tensor) -> int:
        """Store blocks[i] under keys[i] unless already stored; returns how many were new.

        In batches of at most a quarter of the arena: a prompt larger than G2 still goes in
        whole, its first blocks demoted to G3 (or dropped without G3) as later ones arrive.
        """
        return sum(self._publish_batch(keys[i:i + self.batch], blocks[i:i + self.batch])
                   for i in range(0, len(keys), self.batch))

    def _publish_batch(self, keys: Sequence[bytes], blocks: torch.Tensor) -> int:
        slots = ray.get(self.actor.reserve.remote(list(keys)), timeout=self.timeout_s)
        new = [i for i, s in enumerate(slots) if s is not None]
        try:
            if new:
                self.view.write_from([slots[i] for i in new], blocks[new].contiguous())
        except BaseException:
            ray.get(self.actor.abort.remote(slots), timeout=self.timeout_s)
            raise
        ray.get(self.actor.commit.remote(list(keys), slots), timeout=self.timeout_s)
        return len(new)

    def read(self, keys: Sequence[bytes], out: torch.Tensor) -> list[str | None]:
        """Copy each found key's block into out[i]; returns the tier it was found in per key
        ("host", "ssd" — promoted to host on the way — or None for a miss). In batches, so one
        request never pins the arena whole."""
        tiers: list[str | None] = []
        for start in range(0, len(keys), self.batch):
            tiers += self._read_batch(keys[start:start + self.batch],
                                      out[start:start + self.batch])
        return tiers

    def _read_batch(self, keys: Sequence[bytes], out: torch.Tensor) -> list[str | None]:
        found = ray.get(self.actor.acquire.remote(list(keys)), timeout=self.timeout_s)
        slots = [slot for slot, _ in found]
        try:
            rows = [i for i, s in enumerate(slots) if s is not None]
            if rows:
                buf = torch.empty((len(rows), *out.shape[1:]), dtype=out.dtype)
                self.view.read_into([slots[i] for i in rows], buf)
                out[rows] = buf
        finally:
            ray.get(self.actor.release.remote(slots), timeout=self.timeout_s)
        return [tier for _, tier in found]

    def close(self) -> None:
        self.view.close()
