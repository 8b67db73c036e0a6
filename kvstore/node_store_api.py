"""One node's KV store behind one facade, shaped as Mooncake Store's Python API
(``MooncakeDistributedStore``: put / get / is_exist / remove, plus leases): callers see keyed
blocks, never tiers, slots or transports.

Two implementations, one per way of reaching a node's store:

* ``kvstore.node_client.NodeStoreClient``: a worker on the store's own node; metadata over Ray
  RPC to the node's KV store actor, bytes through the shared-memory arena.
* ``kvstore.client.KVStoreClient``: any node's store over gRPC.

Keys are 32-byte chained sha256 block keys (``engine.core.hashing``). Blocks are full KV blocks of
the cluster's one layout: a tensor ``[n, *block_shape]`` (float32, bfloat16, float16 or uint8; a
deployment's blocks are its KV cache spec's bytes, uint8).

Rules the store keeps whatever the transport:

* ``put`` is content-addressed: a key already present is kept as it is (not rewritten).
* ``get`` serves the leading run of present keys, as a prefix cache consumes them: it stops at
  the first miss.
* A pinned block stays in host DRAM (G2): never evicted, never demoted to SSD, and ``remove``
  skips it, until it is unpinned (Mooncake Store refuses to remove a leased object). Pins are
  not counted: one ``pin(keys, False)`` unpins whatever pinned them. A store that restarts
  comes back empty, pins included. While pins (and reads or writes in flight) hold all of G2,
  ``put`` of a new key fails.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

from pdcluster.kvstore.errors import BlockLayoutError
from pdcluster.kvstore.index.base import check_keys
from pdcluster.kvstore.layout import BlockLayout

#: Tiers ``get`` reports a block came from: the node's host DRAM arena (G2) or its SSD (G3;
#: promoted to G2 on the way), kvstore.index.base's HOST and SSD; or REMOTE, a store reached
#: over gRPC, whose reply does not say which of its tiers served the block.
REMOTE = "remote"

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "uint8": torch.uint8,
}
_DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def layout_of(block_shape: Sequence[int], dtype: torch.dtype) -> BlockLayout:
    """The BlockLayout of one block of ``block_shape`` and torch ``dtype``.

    Raises BlockLayoutError: a dtype other than float32/bfloat16/float16/uint8, or an empty block.
    """
    if dtype not in _DTYPE_NAMES:
        raise BlockLayoutError(f"unsupported dtype {dtype}; expected one of {sorted(TORCH_DTYPES)}")
    layout = BlockLayout(_DTYPE_NAMES[dtype], tuple(int(d) for d in block_shape))
    if layout.nbytes == 0:
        raise BlockLayoutError(f"empty block shape {layout.shape}")
    return layout


def blocks_layout(keys: Sequence[bytes], blocks: torch.Tensor) -> BlockLayout:
    """The layout of each of ``blocks`` [n, *block_shape], the blocks of n ``keys``.

    Raises:
        ValueError: a key is not 32 bytes.
        BlockLayoutError: ``blocks.shape[0] != len(keys)``, or as :func:`layout_of`.
    """
    check_keys(keys)
    if blocks.dim() < 1 or blocks.shape[0] != len(keys):
        raise BlockLayoutError(f"blocks of shape {tuple(blocks.shape)} for {len(keys)} key(s)")
    return layout_of(blocks.shape[1:], blocks.dtype)


class NodeStore(abc.ABC):
    """Keyed full blocks of one node's store. Implementations are thread-safe.

    Errors every method may raise: ValueError for a key that is not 32 bytes (nothing is
    sent); kvstore.errors.KVStoreError subclasses for a failed call, e.g. KVTransferError when
    the store cannot be reached in time (the Ray-backed client: Ray's errors for a store that
    stays dead or does not answer). ``put`` and ``get`` raise BlockLayoutError for blocks whose
    count, shape or dtype do not match ``keys`` and the store's layout.
    """

    @abc.abstractmethod
    def put(self, keys: Sequence[bytes], blocks: torch.Tensor) -> None:
        """Store ``blocks[i]`` under ``keys[i]``; a key already present is kept as it is.

        Args:
            keys: n keys.
            blocks: [n, *block_shape] in the store's dtype, any device.

        Raises:
            StoreCapacityError: no room for a new block: pins and reads or writes in flight
                hold all of G2 (the same-node client raises its subclass ArenaFullError).
        """

    @abc.abstractmethod
    def get(self, keys: Sequence[bytes], out: torch.Tensor) -> list[str | None]:
        """Copy the blocks of the leading run of present keys into ``out[:run]``.

        Args:
            keys: n keys.
            out: [n, *block_shape] in the store's dtype; rows past the run are left as they are.

        Returns:
            Per key, the tier its block came from (HOST, SSD, or REMOTE over gRPC), or ``None``
            for the first missing key and every key after it.
        """

    @abc.abstractmethod
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether the store holds its block in any tier. Touches no LRU order."""

    @abc.abstractmethod
    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop the keys' blocks from every tier and from the global index.

        A pinned key is skipped: it stays in every tier and is not counted.

        Returns:
            How many of ``keys`` were present and removed (a repeated key counts once).
        """

    @abc.abstractmethod
    def pin(self, keys: Sequence[bytes], pinned: bool = True) -> list[bool]:
        """Pin (or, with ``pinned=False``, unpin) the keys' blocks in host DRAM.

        Pinning a block held only on SSD first promotes it into G2.

        Returns:
            Per key, whether its block is present and now (un)pinned; ``False`` for a missing
            key, or for an SSD block that G2 had no room to take in.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release this handle's connections and mappings (the store keeps its blocks)."""
