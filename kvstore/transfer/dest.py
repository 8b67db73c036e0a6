"""Where a transfer's blocks land: a pre-allocated tensor, or a callback.

A destination holds ``num_blocks`` request blocks (full blocks, then the tail) of one layout.
Backends hand it either raw little-endian bytes (grpc: straight from the received message) or
tensors (torch); :class:`TensorDest` also offers contiguous views so torch receives in place.
"""

from __future__ import annotations

import sys
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvstore.errors import BlockLayoutError
from kvstore.transfer.runs import coalesce_runs

#: Wire dtype names (kvstore.layout.DTYPE_ITEMSIZE) of the torch dtypes a block may have.
WIRE_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
}


class BlockDest(ABC):
    """``num_blocks`` destination blocks of shape ``block_shape`` and dtype ``dtype``."""

    def __init__(self, num_blocks: int, block_shape: Sequence[int], dtype: torch.dtype):
        if dtype not in WIRE_DTYPES:
            raise BlockLayoutError(f"unsupported dtype {dtype}; expected one of "
                                   f"{sorted(WIRE_DTYPES.values())}")
        if sys.byteorder != "little":
            raise BlockLayoutError("KV transfers need a little-endian host")
        self.num_blocks = num_blocks
        self.block_shape = tuple(int(d) for d in block_shape)
        self.dtype = dtype
        self.block_nbytes = int(np.prod(self.block_shape, dtype=np.int64)) * dtype.itemsize
        if self.block_nbytes == 0:
            raise BlockLayoutError(f"empty block shape {self.block_shape}")

    @property
    def wire_dtype(self) -> str:
        """The dtype's name on the wire (``float32`` | ``bfloat16`` | ``float16``)."""
        return WIRE_DTYPES[self.dtype]

    @abstractmethod
    def write_bytes(self, start: int, payload: memoryview | bytes) -> None:
        """Blocks ``[start, start + len(payload) // block_nbytes)`` from raw bytes."""

    @abstractmethod
    def write_tensor(self, start: int, blocks: torch.Tensor) -> None:
        """Blocks ``[start, start + len(blocks))`` from a ``[k, *block_shape]`` tensor."""

    def view(self, start: int, count: int) -> torch.Tensor | None:
        """A writable contiguous ``[count, *block_shape]`` view of those blocks, if one exists."""
        return None


class TensorDest(BlockDest):
    """Blocks in a block-major tensor ``pool`` [P, *block_shape] (contiguous, any device).

    Request block i lands in ``pool[block_ids[i]]``; ``block_ids`` defaults to ``0..P-1``
    (``pool`` is then the transfer's own staging buffer). Writes are coalesced: one copy per
    run of consecutive ids (:func:`kvstore.transfer.runs.coalesce_runs`).
    """

    def __init__(self, pool: torch.Tensor, block_ids: Sequence[int] | None = None):
        if pool.dim() < 2 or not pool.is_contiguous():
            raise BlockLayoutError(f"destination pool must be a contiguous [P, *block_shape] "
                                   f"tensor, got shape {tuple(pool.shape)}")
        ids = list(range(pool.shape[0])) if block_ids is None else [int(b) for b in block_ids]
        bad = [b for b in ids if not 0 <= b < pool.shape[0]]
        if bad:
            raise BlockLayoutError(f"block ids {bad[:5]} out of range [0, {pool.shape[0]})")
        super().__init__(len(ids), pool.shape[1:], pool.dtype)
        self.pool = pool
        self.block_ids = ids
        self._flat = pool.view(-1).view(torch.uint8)

    def write_bytes(self, start: int, payload: memoryview | bytes) -> None:
        count = len(payload) // self.block_nbytes
        src = np.frombuffer(payload, dtype=np.uint8)
        size = self.block_nbytes
        for run in coalesce_runs(self.block_ids[start:start + count], size, 1 << 62):
            out = self._flat[run.dest * size:(run.dest + run.count) * size]
            piece = src[run.src * size:(run.src + run.count) * size]
            if out.is_cpu:
                out.numpy()[:] = piece  # one memcpy, GIL released for large copies
            else:
                out.copy_(_readonly_tensor(piece), non_blocking=False)

    def write_tensor(self, start: int, blocks: torch.Tensor) -> None:
        ids = self.block_ids[start:start + blocks.shape[0]]
        for run in coalesce_runs(ids, self.block_nbytes, 1 << 62):
            self.pool[run.dest:run.dest + run.count].copy_(blocks[run.src:run.src + run.count])

    def view(self, start: int, count: int) -> torch.Tensor | None:
        first = self.block_ids[start]
        if self.block_ids[start:start + count] != list(range(first, first + count)):
            return None
        return self.pool[first:first + count]


class CallbackDest(BlockDest):
    """Blocks handed to ``write(start, blocks)`` as they arrive (e.g. into a paged cache).

    ``blocks`` is a CPU tensor ``[k, *block_shape]`` for request blocks ``[start, start + k)``,
    read-only and valid only during the call (it may view the received message): copy it.
    Called from the backend's threads, one call at a time per transfer.
    """

    def __init__(self, write: Callable[[int, torch.Tensor], None], num_blocks: int,
                 block_shape: Sequence[int], dtype: torch.dtype):
        super().__init__(num_blocks, block_shape, dtype)
        self._write = write

    def write_bytes(self, start: int, payload: memoryview | bytes) -> None:
        count = len(payload) // self.block_nbytes
        blocks = _readonly_tensor(np.frombuffer(payload, dtype=np.uint8))
        self._write(start, blocks.view(self.dtype).view(count, *self.block_shape))

    def write_tensor(self, start: int, blocks: torch.Tensor) -> None:
        self._write(start, blocks)


def as_dest(dest: BlockDest | torch.Tensor) -> BlockDest:
    """``dest`` itself, or a TensorDest over a tensor."""
    return dest if isinstance(dest, BlockDest) else TensorDest(dest)


def _readonly_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor viewing a read-only uint8 array without a copy (never written through)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "array is not writable": we only read
        return torch.from_numpy(array)
