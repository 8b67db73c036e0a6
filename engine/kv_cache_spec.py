"""What one KV block holds, described rather than known (vLLM v1's KV cache spec and KV cache
groups, vllm/v1/kv_cache_interface.py).

A block is ``block_size`` tokens of every layer of every group. A group (the model's attention
layers; later a draft model's, or layers of another kind) has its layers keep the same tensors
per block: K and V ``[block_size, kv_heads, head_dim]``, or an MLA latent, and whatever else a
block needs (e.g. a quantized block's scales).

The unit every tier and transport moves is the block's bytes, ``block_nbytes`` of them, its
regions in order group → layer → tensor, each at an offset aligned to its dtype::

    | group 0 layer 0: k v | group 0 layer 1: k v | ... | group 1 layer 0: k v scale | ...

For a model's one attention group this is exactly ``[layers, K|V, block_size, kv_heads,
head_dim]`` of the model dtype. Nothing that moves or stores a block reads what a region means:
the paged cache (engine.kv_cache) and tensor parallelism (which splits a region along its
``shard_dim``) are the only readers of the description.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class KVCacheTensorSpec:
    """One tensor each layer of a group keeps per block.

    Attributes:
        name: what attention calls it ("k", "v", "latent", a scale's name); unique in a group.
        dtype: its torch dtype.
        shape: its shape per block, e.g. (block_size, kv_heads, head_dim).
        shard_dim: the dim of ``shape`` tensor parallelism splits across ranks (the KV heads);
            None when every rank holds it whole (an MLA latent).
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    shard_dim: int | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of this tensor in one block."""
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """``num_layers`` layers that keep the same ``tensors`` per block."""

    name: str
    num_layers: int
    tensors: tuple[KVCacheTensorSpec, ...]


@dataclass(frozen=True)
class KVRegion:
    """One tensor of one layer inside a block: ``layer`` counts the layers of every group in
    order (group 0's first); ``offset`` is its first byte in the block."""

    group: int
    layer: int
    tensor: KVCacheTensorSpec
    offset: int

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes


@dataclass(frozen=True)
class KVCacheSpec:
    """The layout of one block: ``block_size`` tokens of every group's layers.

    Raises ValueError for no group, a group without layers or tensors, a repeated tensor name
    in a group, a dimension that is not positive, or a shard dim outside a shape.
    """

    block_size: int
    groups: tuple[KVCacheGroupSpec, ...]

    def __post_init__(self) -> None:
        if self.block_size <= 0 or not self.groups:
            raise ValueError(f"a KV cache spec needs block_size > 0 and a group, got "
                             f"{self.block_size}, {len(self.groups)} groups")
        for group in self.groups:
            names = [t.name for t in group.tensors]
            if group.num_layers <= 0 or not names or len(set(names)) != len(names):
                raise ValueError(f"group {group.name!r}: {group.num_layers} layers, tensors "
                                 f"{names} (need layers and distinct tensor names)")
            for t in group.tensors:
                if not t.shape or min(t.shape) <= 0:
                    raise ValueError(f"tensor {t.name!r} of group {group.name!r}: shape {t.shape}")
                if t.shard_dim is not None and not 0 <= t.shard_dim < len(t.shape):
                    raise ValueError(f"tensor {t.name!r}: shard_dim {t.shard_dim} outside "
                                     f"shape {t.shape}")

    @classmethod
    def attention(cls, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, kv_parts: int = 2) -> KVCacheSpec:
        """A model's one attention group: K and V [block_size, num_kv_heads, head_dim] split
        by heads (``kv_parts`` 2), or one latent [block_size, 1, head_dim] held whole on every
        rank (``kv_parts`` 1, MLA). Raises ValueError for another part count."""
        shape = (block_size, num_kv_heads, head_dim)
        if kv_parts == 2:
            tensors = (KVCacheTensorSpec("k", dtype, shape, 1), KVCacheTensorSpec("v", dtype, shape, 1))
        elif kv_parts == 1:
            tensors = (KVCacheTensorSpec("latent", dtype, shape),)
        else:
            raise ValueError(f"kv_parts must be 1 (latent) or 2 (K and V), got {kv_parts}")
        return cls(block_size, (KVCacheGroupSpec("attention", num_layers, tensors),))

    @cached_property
    def regions(self) -> tuple[KVRegion, ...]:
        """Every region of a block, in byte order."""
        regions, offset, layer = [], 0, 0
        for g, group in enumerate(self.groups):
            for _ in range(group.num_layers):
                offset = _align(offset, self.alignment)
                for tensor in group.tensors:
                    offset = _align(offset, tensor.dtype.itemsize)
                    regions.append(KVRegion(g, layer, tensor, offset))
                    offset += tensor.nbytes
                layer += 1
        return tuple(regions)

    @cached_property
    def block_nbytes(self) -> int:
        """Bytes of one block, a multiple of every region's itemsize (so a run of blocks
        keeps each region aligned)."""
        last = self.regions[-1]
        return _align(last.offset + last.nbytes, self.alignment)

    @cached_property
    def alignment(self) -> int:
        """The largest itemsize: each layer's regions start, and each block ends, on a
        multiple of it, so a layer's bytes (layer_span) view as each of its dtypes."""
        return max(t.dtype.itemsize for g in self.groups for t in g.tensors)

    @property
    def num_layers(self) -> int:
        """Layers of every group."""
        return sum(g.num_layers for g in self.groups)

    @property
    def padded(self) -> bool:
        """Whether a block has bytes no region covers (alignment between dtypes)."""
        return sum(r.nbytes for r in self.regions) != self.block_nbytes

    def layer_regions(self, layer: int) -> tuple[KVRegion, ...]:
        """The regions of one layer (counted over every group), consecutive in the block."""
        return tuple(r for r in self.regions if r.layer == layer)

    def layer_span(self, layer: int) -> tuple[int, int]:
        """(first byte, end) of one layer's regions in the block; both multiples of
        ``alignment``. Raises ValueError for a layer outside the spec."""
        regions = self.layer_regions(layer)
        if not regions:
            raise ValueError(f"layer {layer} outside the spec's {self.num_layers}")
        return regions[0].offset, _align(regions[-1].offset + regions[-1].nbytes, self.alignment)

    def sharded(self, world_size: int) -> KVCacheSpec:
        """The spec of one rank's share at tensor parallelism ``world_size``: each tensor with
        a shard dim holds 1/world_size of it. Raises ValueError when a dim does not divide."""
        groups = []
        for group in self.groups:
            tensors = []
            for t in group.tensors:
                shape = list(t.shape)
                if t.shard_dim is not None:
                    if shape[t.shard_dim] % world_size:
                        raise ValueError(f"tensor {t.name!r}: dim {t.shard_dim} of {t.shape} "
                                         f"does not split over {world_size} ranks")
                    shape[t.shard_dim] //= world_size
                tensors.append(KVCacheTensorSpec(t.name, t.dtype, tuple(shape), t.shard_dim))
            groups.append(KVCacheGroupSpec(group.name, group.num_layers, tuple(tensors)))
        return KVCacheSpec(self.block_size, tuple(groups))


def region_view(blocks: torch.Tensor, region: KVRegion) -> torch.Tensor:
    """``region`` of each of ``blocks`` (uint8 [n, block_nbytes], rows contiguous) as a typed
    view [n, *region.tensor.shape] that shares their memory."""
    tensor = region.tensor
    return (blocks[:, region.offset:region.offset + tensor.nbytes].view(tensor.dtype)
            .view(blocks.shape[0], *tensor.shape))


def gather_shards(spec: KVCacheSpec, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Whole blocks (uint8 [n, spec.block_nbytes]) from every rank's share of them (uint8
    [n, spec.sharded(len(shards)).block_nbytes] each, rank order): sharded regions joined
    along their shard dim, the others taken from rank 0."""
    local = spec.sharded(len(shards))
    out = torch.zeros((shards[0].shape[0], spec.block_nbytes), dtype=torch.uint8,
                      device=shards[0].device)
    for whole, part in zip(spec.regions, local.regions):
        dim = whole.tensor.shard_dim
        region_view(out, whole).copy_(
            region_view(shards[0], part) if dim is None
            else torch.cat([region_view(s, part) for s in shards], dim=1 + dim))
    return out


def split_shards(spec: KVCacheSpec, blocks: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """Each rank's share (uint8 [n, spec.sharded(world_size).block_nbytes]) of whole blocks
    ``blocks`` (uint8 [n, spec.block_nbytes]): the inverse of gather_shards."""
    local = spec.sharded(world_size)
    shards = [torch.zeros((blocks.shape[0], local.block_nbytes), dtype=torch.uint8,
                          device=blocks.device) for _ in range(world_size)]
    for whole, part in zip(spec.regions, local.regions):
        dim = whole.tensor.shard_dim
        source = region_view(blocks, whole)
        pieces = ([source] * world_size if dim is None
                  else source.chunk(world_size, dim=1 + dim))
        for shard, piece in zip(shards, pieces):
            region_view(shard, part).copy_(piece)
    return shards


def _align(offset: int, to: int) -> int:
    return -(-offset // to) * to
