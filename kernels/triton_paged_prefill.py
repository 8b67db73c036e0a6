"""Triton `paged_prefill_attention`: varlen causal attention of packed new tokens over paged K/V.

FlashAttention-2 (Dao, 2023) forward with a paged, cached prefix: program (q tile, head) holds
BLOCK_M new tokens of one sequence and one query head, and streams that sequence's K/V in
BLOCK_N-token tiles gathered through its block table (token by token, so any block_size works),
with the online softmax in float32. New token i of a sequence with L new tokens and S tokens in
the cache sits at position S - L + i and sees positions 0..S - L + i (bottom-right causal mask).
Key tiles wholly before the tile's first query are processed without a mask; only the tiles on
the diagonal are masked. The tile step is `_triton_attention.attend_tile`, shared with decode.

Q tiles of all sequences share one grid axis without a host sync (vLLM's unified-attention
layout): sequence i owns programs [cu[i] // BLOCK_M + i, cu[i+1] // BLOCK_M + i + 1), which is at
least ceil(L_i / BLOCK_M) of them, and a program finds its sequence by binary search over
cu_seqlens_q. Programs past the last sequence zero the rows after cu_seqlens_q[-1] (padding),
so every output element is written. head_dim is padded to a power of two >= 16.
Contract: `kernels.torch_attention.paged_prefill_attention`; oracle: tests/kernels/attention_oracle.py.
"""

from __future__ import annotations

import torch

from pdcluster.kernels._triton_attention import (attend_tile, check_block_tables,
                                                 check_paged_attention)
from pdcluster.kernels._triton_attention import paged_attention_args, paged_attention_constexprs
from pdcluster.kernels._triton_common import (Launch, check_int, check_rank, check_same_device,
                                              check_vector, for_gpu, next_pow2)
from pdcluster.kernels._triton_common import output, require, run_all, tl, triton


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    qk_scale,
    total_q,
    num_seqs,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    stride_bt,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLIDING: tl.constexpr,
):
    pid = tl.program_id(0)
    head = tl.program_id(1)
    # Largest seq in [0, num_seqs] with cu[seq] // BLOCK_M + seq <= pid; seq == num_seqs: padding.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(cu_seqlens_q_ptr + mid) // BLOCK_M + mid <= pid:
            lo = mid
        else:
            hi = mid - 1
    seq = lo
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    tile = pid - (q_start // BLOCK_M + seq)
    m_offs = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    rows = (q_start + m_offs).to(tl.int64)
    out_ptrs = out_ptr + rows[:, None] * stride_o_t + head * stride_o_h + d[None, :]
    if seq == num_seqs:
        zeros = tl.zeros([BLOCK_M, BLOCK_D], tl.float32).to(out_ptr.dtype.element_ty)
        tl.store(out_ptrs, zeros, mask=(rows < total_q)[:, None] & d_mask[None, :])
    else:
        num_new = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        if tile * BLOCK_M < num_new:
            seq_len = tl.load(seq_lens_ptr + seq)
            context = seq_len - num_new
            row_mask = m_offs < num_new
            q = tl.load(
                q_ptr + rows[:, None] * stride_q_t + head * stride_q_h + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :],
                other=0.0,
            )
            q_pos = context + m_offs
            first_pos = context + tile * BLOCK_M
            last_pos = context + tl.minimum((tile + 1) * BLOCK_M, num_new) - 1
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
            kv_head_offset = (head // GROUP).to(tl.int64) * stride_c_head
            # Keys [0, unmasked_end) precede every query of the tile: no mask. With a sliding
            # window every tile is masked, from the tile holding the first query's first key.
            if SLIDING:
                n_lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
                unmasked_end = n_lo
            else:
                n_lo = 0
                unmasked_end = (first_pos + 1) // BLOCK_N * BLOCK_N
            for n_start in range(n_lo, unmasked_end, BLOCK_N):
                acc, m_i, l_i = attend_tile(
                    q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row, kv_head_offset, n_start, q_pos,
                    last_pos, qk_scale, stride_c_block, stride_c_slot, d, d_mask, window,
                    BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION, SLIDING,
                )
            for n_start in range(unmasked_end, last_pos + 1, BLOCK_N):
                acc, m_i, l_i = attend_tile(
                    q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row, kv_head_offset, n_start, q_pos,
                    last_pos, qk_scale, stride_c_block, stride_c_slot, d, d_mask, window,
                    BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, SLIDING,
                )
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def _config(gpu: bool, dtype: torch.dtype, block_d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    if not gpu:
        return 16, 16, 4, 1
    # 16-bit configs are the fastest of `benchmarks/gpu_kernels.py --sweep-prefill` on an H200
    if dtype == torch.float32 or block_d > 128:
        return 64, 32, 4, 2
    if block_d <= 64:
        return 128, 64, 4, 3
    return 64, 64, 4, 2


def plan_paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    target: str | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    sliding_window: int = 0,
) -> tuple[list[Launch], torch.Tensor]:
    """Check inputs, allocate `out` -> (launches, out).

    q: [total_q, num_heads, head_dim]; caches [num_blocks, block_size, num_kv_heads, head_dim]
    of q's dtype with equal strides; block_tables int32 [num_seqs, max_blocks], last dim
    contiguous; cu_seqlens_q int32 [num_seqs + 1] and seq_lens int32 [num_seqs], contiguous;
    cu_seqlens_q non-decreasing from 0, each seq_len >= its new tokens (not checked: needs a sync).
    `target`: "gpu" / "interpreter" tile configs (default: by device); block_m / block_n
    override the tile sizes (powers of two >= 16). `sliding_window` W > 0: a query at p sees
    keys p - W < k <= p only."""
    device = check_same_device(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens
    )
    check_paged_attention(q, k_cache, v_cache, "[total_q, num_heads, head_dim]")
    total_q, num_heads, head_dim = q.shape
    for name, tensor in (("block_tables", block_tables), ("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens)):
        check_int(name, tensor)
    check_rank("seq_lens", seq_lens, 1, "[num_seqs]")
    num_seqs = seq_lens.shape[0]
    check_block_tables(block_tables, num_seqs)
    check_vector("cu_seqlens_q", cu_seqlens_q, num_seqs + 1)
    check_vector("seq_lens", seq_lens, num_seqs)
    out = output(out, tuple(q.shape), q.dtype, device)

    block_d = max(16, next_pow2(head_dim))
    config_m, config_n, num_warps, num_stages = _config(for_gpu(device, target), q.dtype, block_d)
    block_m, block_n = block_m or config_m, block_n or config_n
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        require(value >= 16 and value == next_pow2(value), f"{name} must be a power of two >= 16, got {value}")
    launch = Launch(
        kernel=_prefill_kernel,
        grid=(triton.cdiv(total_q, block_m) + num_seqs, num_heads),
        args={
            **paged_attention_args(q, k_cache, v_cache, out, block_tables, seq_lens, scale),
            "cu_seqlens_q_ptr": cu_seqlens_q,
            "total_q": total_q,
            "num_seqs": num_seqs,
            "window": sliding_window,
        },
        constexprs={**paged_attention_constexprs(q, k_cache, block_n, block_d, sliding_window), "BLOCK_M": block_m},
        device=device,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return [launch], out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    """-> out [total_q, num_heads, head_dim] in q's dtype; rows past cu_seqlens_q[-1] are zero."""
    launches, out = plan_paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                                 sliding_window=sliding_window)
    run_all(launches)
    return out
