"""Shared pieces of the paged attention launchers (`triton_paged_prefill`, `triton_paged_decode`).

Both kernels read q [rows, num_heads, head_dim] and write `out` of q's shape and dtype, over
paged caches [num_blocks, block_size, num_kv_heads, head_dim] read through int32 block tables:

- `attend_tile`: one K/V tile of the FlashAttention-2 online softmax, gathered through a block
  table token by token (so any block_size works);
- `check_paged_attention`, `check_block_tables`: the input checks both launchers make;
- `paged_attention_args`, `paged_attention_constexprs`: the runtime arguments and constexprs
  both kernels take under the same names.
"""

from __future__ import annotations

from typing import Any

import torch

from pdcluster.kernels._triton_common import (LOG2E, cache_strides, check_float_inputs,
                                              check_kv_caches, check_last_contiguous)
from pdcluster.kernels._triton_common import check_rank, dot_precision, require, tl, triton

MAX_HEAD_DIM = 256


@triton.jit
def attend_tile(
    q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row, kv_head_offset, n_start, q_pos, last_pos, qk_scale,
    stride_c_block, stride_c_slot, d, d_mask, window,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SLIDING: tl.constexpr,
):
    """One K/V tile of the online softmax -> (acc, m_i, l_i). MASKED: keys past `last_pos`
    are not read and query row r sees keys <= q_pos[r] (causal mask and the sequence end),
    and with SLIDING only keys > q_pos[r] - `window` (a sliding window of W > 0 keys). Under a
    window a row that has seen no key yet and sees none in this tile stays empty (no NaN).
    SLIDING is a constexpr so that full attention compiles without the window's mask and guard."""
    n = n_start + tl.arange(0, BLOCK_N)
    if MASKED:
        n_mask = n <= last_pos
        block = tl.load(table_row + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        block = tl.load(table_row + n // BLOCK_SIZE).to(tl.int64)
        kv_mask = d_mask[None, :]
    kv_offset = block * stride_c_block + (n % BLOCK_SIZE).to(tl.int64) * stride_c_slot + kv_head_offset
    kv_ptrs = kv_offset[:, None] + d[None, :]
    k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        visible = n[None, :] <= q_pos[:, None]
        if SLIDING:
            visible = visible & (n[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    if SLIDING:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:  # causal: every row sees a key in its first tile, so m_new is finite
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(scores - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


def check_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_layout: str) -> None:
    """q 3-D (`q_layout`), caches paged with equal strides; one head_dim <= MAX_HEAD_DIM; num_heads
    a multiple of num_kv_heads; all three of one float dtype with the last dim contiguous."""
    check_rank("q", q, 3, q_layout)
    check_kv_caches(k_cache, v_cache)
    _, num_heads, head_dim = q.shape
    num_kv_heads, cache_head_dim = k_cache.shape[2:]
    require(cache_head_dim == head_dim, f"k_cache: head_dim {cache_head_dim} != q head_dim {head_dim}")
    require(head_dim <= MAX_HEAD_DIM, f"q: head_dim {head_dim} > {MAX_HEAD_DIM} is not supported")
    require(
        num_heads % num_kv_heads == 0,
        f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}",
    )
    check_float_inputs(q=q, k_cache=k_cache, v_cache=v_cache)
    require(
        k_cache.dtype == q.dtype and v_cache.dtype == q.dtype,
        f"caches: dtype {k_cache.dtype}/{v_cache.dtype} != q dtype {q.dtype}",
    )


def check_block_tables(block_tables: torch.Tensor, num_seqs: int) -> None:
    """[num_seqs, max_blocks >= 1] with the last dim contiguous (its dtype is checked apart)."""
    require(
        block_tables.dim() == 2 and block_tables.shape[0] == num_seqs and block_tables.shape[1] >= 1,
        f"block_tables: expected [{num_seqs}, max_blocks >= 1], got {tuple(block_tables.shape)}",
    )
    check_last_contiguous("block_tables", block_tables)


def paged_attention_args(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float,
) -> dict[str, Any]:
    """The runtime arguments both kernels take (rows of q / out: tokens, or sequences in decode)."""
    return {
        "q_ptr": q,
        "k_cache_ptr": k_cache,
        "v_cache_ptr": v_cache,
        "out_ptr": out,
        "block_tables_ptr": block_tables,
        "seq_lens_ptr": seq_lens,
        "qk_scale": float(scale) * LOG2E,
        "stride_q_t": q.stride(0),
        "stride_q_h": q.stride(1),
        "stride_o_t": out.stride(0),
        "stride_o_h": out.stride(1),
        **cache_strides(k_cache),
        "stride_bt": block_tables.stride(0),
    }


def paged_attention_constexprs(
    q: torch.Tensor, k_cache: torch.Tensor, block_n: int, block_d: int, sliding_window: int
) -> dict[str, Any]:
    """The constexprs both kernels take: GQA group, head_dim and its padding, cache block, key tile,
    whether a sliding window applies."""
    return {
        "GROUP": q.shape[1] // k_cache.shape[2],
        "HEAD_DIM": q.shape[2],
        "BLOCK_SIZE": k_cache.shape[1],
        "BLOCK_N": block_n,
        "BLOCK_D": block_d,
        "DOT_PRECISION": dot_precision(q.dtype),
        "SLIDING": sliding_window > 0,
    }
