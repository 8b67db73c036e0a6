"""Triton fused MoE: a MoE layer's experts as two grouped GEMMs over rows sorted by expert.

The T*k (token, slot) rows are sorted by expert and each expert's run is padded to a multiple
of BLOCK_M (`align_block_size`), so every M tile of the grouped GEMM belongs to one expert,
whose weight tile the program loads; padding rows (id T*k) are masked. Tile b's expert is
`block_expert[b]`, -1 for tiles past the last expert's run (the tile count is an upper bound,
so no host sync is needed).

    GEMM 1: rows x[slot // k]   @ w13[e]^T -> [T*k, 2I]   (gate | up)
    silu_and_mul                            -> [T*k, I]    (kernels.triton_activation)
    GEMM 2: those rows           @ w2[e]^T  -> [T*k, H] float32, times the slot's weight
    sum over the k slots of a token         -> [T, H]

The same scheme as vLLM's fused_moe (moe_align_block_size, then one GEMM kernel per
projection). Reference: `kernels.reference.fused_moe`.
"""

from __future__ import annotations

import contextlib

import torch

from pdcluster.kernels import triton_activation
from pdcluster.kernels._triton_common import (check_float, check_same_device, dot_precision,
                                              for_gpu, require, tl, triton)


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr,
                         num_valid, N, K, stride_am, stride_be, stride_bn, stride_cm,
                         A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    valid = rows < num_valid
    a_rows = rows // A_ROW_DIV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :],
                    mask=valid[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None],
                    mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        acc += tl.dot(a, b, input_precision=PRECISION)
    if MUL_WEIGHT:
        weight = tl.load(weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
    tl.store(c_ptr + rows[:, None] * stride_cm + offs_n[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_ids int32 [num_tiles * block_m]: slot ids t*k+j grouped by
    expert, each expert's run padded with T*k to a multiple of block_m; block_expert int32
    [num_tiles]: each tile's expert, -1 past the last run). num_tiles is the bound
    ceil((T*k + E*(block_m - 1)) / block_m), fixed by the shapes."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_valid = flat.numel()
    num_tiles = -(-(num_valid + num_experts * (block_m - 1)) // block_m)
    order = torch.argsort(flat, stable=True)
    # bincount reads the ids' range back to the host: a sync per layer, and no CUDA graph
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    sorted_experts = flat[order]
    dest = padded_start[sorted_experts] + torch.arange(num_valid, device=flat.device) \
        - start[sorted_experts]
    sorted_ids = torch.full((num_tiles * block_m,), num_valid, dtype=torch.int32,
                            device=flat.device)
    sorted_ids[dest] = order.to(torch.int32)
    tile_start = torch.arange(num_tiles, device=flat.device) * block_m
    block_expert = torch.searchsorted(padded_end, tile_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


def _tiles(device: torch.device, target: str | None) -> tuple[int, int, int]:
    return (64, 64, 32) if for_gpu(device, target) else (16, 32, 32)


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor,
                  block_expert: torch.Tensor, weights: torch.Tensor | None, row_div: int,
                  tiles: tuple[int, int, int]) -> None:
    block_m, block_n, block_k = tiles
    num_experts, n, k = b.shape
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    with torch.cuda.device(a.device) if a.device.type == "cuda" else contextlib.nullcontext():
        _grouped_gemm_kernel[grid](
            a, b, out, weights if weights is not None else out, sorted_ids, block_expert,
            out.shape[0], n, k, a.stride(0), b.stride(0), b.stride(1), out.stride(0),
            A_ROW_DIV=row_div, MUL_WEIGHT=weights is not None,
            PRECISION=dot_precision(a.dtype), BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=block_k, num_warps=4, num_stages=2)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, target: str | None = None) -> torch.Tensor:
    """See `kernels.reference.fused_moe` (same shapes and result). Raises KernelInputError for
    shapes that do not fit, or weights whose inner dims are not contiguous."""
    device = check_same_device(x=x, w13=w13, w2=w2, topk_weights=topk_weights,
                               topk_ids=topk_ids)
    for name, tensor in (("x", x), ("w13", w13), ("w2", w2)):
        check_float(name, tensor)
    require(x.dim() == 2 and w13.dim() == 3 and w2.dim() == 3,
            "fused_moe: expected x [T, H], w13 [E, 2I, H], w2 [E, H, I]")
    num_experts, two_i, hidden = w13.shape
    require(x.shape[1] == hidden and two_i % 2 == 0 and tuple(w2.shape) == (num_experts, hidden,
                                                                          two_i // 2),
            f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} "
            "do not fit")
    require(topk_ids.shape == topk_weights.shape and topk_ids.dim() == 2
            and topk_ids.shape[0] == x.shape[0], "fused_moe: routing must be [T, k], both")
    require(w13.stride(2) == 1 and w13.stride(1) == hidden and w2.stride(2) == 1
            and w2.stride(1) == two_i // 2, "fused_moe: expert weights must be contiguous")
    x = x.contiguous()
    num_tokens, top_k = topk_ids.shape
    tiles = _tiles(device, target)
    sorted_ids, block_expert = align_block_size(topk_ids, num_experts, tiles[0])
    gate_up = torch.empty(num_tokens * top_k, two_i, dtype=x.dtype, device=device)
    _grouped_gemm(x, w13, gate_up, sorted_ids, block_expert, None, top_k, tiles)
    hidden_rows = triton_activation.silu_and_mul(gate_up)
    out = torch.empty(num_tokens * top_k, hidden, dtype=torch.float32, device=device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _grouped_gemm(hidden_rows, w2, out, sorted_ids, block_expert, weights, 1, tiles)
    return out.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
