"""Triton `store_kv_cache`: scatter new K/V rows into the paged caches (nano-vllm's store_kvcache).

One program per token copies its [num_kv_heads, head_dim] K and V rows to
`cache[slot // block_size, slot % block_size]`; `slot == -1` (padding) writes nothing.
Reference: `kernels.reference.store_kv_cache`.
"""

from __future__ import annotations

import torch

from pdcluster.kernels._triton_common import (Launch, cache_strides, check_float_inputs,
                                              check_index_vector, check_kv_caches)
from pdcluster.kernels._triton_common import (check_rank, check_same_device, next_pow2, require,
                                              run_all, tl, triton)


@triton.jit
def _store_kv_cache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM) & (heads * 0 + slot >= 0)  # slot -1: padding
    safe_slot = tl.maximum(slot, 0)
    dst = (safe_slot // BLOCK_SIZE) * stride_c_block + (safe_slot % BLOCK_SIZE) * stride_c_slot
    dst += heads * stride_c_head + dims
    k = tl.load(k_ptr + token * stride_k_t + heads * stride_k_h + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_v_t + heads * stride_v_h + dims, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def plan_store_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    target: str | None = None,
) -> list[Launch]:
    """Check inputs and plan the launch. Shapes and semantics: `reference.store_kv_cache`.

    k, v: [num_tokens, num_kv_heads, head_dim], last dim contiguous, same dtype;
    caches: [num_blocks, block_size, num_kv_heads, head_dim], same dtype and strides, last dim
    contiguous; slot_mapping: int32/int64 [num_tokens], contiguous. `target` is unused here (one
    config for GPU and interpreter); it is accepted so every plan_* takes it."""
    del target
    device = check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    check_rank("k", k, 3, "[num_tokens, num_kv_heads, head_dim]")
    check_kv_caches(k_cache, v_cache)
    require(v.shape == k.shape, f"v: shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
    num_tokens, num_kv_heads, head_dim = k.shape
    require(
        tuple(k_cache.shape[2:]) == (num_kv_heads, head_dim),
        f"k_cache: heads/head_dim {tuple(k_cache.shape[2:])} != k's {(num_kv_heads, head_dim)}",
    )
    check_float_inputs(k=k, v=v, k_cache=k_cache, v_cache=v_cache)
    require(k.dtype == v.dtype, f"v: dtype {v.dtype} != k dtype {k.dtype}")
    require(k_cache.dtype == v_cache.dtype, f"v_cache: dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    check_index_vector("slot_mapping", slot_mapping, num_tokens)
    block_h, block_d = next_pow2(num_kv_heads), next_pow2(head_dim)
    launch = Launch(
        kernel=_store_kv_cache_kernel,
        grid=(num_tokens,),
        args={
            "k_ptr": k,
            "v_ptr": v,
            "k_cache_ptr": k_cache,
            "v_cache_ptr": v_cache,
            "slot_ptr": slot_mapping,
            "stride_k_t": k.stride(0),
            "stride_k_h": k.stride(1),
            "stride_v_t": v.stride(0),
            "stride_v_h": v.stride(1),
            **cache_strides(k_cache),
        },
        constexprs={
            "NUM_KV_HEADS": num_kv_heads,
            "HEAD_DIM": head_dim,
            "BLOCK_SIZE": k_cache.shape[1],
            "BLOCK_H": block_h,
            "BLOCK_D": block_d,
        },
        device=device,
        num_warps=max(1, min(8, block_h * block_d // 256)),
        num_stages=1,
    )
    return [launch]


def store_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k/v into the paged caches at `slot_mapping` (-1 skipped), in place."""
    run_all(plan_store_kv_cache(k, v, k_cache, v_cache, slot_mapping))
