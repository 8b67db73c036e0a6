"""Triton `paged_decode_attention`: one query token per sequence over its paged K/V, split-K.

Flash-decoding (Dao et al., 2023): the context of each sequence is cut into `num_splits` ranges
of equal length (whole BLOCK_N tiles), sized by that sequence's own length, so a short sequence
in a batch planned for the block table's full width still spreads over every split, and a
CUDA graph captured once serves any lengths. Program (seq, kv_head, split) runs the online
softmax (FlashAttention-2) over its range for all
`group = num_heads // num_kv_heads` query heads sharing that KV head, so each K/V tile is read
once per group. The GQA group is the M dimension of both `tl.dot`s, padded to 16 (tl.dot's
minimum on GPUs), and head_dim is padded to a power of two >= 16. With one split the kernel
normalizes and writes the output itself; with more it writes unnormalized partial outputs and
their (max, sum) in float32, and `_decode_reduce_kernel` merges them per (seq, head).

K/V tiles are BLOCK_N tokens gathered through the block table token by token, so any cache
block_size works; the tile step is `_triton_attention.attend_tile`, shared with prefill.
Contract: `kernels.torch_attention.paged_decode_attention`; oracle: tests/kernels/attention_oracle.py.
"""

from __future__ import annotations

import math

import torch

from pdcluster.kernels._triton_attention import (attend_tile, check_block_tables,
                                                 check_paged_attention)
from pdcluster.kernels._triton_attention import paged_attention_args, paged_attention_constexprs
from pdcluster.kernels._triton_common import (Launch, check_int, check_same_device, check_vector,
                                              for_gpu, next_pow2, output)
from pdcluster.kernels._triton_common import require, run_all, tl, triton

MAX_SPLITS = 64
# GPU: a split covers at least this many tokens (smaller splits cost more than they balance).
MIN_SPLIT_TOKENS = 256


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    qk_scale,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    stride_bt,
    num_splits,
    window,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLIDING: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # a sliding window's first key; the splits cover [lo, seq_len)
    if SLIDING:
        lo = tl.maximum(seq_len - window, 0)
    else:
        lo = 0
    split_size = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * split_size
    end = tl.minimum(start + split_size, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    head_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_q_t + heads[:, None] * stride_q_h + d[None, :],
        mask=head_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq * stride_bt
    head_offset = kv_head.to(tl.int64) * stride_c_head
    # The query is the sequence's last token: every row sees the keys before `end`.
    last_pos = end - 1
    q_pos = tl.zeros([BLOCK_G], tl.int32) + last_pos
    for n_start in range(start, end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row, head_offset, n_start, q_pos, last_pos, qk_scale,
            stride_c_block, stride_c_slot, d, d_mask, window, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, SLIDING,
        )

    if SPLIT:
        # partial buffers: out [num_seqs, NUM_HEADS, num_splits, BLOCK_D], max/sum [.., num_splits]
        row = (seq * NUM_HEADS + heads) * num_splits + split
        tl.store(partial_out_ptr + row[:, None] * BLOCK_D + d[None, :], acc, mask=head_mask[:, None])
        tl.store(partial_max_ptr + row, m_i, mask=head_mask)
        tl.store(partial_sum_ptr + row, l_i, mask=head_mask)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + seq * stride_o_t + heads[:, None] * stride_o_h + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=head_mask[:, None] & d_mask[None, :],
        )


