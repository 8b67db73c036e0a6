"""Triton `rotary_embedding`: Llama/NeoX ("rotate half") RoPE on q and k, in place (vLLM's op).

One program per token reads its position, the [head_dim/2] cos and sin from the cache row, and
rotates every q and k head: out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin for x = x1 | x2.
cos/sin are rounded to the activations' dtype first (as transformers does); the products run in
float32. Reference: `kernels.reference.rotary_embedding`.
"""

from __future__ import annotations

import torch

from pdcluster.kernels._triton_common import (Launch, check_float_inputs, check_index_vector,
                                              check_rank, check_same_device)
from pdcluster.kernels._triton_common import next_pow2, require, run_all, tl, triton


@triton.jit
def _rotate_heads(base_ptr, stride_head, cos, sin, NUM_HEADS: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < NUM_HEADS) & (cols < HALF)
    first = base_ptr + heads * stride_head + cols
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    cos = cos.to(x1.dtype).to(tl.float32)[None, :]
    sin = sin.to(x1.dtype).to(tl.float32)[None, :]
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(base_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(base_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_cos_sin,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    row = cos_sin_ptr + position * stride_cos_sin
    cos = tl.load(row + cols, mask=cols < HALF, other=0.0)
    sin = tl.load(row + HALF + cols, mask=cols < HALF, other=0.0)
    _rotate_heads(q_ptr + token * stride_q_t, stride_q_h, cos, sin, NUM_HEADS, HALF, BLOCK_H, BLOCK_HALF)
    _rotate_heads(k_ptr + token * stride_k_t, stride_k_h, cos, sin, NUM_KV_HEADS, HALF, BLOCK_KV_H, BLOCK_HALF)


def plan_rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    target: str | None = None,
) -> list[Launch]:
    """Check inputs and plan the in-place launch. Shapes and semantics: `reference.rotary_embedding`.

    positions: int32/int64 [num_tokens], contiguous, each < max_position (not checked: that needs
    a device sync); q [num_tokens, num_heads, head_dim], k [num_tokens, num_kv_heads, head_dim],
    one float dtype, last dim contiguous; cos_sin_cache: float [max_position, head_dim] = cos | sin
    halves, last dim contiguous."""
    del target
    device = check_same_device(positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)
    check_rank("q", q, 3, "[num_tokens, num_heads, head_dim]")
    check_rank("k", k, 3, "[num_tokens, num_kv_heads, head_dim]")
    check_rank("cos_sin_cache", cos_sin_cache, 2, "[max_position, head_dim]")
    num_tokens, num_heads, head_dim = q.shape
    require(
        k.shape[0] == num_tokens and k.shape[2] == head_dim,
        f"k: shape {tuple(k.shape)} does not match q {tuple(q.shape)} in tokens/head_dim",
    )
    require(head_dim % 2 == 0, f"q: head_dim {head_dim} must be even")
    require(
        cos_sin_cache.shape[1] == head_dim,
        f"cos_sin_cache: width {cos_sin_cache.shape[1]} != head_dim {head_dim} (full rotary only)",
    )
    check_float_inputs(q=q, k=k, cos_sin_cache=cos_sin_cache)
    require(q.dtype == k.dtype, f"k: dtype {k.dtype} != q dtype {q.dtype}")
    check_index_vector("positions", positions, num_tokens)
    half = head_dim // 2
    block_h, block_kv_h, block_half = next_pow2(num_heads), next_pow2(k.shape[1]), next_pow2(half)
    launch = Launch(
        kernel=_rotary_kernel,
        grid=(num_tokens,),
        args={
            "positions_ptr": positions,
            "q_ptr": q,
            "k_ptr": k,
            "cos_sin_ptr": cos_sin_cache,
            "stride_q_t": q.stride(0),
            "stride_q_h": q.stride(1),
            "stride_k_t": k.stride(0),
            "stride_k_h": k.stride(1),
            "stride_cos_sin": cos_sin_cache.stride(0),
        },
        constexprs={
            "NUM_HEADS": num_heads,
            "NUM_KV_HEADS": k.shape[1],
            "HALF": half,
            "BLOCK_H": block_h,
            "BLOCK_KV_H": block_kv_h,
            "BLOCK_HALF": block_half,
        },
        device=device,
        num_warps=max(1, min(8, block_h * block_half // 256)),
        num_stages=1,
    )
    return [launch]


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place; returns (q, k), the same tensors."""
    run_all(plan_rotary_embedding(positions, q, k, cos_sin_cache))
    return q, k
