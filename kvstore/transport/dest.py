"""Where a transfer's blocks land: a callback that gets them as they arrive.

A destination holds ``num_blocks`` request blocks (full blocks, then the tail) of one layout.
Backends hand it either raw little-endian bytes (grpc: straight from the received message) or
tensors (torch).
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch

from pdcluster.kvstore.errors import BlockLayoutError

#: Wire dtype names (kvstore.layout.DTYPE_ITEMSIZE) of the torch dtypes a block may have.
WIRE_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
    torch.uint8: "uint8",
}


class CallbackDest:
    """``num_blocks`` destination blocks of shape ``block_shape`` and dtype ``dtype``, handed to
    ``write(start, blocks)`` as they arrive (e.g. into a paged cache).

    ``blocks`` is a CPU tensor ``[k, *block_shape]`` for request blocks ``[start, start + k)``,
    read-only and valid only during the call (it may view the received message): copy it.
    Called from the backend's threads, one call at a time per transfer.
    """

    def __init__(self, write: Callable[[int, torch.Tensor], None], num_blocks: int,
                 block_shape: Sequence[int], dtype: torch.dtype):
        if dtype not in WIRE_DTYPES:
            raise BlockLayoutError(f"unsupported dtype {dtype}; expected one of "
                                   f"{sorted(WIRE_DTYPES.values())}")
        if sys.byteorder != "little":
            raise BlockLayoutError("KV transfers need a little-endian host")
        self.num_blocks = num_blocks
        self.block_shape = tuple(int(d) for d in block_shape)
        self.dtype = dtype
        self.block_nbytes = math.prod(self.block_shape) * dtype.itemsize
        if self.block_nbytes == 0:
            raise BlockLayoutError(f"empty block shape {self.block_shape}")
        self._write = write

    @property
    def wire_dtype(self) -> str:
        """The dtype's name on the wire (``float32`` | ``bfloat16`` | ``float16`` | ``uint8``)."""
        return WIRE_DTYPES[self.dtype]

    def write_bytes(self, start: int, payload: memoryview | bytes) -> None:
        """Blocks ``[start, start + len(payload) // block_nbytes)`` from raw bytes."""
        count = len(payload) // self.block_nbytes
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "array is not writable": we only read
            blocks = torch.from_numpy(np.frombuffer(payload, dtype=np.uint8))
        self._write(start, blocks.view(self.dtype).view(count, *self.block_shape))

    def write_tensor(self, start: int, blocks: torch.Tensor) -> None:
        """Blocks ``[start, start + len(blocks))`` from a ``[k, *block_shape]`` tensor."""
        self._write(start, blocks)


class CacheDest(CallbackDest):
    """A destination that is blocks ``block_ids`` of a paged cache (a BlockCache): a backend
    that can address the cache's memory (a one-sided engine that registered it) writes there
    directly; any other goes through ``write`` like a CallbackDest.

    ``cache`` None: only ``write`` may be used (e.g. a fault injection must see the blocks).
    """

    def __init__(self, write: Callable[[int, torch.Tensor], None], block_ids: Sequence[int],
                 cache, block_shape: Sequence[int], dtype: torch.dtype):
        super().__init__(write, len(block_ids), block_shape, dtype)
        self.block_ids = list(block_ids)
        self.cache = cache
