"""The paged KV cache tensors of one worker (tier G1), and whole-block copies in and out.

Per layer, K and V are each [num_blocks, block_size, num_kv_heads, head_dim]. A block's
transferable unit (to the host tier, SSD or another worker) is one contiguous tensor of
`block_shape` = (num_layers, 2 (K, V), block_size, num_kv_heads, head_dim). A latent cache
(MLA, `kv_parts` 1) holds one entry per token instead of K and V: `v` is empty and the
block is (num_layers, 1, block_size, 1, latent + rope dims).

Two layouts hold them (`KV_CACHE_LAYOUTS`), as vLLM's KV connectors choose between
(`prefer_cross_layer_blocks`):
- "layer": a tensor per layer and K|V. Each layer's K (V) of a run of blocks is contiguous,
  which layer-wise streaming sends piece by piece.
- "cross-layer": one tensor [num_blocks, *block_shape]: every layer's K and V of a block are
  contiguous, in the transferable unit's own layout, so a run of consecutive blocks moves as
  one read and whole-block copies are one gather or scatter. Each layer's K and V are views
  whose blocks sit num_layers * 2 blocks apart; the kernels read such views (their blocks
  need not be adjacent, only each block's tokens and heads contiguous).

On the host, the tensors sit on fresh anonymous memory (`host_zeros`): zero by the kernel's
guarantee and faulted in as blocks are first written, rather than written whole at start-up,
where two workers zeroing a cache each compete for the same cores. The memory is committed as
it is touched too, so a cache larger than the host's free memory shows when it fills, not at
start-up: size `--num-kv-blocks` to the host.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Sequence

import torch


#: The cache's layouts (see the module docstring).
KV_CACHE_LAYOUTS = ("layer", "cross-layer")


class PagedKVCache:
    """K/V cache of `num_blocks` blocks for every layer; block ids index dim 0 of each tensor.

    Attributes:
        k, v: per layer, [num_blocks, block_size, num_kv_heads, head_dim] (views of `blocks`
            in the cross-layer layout).
        blocks: the cross-layer layout's one tensor [num_blocks, *block_shape]; None in the
            per-layer layout.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device,
        layout: str = "layer",
        kv_parts: int = 2,
    ) -> None:
        """`kv_parts`: 2 (K and V) or 1 (one latent entry per token, MLA). Raises ValueError
        for a dimension that is not positive, an unknown layout or a part count not 1 or 2."""
        if min(num_layers, num_blocks, block_size, num_kv_heads, head_dim) <= 0:
            raise ValueError("PagedKVCache dimensions must all be positive")
        if kv_parts not in (1, 2):
            raise ValueError(f"kv_parts must be 1 (latent) or 2 (K and V), got {kv_parts}")
        if layout not in KV_CACHE_LAYOUTS:
            raise ValueError(f"KV cache layout {layout!r}: expected one of {KV_CACHE_LAYOUTS}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.kv_parts = kv_parts
        self.block_shape: tuple[int, ...] = (num_layers, kv_parts, block_size, num_kv_heads,
                                             head_dim)
        self.block_nbytes: int = math.prod(self.block_shape) * torch.empty((), dtype=dtype).element_size()
        self.blocks: torch.Tensor | None = None
        self.k: list[torch.Tensor]
        self.v: list[torch.Tensor]
        if layout == "cross-layer":
            self.blocks = self._zeros((num_blocks, *self.block_shape))
            self.k = [self.blocks[:, layer, 0] for layer in range(num_layers)]
            self.v = [self.blocks[:, layer, 1] for layer in range(num_layers)] if kv_parts == 2 else []
        else:
            shape = (num_blocks, block_size, num_kv_heads, head_dim)
            self.k = [self._zeros(shape) for _ in range(num_layers)]
            self.v = [self._zeros(shape) for _ in range(num_layers)] if kv_parts == 2 else []

    def parts(self, layer: int) -> list[torch.Tensor]:
        """The layer's cache tensors: [K, V], or [latent]."""
        return [self.k[layer], self.v[layer]] if self.kv_parts == 2 else [self.k[layer]]

    @property
    def layout(self) -> str:
        """"cross-layer" when the cache is one tensor (`blocks`), else "layer"."""
        return "layer" if self.blocks is None else "cross-layer"

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.device.type == "cpu":
            return host_zeros(shape, self.dtype)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A new contiguous [len(block_ids), *block_shape] copy of the blocks, on the cache device.

        Raises ValueError for a block id outside [0, num_blocks)."""
        index = self.index_of(block_ids)
        if self.blocks is not None:
            return self.blocks.index_select(0, index)
        out = torch.empty((len(index), *self.block_shape), dtype=self.dtype, device=self.device)
        for layer in range(self.num_layers):
            for part, tensor in enumerate(self.parts(layer)):
                out[:, layer, part] = tensor[index]
        return out

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Overwrite the blocks with `data` [len(block_ids), *block_shape] (any device, cache dtype).

        Raises ValueError for a shape or dtype mismatch, an out-of-range or repeated block id."""
        index = self.write_index(block_ids, data, self.block_shape)
        data = data.to(self.device)
        if self.blocks is not None:
            self.blocks.index_copy_(0, index, data)
            return
        for layer in range(self.num_layers):
            for part, tensor in enumerate(self.parts(layer)):
                tensor[index] = data[:, layer, part]

    def write_index(self, block_ids: Sequence[int], data: torch.Tensor,
                    block_shape: tuple[int, ...]) -> torch.Tensor:
        """The int64 index of `block_ids` on the cache's device, once `data` is checked to be
        [len(block_ids), *block_shape] of the cache dtype. Raises ValueError for a shape or
        dtype mismatch, an out-of-range or repeated block id."""
        index = self.index_of(block_ids)
        expected = (len(index), *block_shape)
        if tuple(data.shape) != expected:
            raise ValueError(f"write_blocks: data shape {tuple(data.shape)} != expected {expected}")
        if data.dtype != self.dtype:
            raise ValueError(f"write_blocks: data dtype {data.dtype} != cache dtype {self.dtype}")
        if len(set(index.tolist())) != len(index):
            raise ValueError(f"write_blocks: repeated block ids in {list(block_ids)}")
        return index

    def index_of(self, block_ids: Sequence[int]) -> torch.Tensor:
        """`block_ids` as an int64 tensor on the cache's device. Raises ValueError for an id
        outside [0, num_blocks)."""
        ids = [int(b) for b in block_ids]
        bad = [b for b in ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad[:5]} out of range [0, {self.num_blocks})")
        return torch.tensor(ids, dtype=torch.int64, device=self.device)


#: transparent huge pages are 2 MiB on x86-64 and the usual arm64 kernels
_HUGE_PAGE = 2 << 20


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor of `shape` and `dtype` on its own anonymous mapping (mmap(2): the
    kernel hands out zeroed pages on first touch), so nothing is written until it is used.

    Like torch's own CPU allocator under THP_MEM_ALLOC_ENABLE=1 (c10's alloc_cpu), the data
    starts on a 2 MiB boundary and the mapping is advised for transparent huge pages. The
    mapping lives as long as the tensor (or a view of it). Raises OSError when the mapping
    cannot be made.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    huge = os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" and hasattr(mmap, "MADV_HUGEPAGE")
    # private: a shared anonymous mapping is shmem, which THP's madvise mode does not cover
    buffer = mmap.mmap(-1, nbytes + (_HUGE_PAGE if huge else 0),
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    start = 0
    if huge:
        buffer.madvise(mmap.MADV_HUGEPAGE)
        start = (-flat.data_ptr()) % _HUGE_PAGE
    return flat[start:start + nbytes].view(dtype).view(shape)
