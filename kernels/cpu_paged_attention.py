"""The C++ paged attention kernels for CPU (decode: `cpu_paged_decode.cpp`, prefill:
`cpu_paged_prefill.cpp`; built by `kernels.cpu_extension`).

Prefill on a CPU with AMX takes the tile unit instead. In bfloat16 that is our flash kernel
on torch's brgemm (`cpu_amx_prefill.cpp`), which multiplies on the tiles where the C++ kernel
widens to float32 vectors, reads the paged blocks itself, and skips the keys after each
query block (docs/notes/cpu-attention-findings.md, "Prefill attention"). In float32 it is
torch's SDPA, per sequence over its K/V gathered from the blocks: its oneDNN GEMMs measured
faster than the C++ kernel on such a (Sapphire Rapids class) core, while on an AMD core the
C++ kernel was the faster (docs/notes/cpu-attention-findings.md, "Prefill attention"). Decode
attention, a read of K/V, stays on the C++ kernel everywhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdcluster.kernels import cpu_extension
from pdcluster.kernels.cpu_gemm import has_amx, uses_amx_gemm


_DTYPES = (torch.float32, torch.bfloat16)


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the C++ kernels take these inputs (CPU tensors, float32 or bfloat16 with the
    cache in q's dtype and `blocks_apart`, a head_dim they are specialized for: 16, 32, 48, 64,
    80, 96, 112, 128, 160, 192 or 256) and could be built. Math runs in float32 either way."""
    return (q.device.type == "cpu" and q.dtype in _DTYPES and k_cache.dtype == q.dtype
            and blocks_apart(k_cache) and cpu_extension.available()
            and cpu_extension.module().supports_head_dim(q.shape[-1]))


def blocks_apart(cache: torch.Tensor) -> bool:
    """Whether a paged cache [num_blocks, block_size, kv_heads, head_dim] has each block's
    tokens and heads contiguous, as the C++ kernels read it; the blocks themselves may sit
    apart (a layer's K or V of a cross-layer cache, engine.kv_cache)."""
    if cache.dim() != 4:
        return False
    if cache.is_contiguous():
        return True
    _, block_size, heads, head_dim = cache.shape
    return (cache.stride(3) == 1 and cache.stride(2) == head_dim
            and cache.stride(1) == heads * head_dim and cache.stride(0) >= block_size * heads * head_dim)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """See `torch_attention.paged_decode_attention`; float32 or bfloat16 (`supports`). Raises
    RuntimeError for inputs outside the contract (e.g. a seq_len beyond its block table)."""
    return cpu_extension.module().paged_decode_attention(q, k_cache, v_cache, block_tables,
                                                         seq_lens, scale)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """See `torch_attention.paged_prefill_attention`; float32 or bfloat16 (`supports`). Raises
    RuntimeError for inputs outside the contract (a seq_len beyond its block table or shorter
    than its new tokens)."""
    if q.dtype == torch.bfloat16 and has_tile_prefill():
        return cpu_extension.module().amx_prefill_attention(q, k_cache, v_cache, block_tables,
                                                            cu_seqlens_q, seq_lens, scale)
    if has_amx():
        return sdpa_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                      seq_lens, scale)
    return cpu_extension.module().paged_prefill_attention(q, k_cache, v_cache, block_tables,
                                                          cu_seqlens_q, seq_lens, scale)


def has_tile_prefill() -> bool:
    """Whether bfloat16 prefill runs on the tile kernel here: where torch's brgemm multiplies
    bfloat16 on AMX tiles (the condition of the tile GEMM, kernels.cpu_gemm.uses_amx_gemm)."""
    return uses_amx_gemm(torch.bfloat16)


def sdpa_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """`paged_prefill_attention` through torch's SDPA, one call per sequence: its K/V gathered
    from its blocks into [seq_len, kv_heads, head_dim], its new tokens attending bottom-right
    causally (new token i of L in a sequence of S sees keys 0..S-L+i). Same contract and
    errors as the C++ kernel's."""
    out = torch.empty_like(q)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    out[starts[-1]:].zero_()  # padding rows after the last chunk, as the C++ kernel leaves them
    for i, total in enumerate(lens):
        begin, end = starts[i], starts[i + 1]
        new = end - begin
        if new == 0:
            continue
        if total < new:
            raise RuntimeError(f"sequence {i}: seq_len {total} is shorter than its new tokens "
                               f"({new})")
        num_blocks = -(-total // block_size)
        if num_blocks > block_tables.shape[1]:
            raise RuntimeError(f"sequence {i}: seq_len {total} is beyond its block table "
                               f"({block_tables.shape[1]} blocks)")
        index = block_tables[i, :num_blocks].long()
        k, v = (c.index_select(0, index).view(-1, num_kv_heads, head_dim)[:total]
                .transpose(0, 1).unsqueeze(0) for c in (k_cache, v_cache))
        query = q[begin:end].transpose(0, 1).unsqueeze(0)
        mask = None if new == total else torch.ones(new, total, dtype=torch.bool).tril(total - new)
        attended = F.scaled_dot_product_attention(query, k, v, attn_mask=mask,
                                                  is_causal=mask is None, scale=scale,
                                                  enable_gqa=True)
        out[begin:end] = attended[0].transpose(0, 1)
    return out
