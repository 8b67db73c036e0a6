"""A worker's handle on its own node's KV store: metadata over Ray RPC, bytes through the
node's shared-memory arena (DESIGN.md "Tiers": workers on the node read and write G2 directly;
only metadata goes over RPC).

The store may restart with a new arena (kvstore/actor.py). Every pin names the arena this
client is attached to; when the store died under a batch (RayActorError) or has another arena
(StaleArenaError), the client re-attaches and runs the batch once more: a publish lands in the
new arena, a read finds what the new store holds (a miss costs recompute, never wrong bytes).
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence, TypeVar

import ray
import torch

from kvstore.arena.view import ArenaView
from kvstore.errors import KVStoreError, StaleArenaError

_T = TypeVar("_T")


MAX_BATCH = 64  # keys pinned per reserve or acquire, at most; fewer on a small arena


class NodeStoreClient:
    """publish() writes full blocks into G2; read() pins, copies out and unpins.

    Blocks are [n, *block_shape] tensors of the cluster's one block layout. Thread-safe as far
    as Ray handles and the arena are (each call pins its own slots).
    """

    def __init__(self, store_actor, timeout_s: float = 10.0) -> None:
        self.actor = store_actor
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self.reattachments = 0  # times the store restarted under this client
        self._attach()

    def _attach(self) -> None:
        info = ray.get(self.actor.arena_info.remote(), timeout=self.timeout_s)
        # the old view is not closed: a batch in another thread may still copy through it
        # (it unmaps once unreferenced). The view is replaced before the name, so a batch
        # never pairs the new name (slots the store hands out now) with the old view.
        self.view = ArenaView(info["shm_name"], info["num_slots"], info["block_nbytes"])
        self.arena: str = info["shm_name"]
        self.batch = max(1, min(MAX_BATCH, info["num_slots"] // 4))

    def _with_arena(self, batch: Callable[[ArenaView, str], _T]) -> _T:
        """``batch(view, arena)``; once more on a fresh attachment if the store restarted."""
        view, arena = self.view, self.arena
        try:
            return batch(view, arena)
        except (StaleArenaError, ray.exceptions.RayActorError):
            pass
        with self._lock:
            if self.arena == arena:  # not re-attached by another thread meanwhile
                try:
                    self._attach()
                except Exception as exc:  # noqa: BLE001 -- the store did not come back
                    raise KVStoreError(f"node KV store did not come back: {exc}") from exc
                self.reattachments += 1
            view, arena = self.view, self.arena
        return batch(view, arena)

    def publish(self, keys: Sequence[bytes], blocks: torch.Tensor) -> int:
        """Store blocks[i] under keys[i] unless already stored; returns how many were new.

        In batches of at most a quarter of the arena: a prompt larger than G2 still goes in
        whole, its first blocks demoted to G3 (or dropped without G3) as later ones arrive.
        """
        return sum(self._publish_batch(keys[i:i + self.batch], blocks[i:i + self.batch])
                   for i in range(0, len(keys), self.batch))

    def _publish_batch(self, keys: Sequence[bytes], blocks: torch.Tensor) -> int:
        def batch(view: ArenaView, arena: str) -> int:
            slots = ray.get(self.actor.reserve.remote(list(keys), arena), timeout=self.timeout_s)
            new = [i for i, s in enumerate(slots) if s is not None]
            try:
                if new:
                    view.write_from([slots[i] for i in new], blocks[new].contiguous())
            except BaseException:
                ray.get(self.actor.abort.remote(slots), timeout=self.timeout_s)
                raise
            ray.get(self.actor.commit.remote(list(keys), slots), timeout=self.timeout_s)
            return len(new)
        return self._with_arena(batch)

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
        def batch(view: ArenaView, arena: str) -> list[str | None]:
            found = ray.get(self.actor.acquire.remote(list(keys), arena), timeout=self.timeout_s)
            slots = [slot for slot, _ in found]
            try:
                rows = [i for i, s in enumerate(slots) if s is not None]
                if rows:
                    buf = torch.empty((len(rows), *out.shape[1:]), dtype=out.dtype)
                    view.read_into([slots[i] for i in rows], buf)
                    out[rows] = buf
            finally:
                ray.get(self.actor.release.remote(slots), timeout=self.timeout_s)
            return [tier for _, tier in found]
        return self._with_arena(batch)

    def close(self) -> None:
        self.view.close()
