"""The paged KV cache tensors of one worker (tier G1), and whole-block copies in and out.

What a block holds is its KVCacheSpec (engine.kv_cache_spec): for the model's attention
group, per layer K and V [num_blocks, block_size, num_kv_heads, head_dim] (or one MLA latent,
`v` then empty). The unit a block moves as (to the host tier, SSD or another worker) is its
bytes, uint8 [block_nbytes], the spec's regions in order.

Two layouts hold them (`KV_CACHE_LAYOUTS`), as vLLM's KV connectors choose between
(`prefer_cross_layer_blocks`):
- "layer": a tensor per layer and region. Each layer's K (V) of a run of blocks is
  contiguous, which layer-wise streaming sends piece by piece.
- "cross-layer": one uint8 tensor [num_blocks, block_nbytes]: a block's regions are
  contiguous, in the moved unit's own layout, so a run of consecutive blocks moves as one read
  and whole-block copies are one gather or scatter. Each layer's K and V are typed views whose
  blocks sit block_nbytes apart; the kernels read such views (their blocks need not be
  adjacent, only each block's tokens and heads contiguous).

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

from pdcluster.engine.kv_cache_spec import KVCacheSpec, region_view

#: The cache's layouts (see the module docstring).
KV_CACHE_LAYOUTS = ("layer", "cross-layer")


class PagedKVCache:
    """The blocks of one KVCacheSpec, `num_blocks` of them; block ids index dim 0 of each tensor.

    Attributes:
        spec: what a block holds; block_nbytes: its bytes.
        k, v: the attention group's per-layer [num_blocks, block_size, num_kv_heads, head_dim]
            (an MLA latent in `k`, `v` empty); views of `blocks` in the cross-layer layout.
        dtype: the attention group's dtype (what the kernels read).
        blocks: the cross-layer layout's one tensor, uint8 [num_blocks, block_nbytes]; None in
            the per-layer layout.
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: str | torch.device,
                 layout: str = "layer") -> None:
        """Raises ValueError for `num_blocks` not positive or an unknown layout."""
        if num_blocks <= 0:
            raise ValueError(f"PagedKVCache needs num_blocks > 0, got {num_blocks}")
        if layout not in KV_CACHE_LAYOUTS:
            raise ValueError(f"KV cache layout {layout!r}: expected one of {KV_CACHE_LAYOUTS}")
        self.spec = spec
        self.num_layers = spec.num_layers
        self.num_blocks = num_blocks
        self.block_size = spec.block_size
        self.device = torch.device(device)
        self.block_nbytes: int = spec.block_nbytes
        self.blocks: torch.Tensor | None = None
        if layout == "cross-layer":
            self.blocks = self._zeros((num_blocks, self.block_nbytes), torch.uint8)
            tensors = [region_view(self.blocks, r) for r in spec.regions]
        else:
            tensors = [self._zeros((num_blocks, *r.tensor.shape), r.tensor.dtype)
                       for r in spec.regions]
        #: per region of spec.regions, its tensor [num_blocks, *shape]
        self.tensors: list[torch.Tensor] = tensors
        attention = [(r, t) for r, t in zip(spec.regions, tensors) if r.group == 0]
        self.k: list[torch.Tensor] = [t for r, t in attention if r.tensor.name in ("k", "latent")]
        self.v: list[torch.Tensor] = [t for r, t in attention if r.tensor.name == "v"]
        self.dtype: torch.dtype = spec.groups[0].tensors[0].dtype

    @classmethod
    def attention(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                  head_dim: int, dtype: torch.dtype, device: str | torch.device,
                  layout: str = "layer", kv_parts: int = 2) -> PagedKVCache:
        """The cache of a model's one attention group (KVCacheSpec.attention). Raises
        ValueError for a dimension that is not positive or a part count not 1 or 2."""
        if min(num_layers, num_blocks, block_size, num_kv_heads, head_dim) <= 0:
            raise ValueError("PagedKVCache dimensions must all be positive")
        spec = KVCacheSpec.attention(num_layers, block_size, num_kv_heads, head_dim, dtype,
                                     kv_parts)
        return cls(spec, num_blocks, device, layout)

    def parts(self, layer: int) -> list[torch.Tensor]:
        """The tensors of one layer (counted over every group), in the spec's order."""
        return [t for r, t in zip(self.spec.regions, self.tensors) if r.layer == layer]

    @property
    def layout(self) -> str:
        """"cross-layer" when the cache is one tensor (`blocks`), else "layer"."""
        return "layer" if self.blocks is None else "cross-layer"

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.device.type == "cpu":
            return host_zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A new uint8 [len(block_ids), block_nbytes] copy of the blocks, on the cache device.

        Raises ValueError for a block id outside [0, num_blocks)."""
        index = self.index_of(block_ids)
        if self.blocks is not None:
            return self.blocks.index_select(0, index)
        make = torch.zeros if self.spec.padded else torch.empty
        out = make((len(index), self.block_nbytes), dtype=torch.uint8, device=self.device)
        for region, tensor in zip(self.spec.regions, self.tensors):
            region_view(out, region).copy_(tensor[index])
        return out

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Overwrite the blocks with `data`, uint8 [len(block_ids), block_nbytes] (any device).

        Raises ValueError for a shape or dtype mismatch, an out-of-range or repeated block id."""
        index = self.write_index(block_ids, data, self.block_nbytes)
        data = data.to(self.device)
        if self.blocks is not None:
            self.blocks.index_copy_(0, index, data)
            return
        for region, tensor in zip(self.spec.regions, self.tensors):
            tensor[index] = region_view(data, region)

    def read_layer(self, block_ids: Sequence[int], layer: int) -> torch.Tensor:
        """One layer's regions of the blocks: a new uint8 [len(block_ids), end - start] copy,
        (start, end) = spec.layer_span(layer). Raises ValueError for a bad block id or layer."""
        start, end = self.spec.layer_span(layer)
        index = self.index_of(block_ids)
        if self.blocks is not None:
            return self.blocks[index, start:end]
        out = torch.zeros((len(index), end - start), dtype=torch.uint8, device=self.device)
        for region, tensor in zip(self.spec.regions, self.tensors):
            if region.layer == layer:
                _shifted_view(out, region, start).copy_(tensor[index])
        return out

    def write_layer(self, block_ids: Sequence[int], layer: int, data: torch.Tensor) -> None:
        """Overwrite one layer's regions of the blocks with `data` (uint8 [len(block_ids),
        end - start], as read_layer gives). Raises ValueError for a bad block id or layer."""
        start, end = self.spec.layer_span(layer)
        index = self.index_of(block_ids)
        if tuple(data.shape) != (len(index), end - start) or data.dtype != torch.uint8:
            raise ValueError(f"write_layer: data {data.dtype} {tuple(data.shape)} != uint8 "
                             f"{(len(index), end - start)}")
        data = data.to(self.device)
        for region, tensor in zip(self.spec.regions, self.tensors):
            if region.layer == layer:
                tensor[index] = _shifted_view(data, region, start)

    def write_index(self, block_ids: Sequence[int], data: torch.Tensor,
                    block_nbytes: int) -> torch.Tensor:
        """The int64 index of `block_ids` on the cache's device, once `data` is checked to be
        uint8 [len(block_ids), block_nbytes]. Raises ValueError for a shape or dtype mismatch,
        an out-of-range or repeated block id."""
        index = self.index_of(block_ids)
        expected = (len(index), block_nbytes)
        if tuple(data.shape) != expected:
            raise ValueError(f"write_blocks: data shape {tuple(data.shape)} != expected {expected}")
        if data.dtype != torch.uint8:
            raise ValueError(f"write_blocks: data dtype {data.dtype}, blocks move as uint8 bytes")
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


def _shifted_view(layer_bytes: torch.Tensor, region, start: int) -> torch.Tensor:
    """`region` inside one layer's bytes (uint8 [n, span], the block's bytes from `start`)."""
    tensor, offset = region.tensor, region.offset - start
    return (layer_bytes[:, offset:offset + tensor.nbytes].view(tensor.dtype)
            .view(layer_bytes.shape[0], *tensor.shape))


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
