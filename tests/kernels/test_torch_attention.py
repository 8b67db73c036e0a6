"""kernels.torch_attention (the CPU attention path) against the attention oracle.

Random caches, GQA, block tables both consecutive (the view path) and scattered (the
index_select path), ragged lengths with padded tables, cached prefixes before the new tokens,
and padding rows after the packed queries.
"""

from __future__ import annotations

import pytest
import torch

from pdcluster import kernels
from pdcluster.kernels import torch_attention
from tests.kernels import attention_oracle

BLOCK_SIZE, NUM_BLOCKS = 8, 200
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 12, 4, 16
SCALE = HEAD_DIM ** -0.5


def caches(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return (torch.randn(shape, generator=gen).to(dtype),
            torch.randn(shape, generator=gen).to(dtype))


def tables(seq_lens: list[int], scattered: list[bool]) -> torch.Tensor:
    """int32 [num_seqs, max_blocks], zero-padded: consecutive ids or a random permutation."""
    gen = torch.Generator().manual_seed(1)
    perm = torch.randperm(NUM_BLOCKS, generator=gen)
    needed = [-(-n // BLOCK_SIZE) for n in seq_lens]
    out = torch.zeros(len(seq_lens), max(needed), dtype=torch.int32)
    start = 0
    for row, (n, mixed) in enumerate(zip(needed, scattered)):
        ids = perm[start:start + n] if mixed else torch.arange(start, start + n)
        out[row, :n] = ids
        start += n
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_oracle(dtype):
    k_cache, v_cache = caches(dtype)
    seq_lens = [1, 8, 9, 40, 77, 130]
    table = tables(seq_lens, [False, True, False, True, False, True])
    q = torch.randn(len(seq_lens), NUM_HEADS, HEAD_DIM).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    want = attention_oracle.paged_decode_attention(q, k_cache, v_cache, table, lens, SCALE)
    got = torch_attention.paged_decode_attention(q, k_cache, v_cache, table, lens, SCALE)
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_with_cached_prefixes_matches_oracle(dtype):
    k_cache, v_cache = caches(dtype)
    seq_lens = [30, 64, 17, 100]
    num_new = [30, 5, 0, 61]  # whole prompt, a prefix hit, an idle sequence, a long chunk
    table = tables(seq_lens, [True, False, True, False])
    cu = torch.tensor([0] + torch.cumsum(torch.tensor(num_new), 0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]) + 3, NUM_HEADS, HEAD_DIM).to(dtype)  # 3 padding rows
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    want = attention_oracle.paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, SCALE)
    got = torch_attention.paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, SCALE)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert not got[int(cu[-1]):].any()


def test_consecutive_blocks_are_read_in_place_and_scattered_ones_copied():
    k_cache, _ = caches()
    view = torch_attention.sequence_kv(k_cache, torch.tensor([3, 4, 5], dtype=torch.int32), 20)
    copy = torch_attention.sequence_kv(k_cache, torch.tensor([5, 3, 4], dtype=torch.int32), 20)
    assert view.data_ptr() == k_cache[3].data_ptr()
    assert copy.data_ptr() != k_cache[5].data_ptr()
    torch.testing.assert_close(copy, attention_oracle.gather_kv(k_cache, torch.tensor([5, 3, 4]), 20))


def test_cpu_backends_dispatch_attention_to_the_torch_path(monkeypatch):
    calls = []
    monkeypatch.setattr(torch_attention, "paged_decode_attention",
                        lambda *a: calls.append("decode") or a[0])
    previous = kernels.set_backend("torch")
    try:
        q = torch.randn(1, NUM_HEADS, HEAD_DIM)
        kernels.paged_decode_attention(q, *caches(), torch.zeros(1, 1, dtype=torch.int32),
                                       torch.ones(1, dtype=torch.int32), SCALE)
    finally:
        kernels.set_backend(previous)
    assert calls == ["decode"]


def poison_before_windows(cache: torch.Tensor, table: torch.Tensor, first_keys: list[int]) -> None:
    """NaN into each sequence's blocks wholly before its first visible key, in place: a
    windowed kernel must never read them (a KV cache manager may have given them away)."""
    for row, first in enumerate(first_keys):
        for block in table[row, :first // BLOCK_SIZE].tolist():
            cache[block] = float("nan")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_matches_oracle_without_reading_older_blocks(dtype):
    window = 13  # not a multiple of the block: a block straddles the window's start
    k_cache, v_cache = caches(dtype)
    seq_lens = [5, 13, 14, 40, 77]
    table = tables(seq_lens, [False, True, False, True, True])
    q = torch.randn(len(seq_lens), NUM_HEADS, HEAD_DIM).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    want_decode = attention_oracle.paged_decode_attention(q, k_cache, v_cache, table, lens, SCALE,
                                                          window)
    num_new = [5, 1, 3, 20, 7]
    cu = torch.tensor([0] + torch.cumsum(torch.tensor(num_new), 0).tolist(), dtype=torch.int32)
    qp = torch.randn(int(cu[-1]), NUM_HEADS, HEAD_DIM).to(dtype)
    want_prefill = attention_oracle.paged_prefill_attention(qp, k_cache, v_cache, table, cu, lens,
                                                            SCALE, window)
    firsts = [max(0, n - new - window + 1) for n, new in zip(seq_lens, num_new)]
    for cache in (k_cache, v_cache):
        poison_before_windows(cache, table, firsts)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    got = torch_attention.paged_decode_attention(q, k_cache, v_cache, table, lens, SCALE, window)
    torch.testing.assert_close(got, want_decode, atol=tol, rtol=tol)
    got = kernels.paged_prefill_attention(qp, k_cache, v_cache, table, cu, lens, SCALE, window)
    torch.testing.assert_close(got, want_prefill, atol=tol, rtol=tol)
