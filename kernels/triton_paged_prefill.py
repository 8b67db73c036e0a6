"""Triton `paged_prefill_attention`: varlen causal attention of packed new tokens over paged K/V.

FlashAttention-2 (Dao, 2023) forward with a paged, cached prefix: program (q tile, head) holds
BLOCK_M new tokens of one sequence and one query head, and streams that sequence's K/V in
BLOCK_N-token tiles gathered through its block table (token by token, so any block_size works),
with the online softmax in float32. New token i of a sequence with L new tokens and S tokens in
the cache sits at position S - L + i and sees positions 0..S - L + i (bottom-right causal mask).
Key tiles wholly before the tile's first query are processed without a mask; only the tiles on
the diagonal are masked.

Q tiles of all sequences share one grid axis without a host sync (vLLM's unified-attention
layout): sequence i owns programs [cu[i] // BLOCK_M + i, cu[i+1] // BLOCK_M + i + 1), which is at
least ceil(L_i / BLOCK_M) of them, and a program finds its sequence by binary search over
cu_seqlens_q. Programs past the last sequence zero the rows after cu_seqlens_q[-1] (padding),
so every output element is written. head_dim is padded to a power of two >= 16.
Reference: `kernels.reference.paged_prefill_attention`.
"""

from __future__ import annotations

import torch

from kernels._triton_common import (
    LOG2E,
    Launch,
    check_float,
    check_int,
    check_last_contiguous,
    check_out,
    check_rank,
    check_same_device,
    check_vector,
    dot_precision,
    for_gpu,
    next_pow2,
    require,
    run_all,
    tl,
    triton,
)

MAX_HEAD_DIM = 256


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row, kv_head_offset, n_start, q_pos, last_pos, qk_scale,
    stride_c_block, stride_c_slot, d, d_mask,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One K/V tile of the online softmax. MASKED: causal mask and the sequence end applied."""
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
        scores = tl.where(n[None, :] <= q_pos[:, None], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


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
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
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
            # Keys [0, unmasked_end) precede every query of the tile: no mask.
            unmasked_end = (first_pos + 1) // BLOCK_N * BLOCK_N
            for n_start in range(0, unmasked_end, BLOCK_N):
                acc, m_i, l_i = _attend_tile(
                    q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row, kv_head_offset, n_start, q_pos,
                    last_pos, qk_scale, stride_c_block, stride_c_slot, d, d_mask,
                    BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION,
                )
            for n_start in range(unmasked_end, last_pos + 1, BLOCK_N):
                acc, m_i, l_i = _attend_tile(
                    q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row, kv_head_offset, n_start, q_pos,
                    last_pos, qk_scale, stride_c_block, stride_c_slot, d, d_mask,
                    BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION,
                )
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def _config(gpu: bool, dtype: torch.dtype, block_d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    if not gpu:
        return 16, 16, 4, 1
    if dtype == torch.float32 or block_d > 128:
        return 64, 32, 4, 2
    if block_d <= 64:
        return 128, 64, 4, 3
    return 128, 64, 8, 3


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
) -> tuple[list[Launch], torch.Tensor]:
    """Check inputs, allocate `out` -> (launches, out).

    q: [total_q, num_heads, head_dim]; caches [num_blocks, block_size, num_kv_heads, head_dim]
    of q's dtype with equal strides; block_tables int32 [num_seqs, max_blocks], last dim
    contiguous; cu_seqlens_q int32 [num_seqs + 1] and seq_lens int32 [num_seqs], contiguous;
    cu_seqlens_q non-decreasing from 0, each seq_len >= its new tokens (not checked: needs a sync).
    `target`: "gpu" / "interpreter" tile configs (default: by device); block_m / block_n
    override the tile sizes (powers of two >= 16)."""
    device = check_same_device(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens
    )
    check_rank("q", q, 3, "[total_q, num_heads, head_dim]")
    check_rank("k_cache", k_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
    require(
        v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride(),
        f"v_cache: shape/strides {tuple(v_cache.shape)}/{v_cache.stride()} != k_cache "
        f"{tuple(k_cache.shape)}/{k_cache.stride()}",
    )
    total_q, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    require(cache_head_dim == head_dim, f"k_cache: head_dim {cache_head_dim} != q head_dim {head_dim}")
    require(head_dim <= MAX_HEAD_DIM, f"q: head_dim {head_dim} > {MAX_HEAD_DIM} is not supported")
    require(
        num_heads % num_kv_heads == 0,
        f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}",
    )
    for name, tensor in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_float(name, tensor)
        check_last_contiguous(name, tensor)
    require(
        k_cache.dtype == q.dtype and v_cache.dtype == q.dtype,
        f"caches: dtype {k_cache.dtype}/{v_cache.dtype} != q dtype {q.dtype}",
    )
    for name, tensor in (("block_tables", block_tables), ("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens)):
        check_int(name, tensor)
    check_rank("seq_lens", seq_lens, 1, "[num_seqs]")
    num_seqs = seq_lens.shape[0]
    require(
        block_tables.dim() == 2 and block_tables.shape[0] == num_seqs and block_tables.shape[1] >= 1,
        f"block_tables: expected [{num_seqs}, max_blocks >= 1], got {tuple(block_tables.shape)}",
    )
    check_last_contiguous("block_tables", block_tables)
    check_vector("cu_seqlens_q", cu_seqlens_q, num_seqs + 1)
    check_vector("seq_lens", seq_lens, num_seqs)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=device)
    check_out(out, tuple(q.shape), q.dtype, device)
    check_last_contiguous("out", out)

    block_d = max(16, next_pow2(head_dim))
    config_m, config_n, num_warps, num_stages = _config(for_gpu(device, target), q.dtype, block_d)
    block_m, block_n = block_m or config_m, block_n or config_n
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        require(value >= 16 and value == next_pow2(value), f"{name} must be a power of two >= 16, got {value}")
    launch = Launch(
        kernel=_prefill_kernel,
        grid=(triton.cdiv(total_q, block_m) + num_seqs, num_heads),
        args={
            "q_ptr": q,
            "k_cache_ptr": k_cache,
            "v_cache_ptr": v_cache,
            "out_ptr": out,
            "block_tables_ptr": block_tables,
            "cu_seqlens_q_ptr": cu_seqlens_q,
            "seq_lens_ptr": seq_lens,
            "qk_scale": float(scale) * LOG2E,
            "total_q": total_q,
            "num_seqs": num_seqs,
            "stride_q_t": q.stride(0),
            "stride_q_h": q.stride(1),
            "stride_o_t": out.stride(0),
            "stride_o_h": out.stride(1),
            "stride_c_block": k_cache.stride(0),
            "stride_c_slot": k_cache.stride(1),
            "stride_c_head": k_cache.stride(2),
            "stride_bt": block_tables.stride(0),
        },
        constexprs={
            "GROUP": num_heads // num_kv_heads,
            "HEAD_DIM": head_dim,
            "BLOCK_SIZE": block_size,
            "BLOCK_M": block_m,
            "BLOCK_N": block_n,
            "BLOCK_D": block_d,
            "DOT_PRECISION": dot_precision(q.dtype),
        },
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
) -> torch.Tensor:
    """-> out [total_q, num_heads, head_dim] in q's dtype; rows past cu_seqlens_q[-1] are zero."""
    launches, out = plan_paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale)
    run_all(launches)
    return out
