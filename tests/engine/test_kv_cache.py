"""engine.kv_cache: the host cache's lazily zeroed memory (host_zeros) and block copies on it."""

from __future__ import annotations

import gc
import mmap
import os

import pytest
import torch

from pdcluster.engine.kv_cache import PagedKVCache, host_zeros
from pdcluster.engine.kv_cache_spec import (KVCacheGroupSpec, KVCacheSpec, KVCacheTensorSpec,
                                            gather_shards, split_shards)


@pytest.mark.parametrize("huge", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_zeros_is_zero_contiguous_and_writable(monkeypatch, huge, dtype):
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1" if huge else "0")
    t = host_zeros((3, 16, 2, 8), dtype)
    assert t.shape == (3, 16, 2, 8) and t.dtype == dtype and t.is_contiguous()
    assert torch.equal(t, torch.zeros_like(t))
    t[1, 5] = 7.0
    assert float(t.sum()) == 7.0 * 16
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        assert t.data_ptr() % (2 << 20) == 0  # where torch's own allocator would start it


def test_host_zeros_memory_outlives_the_function_and_the_base_tensor():
    view = host_zeros((1 << 20,), torch.float32)[10:20]
    gc.collect()
    view += 1.5
    assert torch.equal(view, torch.full((10,), 1.5))


def test_host_zeros_of_nothing():
    assert host_zeros((0, 4), torch.float16).shape == (0, 4)


def test_host_zeros_writes_nothing_until_touched():
    """The point of it: a large cache costs no resident memory at start-up."""
    def rss() -> int:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = rss()
    t = host_zeros((256 << 20,), torch.uint8)
    assert rss() - before < (16 << 20)
    t[: 64 << 20].fill_(1)
    # the 64 MiB now resident; less a margin, since the rest of the process (allocator trims,
    # the collector) may give back a little meanwhile
    assert rss() - before >= (48 << 20)


def test_cpu_cache_blocks_round_trip_on_host_zeros():
    cache = PagedKVCache.attention(num_layers=2, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8,
                         dtype=torch.float32, device="cpu")
    assert all(torch.equal(t, torch.zeros_like(t)) for t in cache.k + cache.v)
    data = torch.randint(0, 256, (2, cache.block_nbytes), dtype=torch.uint8)
    cache.write_blocks([3, 1], data)
    assert torch.equal(cache.read_blocks([3, 1]), data)
    assert torch.equal(cache.read_blocks([0, 2, 4]),
                       torch.zeros(3, cache.block_nbytes, dtype=torch.uint8))


def test_a_cross_layer_cache_holds_what_a_per_layer_cache_holds():
    """The same writes (whole blocks, and a layer's K/V through its view) give the same
    blocks in both layouts; a cross-layer cache's views share its one tensor, each block's
    every layer contiguous in the transferable unit's layout."""
    caches = [PagedKVCache.attention(3, 6, 4, 2, 8, torch.float32, "cpu", layout=layout)
              for layout in ("layer", "cross-layer")]
    data = torch.randn(2, 3, 2, 4, 2, 8)  # [n, layers, K|V, block_size, kv_heads, head_dim]
    for cache in caches:
        cache.write_blocks([4, 1], data.view(2, -1).view(torch.uint8))
        cache.k[2][3, 1] = 7.0
        cache.v[0][5] = -1.0
    layered, crossed = caches
    assert torch.equal(crossed.read_blocks(range(6)), layered.read_blocks(range(6)))
    assert crossed.blocks.shape == (6, crossed.block_nbytes) and crossed.blocks.is_contiguous()
    typed = crossed.blocks.view(torch.float32).view(6, 3, 2, 4, 2, 8)
    assert torch.equal(typed[3, 2, 0, 1], torch.full((2, 8), 7.0))
    assert torch.equal(typed[1, :, :], data[1])
    assert crossed.k[1].data_ptr() == typed[:, 1, 0].data_ptr()
    assert layered.blocks is None
    with pytest.raises(ValueError, match="layout"):
        PagedKVCache.attention(3, 6, 4, 2, 8, torch.float32, "cpu", layout="heads")


def test_a_spec_of_two_groups_and_mixed_dtypes_moves_as_its_bytes():
    """A block of int8 K/V with float32 scales and a second bfloat16 group: each region at an
    offset aligned to its dtype, whole blocks and single layers equal in both layouts, and a
    rank's share (split_shards) joined again (gather_shards) gives the block back."""
    kv = (4, 2, 3)
    spec = KVCacheSpec(4, (
        KVCacheGroupSpec("attention", 2, (KVCacheTensorSpec("k", torch.int8, kv, 1),
                                          KVCacheTensorSpec("v", torch.int8, kv, 1),
                                          KVCacheTensorSpec("k_scale", torch.float32, (2,), 0))),
        KVCacheGroupSpec("draft", 1, (KVCacheTensorSpec("k", torch.bfloat16, (4, 2, 8), 1),))))
    assert all(r.offset % r.tensor.dtype.itemsize == 0 for r in spec.regions)
    assert spec.block_nbytes % 4 == 0 and spec.num_layers == 3
    caches = [PagedKVCache(spec, 6, "cpu", layout) for layout in ("layer", "cross-layer")]
    data = torch.randint(0, 256, (6, spec.block_nbytes), dtype=torch.uint8)
    for cache in caches:
        cache.write_blocks(range(6), data)
        assert len(cache.k) == 2 and len(cache.v) == 2 and cache.dtype == torch.int8
    layered, crossed = caches
    covered = torch.zeros(spec.block_nbytes, dtype=torch.bool)
    for region in spec.regions:
        covered[region.offset:region.offset + region.nbytes] = True
    assert torch.equal(layered.read_blocks(range(6))[:, covered], data[:, covered])
    assert torch.equal(crossed.read_blocks(range(6)), data)
    for layer in range(3):
        start, end = spec.layer_span(layer)
        assert torch.equal(layered.read_layer([5, 0], layer)[:, covered[start:end]],
                           data[[5, 0], start:end][:, covered[start:end]])
        layered.write_layer([1], layer, crossed.read_layer([4], layer))
    assert torch.equal(layered.read_blocks([1])[:, covered], data[4:5, covered])
    shards = split_shards(spec, data, 2)
    assert shards[0].shape == (6, spec.sharded(2).block_nbytes)
    assert torch.equal(gather_shards(spec, shards)[:, covered], data[:, covered])
    with pytest.raises(ValueError, match="split"):
        spec.sharded(4)  # 2 KV heads over 4 ranks