@triton.jit
def _decode_reduce_kernel(
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    out_ptr,
    stride_o_t,
    stride_o_h,
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    base = (seq * NUM_HEADS + head) * num_splits
    m_run = float("-inf")
    l_run = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for split in range(num_splits):
        m_s = tl.load(partial_max_ptr + base + split)
        l_s = tl.load(partial_sum_ptr + base + split)
        acc_s = tl.load(partial_out_ptr + (base + split) * BLOCK_D + d)
        m_new = tl.maximum(m_run, m_s)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all splits so far empty: no NaN
        alpha = tl.exp2(m_run - m_ref)
        beta = tl.exp2(m_s - m_ref)
        acc = acc * alpha + acc_s * beta
        l_run = l_run * alpha + l_s * beta
        m_run = m_new
    out = acc / tl.where(l_run == 0.0, 1.0, l_run)
    tl.store(out_ptr + seq * stride_o_t + head * stride_o_h + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # an H100/H200: plans made on CPU (interpreter, AOT) mirror that GPU


def choose_num_splits(num_programs: int, max_context: int, num_sms: int, block_n: int) -> int:
    """Splits per sequence: FlashAttention-2's flash-decoding heuristic.

    No split when the (seq, kv_head) programs already fill ~80% of the SMs; otherwise the
    smallest split count whose last wave is >= 85% as full as the best count's, with each split
    at least MIN_SPLIT_TOKENS (and one BLOCK_N tile) long."""
    if num_programs >= 0.8 * num_sms or max_context <= 0:
        return 1
    tile_tokens = max(MIN_SPLIT_TOKENS, block_n)
    limit = max(1, min(MAX_SPLITS, num_sms, -(-max_context // tile_tokens)))
    efficiency = {}
    for splits in range(1, limit + 1):
        waves = num_programs * splits / num_sms
        efficiency[splits] = waves / math.ceil(waves)
    best = max(efficiency.values())
    return next(s for s, e in efficiency.items() if e >= 0.85 * best)


def _config(gpu: bool, dtype: torch.dtype, block_d: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages)."""
    if not gpu:
        return 16, 4, 1
    if dtype == torch.float32 or block_d > 128:
        return 32, 4, 2
    return 64, 4, 2


def plan_paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    target: str | None = None,
    sliding_window: int = 0,
) -> tuple[list[Launch], torch.Tensor]:
    """Check inputs, allocate `out` and split workspaces -> (launches, out).

    q: [num_seqs, num_heads, head_dim]; caches [num_blocks, block_size, num_kv_heads, head_dim]
    of q's dtype with equal strides; block_tables int32 [num_seqs, max_blocks], last dim
    contiguous; seq_lens int32 [num_seqs], contiguous, each in [1, max_blocks * block_size] (not
    checked: needs a sync). `num_splits`: None = heuristic (uses max_blocks * block_size as the
    longest context, no sync). `target`: "gpu" / "interpreter" tile configs (default: by device).
    `sliding_window` W > 0: each query sees its sequence's last W keys only.
    """
    device = check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens)
    check_paged_attention(q, k_cache, v_cache, "[num_seqs, num_heads, head_dim]")
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_int("block_tables", block_tables)
    check_int("seq_lens", seq_lens)
    check_block_tables(block_tables, num_seqs)
    check_vector("seq_lens", seq_lens, num_seqs)
    out = output(out, tuple(q.shape), q.dtype, device)

    group = num_heads // num_kv_heads
    block_g, block_d = max(16, next_pow2(group)), max(16, next_pow2(head_dim))
    gpu = for_gpu(device, target)
    block_n, num_warps, num_stages = _config(gpu, q.dtype, block_d)
    max_context = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs * num_kv_heads, max_context, _num_sms(device), block_n)
    require(num_splits >= 1, f"num_splits must be >= 1, got {num_splits}")
    split_size = triton.cdiv(triton.cdiv(max_context, num_splits), block_n) * block_n
    num_splits = triton.cdiv(max_context, split_size)
    split = num_splits > 1
    workspace_rows = num_seqs * num_heads * num_splits if split else 1
    partial_out = torch.empty((workspace_rows, block_d), dtype=torch.float32, device=device)
    partial_max = torch.empty((workspace_rows,), dtype=torch.float32, device=device)
    partial_sum = torch.empty((workspace_rows,), dtype=torch.float32, device=device)
    launches = [
        Launch(
            kernel=_decode_kernel,
            grid=(num_seqs, num_kv_heads, num_splits),
            args={
                **paged_attention_args(q, k_cache, v_cache, out, block_tables, seq_lens, scale),
                "partial_out_ptr": partial_out,
                "partial_max_ptr": partial_max,
                "partial_sum_ptr": partial_sum,
                "num_splits": num_splits,
                "window": sliding_window,
            },
            constexprs={
                **paged_attention_constexprs(q, k_cache, block_n, block_d, sliding_window),
                "NUM_HEADS": num_heads,
                "BLOCK_G": block_g,
                "SPLIT": split,
            },
            device=device,
            num_warps=num_warps,
            num_stages=num_stages,
        )
    ]
    if split:
        launches.append(
            Launch(
                kernel=_decode_reduce_kernel,
                grid=(num_seqs, num_heads),
                args={
                    "partial_out_ptr": partial_out,
                    "partial_max_ptr": partial_max,
                    "partial_sum_ptr": partial_sum,
                    "out_ptr": out,
                    "stride_o_t": out.stride(0),
                    "stride_o_h": out.stride(1),
                    "num_splits": num_splits,
                },
                constexprs={"NUM_HEADS": num_heads, "HEAD_DIM": head_dim, "BLOCK_D": block_d},
                device=device,
                num_warps=1 if block_d <= 64 else 2,
                num_stages=1,
            )
        )
    return launches, out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    """-> out [num_seqs, num_heads, head_dim] in q's dtype."""
    launches, out = plan_paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                                sliding_window=sliding_window)
    run_all(launches)
    return out
