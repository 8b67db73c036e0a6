"""A worker's handle on its own node's KV store: metadata over Ray RPC, bytes through the
node's shared-memory arena (workers on the node read and write G2 directly, so block bytes
never cross RPC; only metadata does). The node store facade (kvstore.node_store_api) for same-node
workers.

The store may restart with a new arena (kvstore/actor.py). Every lease names the arena this
client is attached to; when the store died under a batch (RayActorError) or has another arena
(StaleArenaError), the client re-attaches and runs the batch once more: a put lands in the
new arena, a get finds what the new store holds (a miss costs recompute, never wrong bytes).
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence, TypeVar

import ray
import torch

from pdcluster.engine import ray_calls
from pdcluster.kvstore.arena.view import ArenaView
from pdcluster.kvstore.errors import BlockLayoutError, KVStoreError, StaleArenaError
from pdcluster.kvstore.index.base import check_keys
from pdcluster.kvstore.layout import BlockLayout
from pdcluster.kvstore.node_store_api import NodeStore, blocks_layout

_T = TypeVar("_T")


MAX_BATCH = 64  # keys leased per reserve or acquire, at most; fewer on a small arena


class NodeStoreClient(NodeStore):
    """put() writes full blocks into G2; get() leases, copies out and ends the leases;
    exists/remove/pin are one Ray call each.

    Blocks are [n, *block_shape] tensors of the cluster's one block layout (``self.layout``).
    Thread-safe as far as Ray handles and the arena are (each call leases its own slots).
    Errors: as kvstore.node_store_api.NodeStore; a store that died or restarted is retried
    once on a fresh attachment, then KVStoreError; a store that does not answer within
    ``timeout_s`` raises Ray's GetTimeoutError.
    """

    def __init__(self, store_actor, timeout_s: float = 10.0) -> None:
        self.actor = store_actor
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self.reattachments = 0  # times the store restarted under this client
        self._attach()

    def _attach(self) -> None:
        info = ray_calls.result(self.actor.arena_info.remote(), self.timeout_s)
        # the old view is not closed: a batch in another thread may still copy through it
        # (it unmaps once unreferenced). The view is replaced before the name, so a batch
        # never pairs the new name (slots the store hands out now) with the old view.
        self.view = ArenaView(info["shm_name"], info["num_slots"], info["block_nbytes"])
        self.layout: BlockLayout = info["layout"]
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

    def put(self, keys: Sequence[bytes], blocks: torch.Tensor) -> None:
        """Store blocks[i] under keys[i] unless already stored (see NodeStore.put).

        In batches of at most a quarter of the arena: a prompt larger than G2 still goes in
        whole, its first blocks demoted to G3 (or dropped without G3) as later ones arrive.
        """
        self._check_layout(keys, blocks)
        for i in range(0, len(keys), self.batch):
            self._put_batch(keys[i:i + self.batch], blocks[i:i + self.batch])

    def _put_batch(self, keys: Sequence[bytes], blocks: torch.Tensor) -> None:
        def batch(view: ArenaView, arena: str) -> None:
            slots = ray_calls.result(self.actor.reserve.remote(list(keys), arena), self.timeout_s)
            new = [i for i, s in enumerate(slots) if s is not None]
            try:
                if new:
                    view.write_from([slots[i] for i in new], blocks[new].contiguous())
            except BaseException:
                ray_calls.result(self.actor.abort.remote(slots), self.timeout_s)
                raise
            ray_calls.result(self.actor.commit.remote(list(keys), slots), self.timeout_s)
        self._with_arena(batch)

    def get(self, keys: Sequence[bytes], out: torch.Tensor) -> list[str | None]:
        """Copy the leading run of found keys' blocks into out (see NodeStore.get); tiers are
        "host", or "ssd" for a block promoted into G2 on the way. In batches, so one request
        never leases the arena whole; a batch with a miss is the last."""
        self._check_layout(keys, out)
        tiers: list[str | None] = []
        for start in range(0, len(keys), self.batch):
            tiers += self._get_batch(keys[start:start + self.batch],
                                     out[start:start + self.batch])
            if tiers[-1] is None:
                break
        return tiers + [None] * (len(keys) - len(tiers))

    def _get_batch(self, keys: Sequence[bytes], out: torch.Tensor) -> list[str | None]:
        def batch(view: ArenaView, arena: str) -> list[str | None]:
            found = ray_calls.result(self.actor.acquire.remote(list(keys), arena), self.timeout_s)
            slots = [slot for slot, _ in found]
            run = next((i for i, s in enumerate(slots) if s is None), len(slots))
            try:
                if run:
                    buf = torch.empty((run, *out.shape[1:]), dtype=out.dtype)
                    view.read_into(slots[:run], buf)
                    out[:run] = buf
            finally:
                ray_calls.result(self.actor.release.remote(slots), self.timeout_s)
            return [tier for _, tier in found[:run]] + [None] * (len(keys) - run)
        return self._with_arena(batch)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return self._call("exists", keys)

    def remove(self, keys: Sequence[bytes]) -> int:
        return self._call("remove", keys)

    def pin(self, keys: Sequence[bytes], pinned: bool = True) -> list[bool]:
        return self._call("pin", keys, pinned)

    def close(self) -> None:
        self.view.close()

    def _call(self, method: str, keys: Sequence[bytes], *args):
        """The store actor's key-level ``method``; once more if the store restarted."""
        check_keys(keys)
        remote = getattr(self.actor, method).remote
        return self._with_arena(
            lambda _view, _arena: ray_calls.result(remote(list(keys), *args), self.timeout_s))

    def _check_layout(self, keys: Sequence[bytes], blocks: torch.Tensor) -> None:
        layout = blocks_layout(keys, blocks)
        if layout != self.layout:
            raise BlockLayoutError(f"blocks of layout {layout} for a store of {self.layout}")
