"""The C++ CPU attention kernels (kernels.cpu_paged_attention: decode and prefill) against the
attention oracle, and a mixed batch of decode rows and prefill chunks through the engine's
attention op (decode rows by the decode kernel, chunks by the prefill kernel) against the
oracle's per-sequence answer."""

from __future__ import annotations

import pytest
import torch

from pdcluster import kernels
from pdcluster.engine.attention import AttentionMetadata, paged_attention
from pdcluster.engine.kv_cache import PagedKVCache
from pdcluster.kernels import cpu_extension, cpu_paged_attention, reference
from tests.kernels import attention_oracle
from tests.kernels.test_torch_attention import (BLOCK_SIZE, HEAD_DIM, NUM_BLOCKS, NUM_HEADS,
                                                NUM_KV_HEADS, SCALE, caches, tables)
from tests.real_parts import real_part

pytestmark = real_part("the C++ CPU extension", cpu_extension.available(),
                       "the C++ kernels cannot be built here (no compiler)")


def test_decode_matches_oracle_over_scattered_and_consecutive_blocks():
    k_cache, v_cache = caches()
    # lengths below, at and past multiples of the 8 and 16 tokens whose scores the kernel
    # finishes together
    seq_lens = [1, 7, 8, 9, 16, 32, 40, 77, 130]
    table = tables(seq_lens, [False, True, False, True, False, True, True, False, True])
    q = torch.randn(len(seq_lens), NUM_HEADS, HEAD_DIM)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    want = attention_oracle.paged_decode_attention(q, k_cache, v_cache, table, lens, SCALE)
    got = cpu_paged_attention.paged_decode_attention(q, k_cache, v_cache, table, lens, SCALE)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [
    (12, 4, 64),   # group 3: one pass over K and V serves all three query heads
    (16, 2, 64),   # group 8: two passes of four rows
    (6, 2, 128),   # group 3 at head_dim 128: two rows, then one
    (8, 8, 128),   # no GQA
    (4, 1, 80),    # head_dim not a power of two
])
@pytest.mark.parametrize("threads", [1, 2])
def test_every_head_layout_matches_the_oracle_at_any_thread_count(num_heads, num_kv_heads,
                                                                  head_dim, threads):
    """Scores spread over ~60 (q scaled up), so the softmax's exp runs over a wide range."""
    gen = torch.Generator().manual_seed(head_dim + num_heads)
    shape = (80, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    seq_lens = [1, 9, 57, 130]
    table = torch.randperm(80, generator=gen)[:4 * 17].view(4, 17).to(torch.int32)
    q = 4 * torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    want = attention_oracle.paged_decode_attention(q, k_cache, v_cache, table, lens, scale)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert cpu_paged_attention.supports(q, k_cache)
        got = cpu_paged_attention.paged_decode_attention(q, k_cache, v_cache, table, lens, scale)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _prefill_with_threads(threads, *args):
    """cpu_paged_attention.paged_prefill_attention(*args) at `threads` torch threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return cpu_paged_attention.paged_prefill_attention(*args)
    finally:
        torch.set_num_threads(before)


def test_prefill_matches_oracle_for_prompts_chunks_and_padding():
    """Whole prompts (one shorter than a key tile, one over several 16-token query tiles),
    chunks after a cached prefix (one of a single token), a sequence with no new tokens, and
    padding rows after the last chunk, over scattered and consecutive blocks."""
    k_cache, v_cache = caches()
    seq_lens, num_new = [5, 37, 130, 64, 71, 20], [5, 37, 33, 0, 1, 20]
    table = tables(seq_lens, [False, True, False, True, False, True])
    cu = torch.tensor([0, *torch.tensor(num_new).cumsum(0).tolist()], dtype=torch.int32)
    q = 4 * torch.randn(int(cu[-1]) + 3, NUM_HEADS, HEAD_DIM)  # 3 padding rows
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    want = attention_oracle.paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, SCALE)
    got = cpu_paged_attention.paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, SCALE)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert not got[int(cu[-1]):].any()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [
    (12, 4, 64),   # group 3: 16 tokens x 3 heads = 48 rows per tile
    (16, 2, 64),   # group 8
    (6, 2, 128),   # head_dim 128: fewer rows per pass over V
    (8, 8, 128),   # no GQA
    (4, 1, 80),    # head_dim not a power of two
])
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_every_head_layout_matches_the_oracle_at_any_thread_count(
        num_heads, num_kv_heads, head_dim, threads):
    gen = torch.Generator().manual_seed(head_dim * num_heads)
    shape = (80, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    seq_lens, num_new = [9, 57, 130], [9, 40, 50]
    table = torch.randperm(80, generator=gen)[:3 * 17].view(3, 17).to(torch.int32)
    cu = torch.tensor([0, 9, 49, 99], dtype=torch.int32)
    q = 4 * torch.randn(99, num_heads, head_dim, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    want = attention_oracle.paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, scale)
    got = _prefill_with_threads(threads, q, k_cache, v_cache, table, cu, lens, scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_prefill_over_long_cached_prefixes_matches_the_oracle():
    """Three 30k-token sequences with a few new tokens each: more transposed K than the
    kernel holds at once, so it works through them in groups."""
    gen = torch.Generator().manual_seed(3)
    block_size, num_kv_heads, head_dim = 16, 4, 64
    seq_lens, num_new = [30000, 30000, 30001], [2, 3, 1]
    blocks = [-(-n // block_size) for n in seq_lens]
    shape = (sum(blocks), block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    perm = torch.randperm(sum(blocks), generator=gen).to(torch.int32)
    table = torch.zeros(3, max(blocks), dtype=torch.int32)
    for row, ids in enumerate(perm.split(blocks)):
        table[row, :len(ids)] = ids
    cu = torch.tensor([0, 2, 5, 6], dtype=torch.int32)
    q = 4 * torch.randn(6, 12, head_dim, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    want = attention_oracle.paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, 0.125)
    got = cpu_paged_attention.paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [16, 12])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_the_cpp_kernels_at_any_block_size(block_size, dtype, tol):
    """The decode kernel finds a token's row with a shift and a mask where the block size is a
    power of two, and divides otherwise: both must land on the same rows. The C++ prefill
    kernel is called directly, because on an AMX CPU `paged_prefill_attention` takes the SDPA
    path instead."""
    gen = torch.Generator().manual_seed(block_size)
    shape = (60, block_size, 4, 64)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    seq_lens, num_new = [1, 12, 13, 40, 100], [1, 12, 5, 17, 60]
    max_blocks = -(-max(seq_lens) // block_size)
    table = torch.randperm(60, generator=gen)[:5 * max_blocks].view(5, max_blocks)
    table = table.to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(len(seq_lens), 12, 64, generator=gen).to(dtype)
    want = attention_oracle.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(),
                                                   table, lens, 0.125)
    got = cpu_paged_attention.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.125)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    cu = torch.tensor([0, *torch.tensor(num_new).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), 12, 64, generator=gen).to(dtype)
    want = attention_oracle.paged_prefill_attention(q.float(), k_cache.float(), v_cache.float(),
                                                    table, cu, lens, 0.125)
    got = cpu_extension.module().paged_prefill_attention(q, k_cache, v_cache, table, cu, lens,
                                                         0.125)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_bfloat16_decode_and_prefill_match_the_oracle():
    """bfloat16 q and caches, float32 math: the oracle computes in float32 from the same
    bfloat16 inputs, so the outputs differ by the final rounding to bfloat16 at most."""
    k_cache, v_cache = (c.to(torch.bfloat16) for c in caches())
    seq_lens, num_new = [5, 37, 130, 71], [5, 37, 33, 1]
    table = tables(seq_lens, [False, True, False, True])
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = (4 * torch.randn(sum(num_new), NUM_HEADS, HEAD_DIM)).to(torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(num_new).cumsum(0).tolist()], dtype=torch.int32)
    assert cpu_paged_attention.supports(q, k_cache)
    want = attention_oracle.paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, SCALE)
    got = cpu_paged_attention.paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, SCALE)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    q1 = q[:len(seq_lens)].contiguous()
    want = attention_oracle.paged_decode_attention(q1, k_cache, v_cache, table, lens, SCALE)
    got = cpu_paged_attention.paged_decode_attention(q1, k_cache, v_cache, table, lens, SCALE)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_bfloat16_decode_at_every_even_vector_count_and_group(head_dim, group):
    """Where the CPU has AVX512-BF16, bfloat16 scores take vdpbf16ps over pairs of 16-float
    vectors: every head size whose vectors come in pairs, groups that take one and several
    passes of query rows (each pass holds its rows in registers), odd and even lengths, below,
    at and past a block."""
    gen = torch.Generator().manual_seed(head_dim * 10 + group)
    num_kv_heads, block_size = 2, 16
    shape = (64, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(2))
    seq_lens = [1, 2, 15, 16, 33, 64, 101]
    max_blocks = -(-max(seq_lens) // block_size)
    table = torch.randperm(64, generator=gen)[:len(seq_lens) * max_blocks]
    table = table.view(len(seq_lens), max_blocks).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(len(seq_lens), group * num_kv_heads, head_dim, generator=gen)
    q = q.to(torch.bfloat16)
    scale = head_dim ** -0.5
    want = attention_oracle.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(),
                                                   table, lens, scale)
    got = cpu_paged_attention.paged_decode_attention(q, k_cache, v_cache, table, lens, scale)
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)


def test_a_cache_in_another_dtype_than_q_keeps_the_torch_path():
    k_cache, _ = caches()
    assert not cpu_paged_attention.supports(torch.zeros(1, NUM_HEADS, HEAD_DIM,
                                                        dtype=torch.bfloat16), k_cache)


def test_prefill_refuses_a_seq_len_shorter_than_its_new_tokens():
    k_cache, v_cache = caches()
    with pytest.raises(RuntimeError, match="shorter than its new tokens"):
        cpu_paged_attention.paged_prefill_attention(
            torch.randn(8, NUM_HEADS, HEAD_DIM), k_cache, v_cache,
            torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32),
            torch.tensor([5], dtype=torch.int32), SCALE)


def test_a_head_dim_without_a_specialization_keeps_the_torch_path():
    k_cache = torch.zeros(4, BLOCK_SIZE, 2, 40)
    assert not cpu_paged_attention.supports(torch.zeros(1, 4, 40), k_cache)


def test_a_seq_len_beyond_its_block_table_is_refused():
    k_cache, v_cache = caches()
    table = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block table"):
        cpu_paged_attention.paged_decode_attention(
            torch.randn(1, NUM_HEADS, HEAD_DIM), k_cache, v_cache, table,
            torch.tensor([2 * BLOCK_SIZE + 1], dtype=torch.int32), SCALE)


def test_a_mixed_batch_equals_each_sequence_alone():
    """Rows: decode, 5-token chunk after a cached prefix, decode, whole 12-token prompt."""
    k_cache, v_cache = caches()
    seq_lens, num_new = [33, 20, 9, 12], [1, 5, 1, 12]
    table = tables(seq_lens, [True, False, True, True])
    cu = torch.tensor([0, 1, 6, 7, 19], dtype=torch.int32)
    total = sum(num_new)
    q = torch.randn(total, NUM_HEADS, HEAD_DIM)
    k = torch.randn(total, NUM_KV_HEADS, HEAD_DIM)
    v = torch.randn(total, NUM_KV_HEADS, HEAD_DIM)
    slots = torch.cat([table[i, (p // BLOCK_SIZE)].long() * BLOCK_SIZE + p % BLOCK_SIZE
                       for i, (n, s) in enumerate(zip(num_new, seq_lens))
                       for p in [torch.arange(s - n, s)]])
    attn = AttentionMetadata(slots, table, torch.tensor(seq_lens, dtype=torch.int32), cu,
                             max(seq_lens))
    got = paged_attention(q, k, v, k_cache, v_cache, attn, SCALE)
    want = attention_oracle.paged_prefill_attention(q, k_cache, v_cache, table, cu,
                                                    attn.seq_lens, SCALE)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_the_sdpa_prefill_path_matches_the_oracle(dtype, tol):
    """The path prefill takes on AMX CPUs, run here on any CPU: whole prompts and chunks after
    a cached prefix, scattered and consecutive blocks, a zero-token row, padding rows."""
    k_cache, v_cache = (c.to(dtype) for c in caches())
    seq_lens, num_new = [5, 37, 130, 71, 9], [5, 37, 33, 1, 0]
    table = tables(seq_lens, [False, True, False, True, False])
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = (4 * torch.randn(sum(num_new) + 3, NUM_HEADS, HEAD_DIM)).to(dtype)  # 3 padding rows
    cu = torch.tensor([0, *torch.tensor(num_new).cumsum(0).tolist()], dtype=torch.int32)
    want = attention_oracle.paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, SCALE)
    got = cpu_paged_attention.sdpa_prefill_attention(q, k_cache, v_cache, table, cu, lens,
                                                     SCALE)
    assert got.dtype == dtype and got.shape == want.shape
    assert not got[int(cu[-1]):].any()
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    with pytest.raises(RuntimeError, match="shorter than its new tokens"):
        cpu_paged_attention.sdpa_prefill_attention(
            q[:8], k_cache, v_cache, table[:1], torch.tensor([0, 8], dtype=torch.int32),
            torch.tensor([5], dtype=torch.int32), SCALE)
    with pytest.raises(RuntimeError, match="block table"):
        cpu_paged_attention.sdpa_prefill_attention(
            q[:1], k_cache, v_cache, table[:1, :1], torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([BLOCK_SIZE + 1], dtype=torch.int32), SCALE)


needs_tiles = pytest.mark.skipif(not cpu_paged_attention.has_tile_prefill(),
                                 reason="the tile prefill kernel needs AMX")


@needs_tiles
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [
    (12, 4, 64),   # group 3
    (16, 2, 64),   # group 8
    (8, 8, 128),   # no GQA
    (4, 1, 80),    # head_dim not a power of two
])
@pytest.mark.parametrize("block_size", [16, 12])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_tile_prefill_kernel_matches_the_oracle(num_heads, num_kv_heads, head_dim,
                                                     block_size, threads):
    """bfloat16 prefill on the AMX tiles: whole prompts shorter than a key chunk and over
    several, chunks after a cached prefix (one of a single token, one of several query
    items), a zero-token row and padding rows, over scattered blocks of any size."""
    gen = torch.Generator().manual_seed(head_dim * num_heads + block_size)
    seq_lens, num_new = [5, 200, 700, 71, 9, 130], [5, 200, 90, 1, 0, 130]
    blocks = [-(-n // block_size) for n in seq_lens]
    shape = (sum(blocks) + 5, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(2))
    perm = torch.randperm(shape[0], generator=gen).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(blocks) + 2, dtype=torch.int32)
    for row, ids in enumerate(perm[:sum(blocks)].split(blocks)):
        table[row, :len(ids)] = ids
    cu = torch.tensor([0, *torch.tensor(num_new).cumsum(0).tolist()], dtype=torch.int32)
    q = (3 * torch.randn(int(cu[-1]) + 3, num_heads, head_dim, generator=gen)).to(torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    want = attention_oracle.paged_prefill_attention(q.float(), k_cache.float(), v_cache.float(),
                                                    table, cu, lens, scale)
    got = _prefill_with_threads(threads, q, k_cache, v_cache, table, cu, lens, scale)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    assert not got[int(cu[-1]):].any()
    # bfloat16 q/k/v and probabilities: the error of torch's own bfloat16 attention
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@needs_tiles
def test_the_tile_prefill_kernel_refuses_what_the_others_refuse():
    k_cache, v_cache = (c.to(torch.bfloat16) for c in caches())
    q = torch.randn(8, NUM_HEADS, HEAD_DIM).to(torch.bfloat16)
    table = tables([40], [False])
    with pytest.raises(RuntimeError, match="shorter than its new tokens"):
        cpu_paged_attention.paged_prefill_attention(
            q, k_cache, v_cache, table, torch.tensor([0, 8], dtype=torch.int32),
            torch.tensor([5], dtype=torch.int32), SCALE)
    with pytest.raises(RuntimeError, match="block table"):
        cpu_paged_attention.paged_prefill_attention(
            q[:1], k_cache, v_cache, table[:, :1], torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([BLOCK_SIZE + 1], dtype=torch.int32), SCALE)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_a_cross_layer_caches_views_store_and_attend_as_the_oracle(dtype, tol):
    """A layer's K and V of a cross-layer cache (engine.kv_cache: blocks num_layers * 2
    blocks apart) through the dispatch the engine uses: K/V stored by slot land where the
    reference puts them in a contiguous copy, other layers untouched; decode and prefill
    (whichever CPU kernel runs them here) match the oracle over the same views."""
    gen = torch.Generator().manual_seed(7)
    cache = PagedKVCache.attention(3, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype, "cpu",
                         layout="cross-layer")
    # [num_blocks, layers, K|V, block_size, kv_heads, head_dim]: the one-group spec's bytes
    blocks = cache.blocks.view(dtype).view(NUM_BLOCKS, 3, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    blocks.copy_(torch.randn(blocks.shape, generator=gen))
    k_cache, v_cache = cache.k[1], cache.v[1]
    assert not k_cache.is_contiguous() and cpu_paged_attention.supports(
        torch.zeros(1, NUM_HEADS, HEAD_DIM, dtype=dtype), k_cache)
    others = blocks[:, [0, 2]].clone()
    want_k, want_v = k_cache.contiguous(), v_cache.contiguous()
    slots = torch.tensor([5, 17, -1, 60, 61, 1599])
    k = torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    kernels.store_kv_cache(k, v, k_cache, v_cache, slots)
    reference.store_kv_cache(k, v, want_k, want_v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert torch.equal(blocks[:, [0, 2]], others)

    seq_lens = [1, 9, 40, 77]
    table = tables(seq_lens, [False, True, False, True])
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(len(seq_lens), NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    torch.testing.assert_close(
        kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, SCALE).float(),
        attention_oracle.paged_decode_attention(q, k_cache, v_cache, table, lens, SCALE).float(),
        atol=tol, rtol=tol)
    new = [1, 9, 3, 77]
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(new), NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    torch.testing.assert_close(
        kernels.paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, SCALE).float(),
        attention_oracle.paged_prefill_attention(q, k_cache, v_cache, table, cu, lens,
                                                 SCALE).float(),
        atol=tol, rtol=tol)


def test_a_cache_whose_block_rows_are_not_contiguous_keeps_the_torch_path():
    """The C++ kernels read each block's tokens and heads as one contiguous run: a cache laid
    out otherwise (heads before tokens) is not theirs, and they refuse it when called."""
    k_cache, v_cache = (c.transpose(1, 2).contiguous().transpose(1, 2) for c in caches())
    q = torch.randn(1, NUM_HEADS, HEAD_DIM)
    assert not cpu_paged_attention.supports(q, k_cache)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_paged_attention.paged_decode_attention(
            q, k_cache, v_cache, torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), SCALE)
