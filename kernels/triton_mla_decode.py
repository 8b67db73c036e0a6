"""Triton paged MLA decode: one query token per sequence over a paged latent cache, in the
latent space (DeepSeek-V2 §2.1; vLLM's MLA decode backends do the same).

Every query head reads the same cached entry per token, [c | k_rope] (`kv_lora_rank` +
`qk_rope_head_dim` features, one "KV head"), so a program takes BLOCK_H query heads of one
sequence and reads each latent tile once for all of them: the scores are q_c · c + q_rope ·
k_rope (two dots, so neither part is padded to the other's width), the online softmax is
FlashAttention-2's, and the value is c itself. Tiles of BLOCK_N tokens are gathered through
the block table token by token, so any block_size works. No split-K: a decode batch of
DeepSeek's 128 heads already fills a program per (sequence, 16 heads).

Contract: `kernels.torch_attention.paged_mla_attention` (decode rows).
"""

from __future__ import annotations

import contextlib

import torch

from pdcluster.kernels._triton_common import (LOG2E, check_float, check_int, check_same_device,
                                              dot_precision, for_gpu, next_pow2, require, tl,
                                              triton)


@triton.jit
def _mla_decode_kernel(q_ptr, cache_ptr, tables_ptr, seq_lens_ptr, out_ptr, qk_scale,
                       stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_c_block,
                       stride_c_slot, stride_bt, num_heads,
                       V_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    c = tl.arange(0, BLOCK_C)
    c_mask = c < V_DIM
    r = tl.arange(0, BLOCK_R)
    r_mask = r < ROPE_DIM
    q_row = q_ptr + seq * stride_q_t + heads[:, None] * stride_q_h
    q_c = tl.load(q_row + c[None, :], mask=h_mask[:, None] & c_mask[None, :], other=0.0)
    q_r = tl.load(q_row + V_DIM + r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    seq_len = tl.load(seq_lens_ptr + seq)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    table_row = tables_ptr + seq * stride_bt
    for n_start in range(0, seq_len, BLOCK_N):
        n = n_start + tl.arange(0, BLOCK_N)
        n_mask = n < seq_len
        block = tl.load(table_row + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        offset = block * stride_c_block + (n % BLOCK_SIZE).to(tl.int64) * stride_c_slot
        k_c = tl.load(cache_ptr + offset[:, None] + c[None, :],
                      mask=n_mask[:, None] & c_mask[None, :], other=0.0)
        k_r = tl.load(cache_ptr + offset[:, None] + V_DIM + r[None, :],
                      mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        scores = (tl.dot(q_c, tl.trans(k_c), input_precision=DOT_PRECISION)
                  + tl.dot(q_r, tl.trans(k_r), input_precision=DOT_PRECISION)) * qk_scale
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_c.dtype), k_c, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + seq * stride_o_t + heads[:, None] * stride_o_h + c[None, :],
             out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & c_mask[None, :])


def paged_mla_decode(q: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, v_dim: int,
                     target: str | None = None) -> torch.Tensor:
    """q [num_seqs, num_heads, D] (D = v_dim + rope dims, last dim contiguous); latent_cache
    [num_blocks, block_size, 1, D] of q's dtype with its last dim contiguous; block_tables
    int32 [num_seqs, max_blocks]; seq_lens int32 [num_seqs], each >= 1 -> [num_seqs,
    num_heads, v_dim] in q's dtype. Raises KernelInputError for inputs that do not fit."""
    device = check_same_device(q=q, latent_cache=latent_cache, block_tables=block_tables,
                               seq_lens=seq_lens)
    check_float("q", q)
    check_int("block_tables", block_tables)
    check_int("seq_lens", seq_lens)
    require(q.dim() == 3 and latent_cache.dim() == 4 and latent_cache.shape[2] == 1
            and latent_cache.shape[3] == q.shape[2] and 0 < v_dim < q.shape[2],
            f"paged_mla_decode: q {tuple(q.shape)}, cache {tuple(latent_cache.shape)}, "
            f"v_dim {v_dim} do not fit")
    require(latent_cache.dtype == q.dtype, "paged_mla_decode: cache dtype != q dtype")
    require(q.stride(2) == 1 and latent_cache.stride(3) == 1
            and block_tables.stride(1) == 1 and block_tables.shape[0] == q.shape[0],
            "paged_mla_decode: last dims must be contiguous, one table row per sequence")
    num_seqs, num_heads, dim = q.shape
    out = torch.empty((num_seqs, num_heads, v_dim), dtype=q.dtype, device=device)
    gpu = for_gpu(device, target)
    block_h = 16
    block_n = 32 if gpu else 16
    grid = (num_seqs, triton.cdiv(num_heads, block_h))
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _mla_decode_kernel[grid](
            q, latent_cache, block_tables, seq_lens, out, float(scale) * LOG2E,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), latent_cache.stride(0),
            latent_cache.stride(1), block_tables.stride(0), num_heads,
            V_DIM=v_dim, ROPE_DIM=dim - v_dim, BLOCK_SIZE=latent_cache.shape[1],
            BLOCK_H=block_h, BLOCK_C=max(16, next_pow2(v_dim)),
            BLOCK_R=max(16, next_pow2(dim - v_dim)), BLOCK_N=block_n,
            DOT_PRECISION=dot_precision(q.dtype), num_warps=4, num_stages=2)
    return out
