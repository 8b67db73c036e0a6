"""The C++ paged attention kernels for CPU (decode: `cpu_paged_decode.cpp`, prefill:
`cpu_paged_prefill.cpp`; built by `kernels.cpu_extension`)."""

from __future__ import annotations

import torch

import kernels.cpu_extension as cpu_extension


_DTYPES = (torch.float32, torch.bfloat16)


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the C++ kernels take these inputs (CPU tensors, float32 or bfloat16 with the
    cache in q's dtype, a head_dim they are specialized for: 16, 32, 48, 64, 80, 96, 112, 128,
    160, 192 or 256) and could be built. Math runs in float32 either way."""
    return (q.device.type == "cpu" and q.dtype in _DTYPES and k_cache.dtype == q.dtype
            and k_cache.is_contiguous() and cpu_extension.available()
            and cpu_extension.module().supports_head_dim(q.shape[-1]))


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
    return cpu_extension.module().paged_prefill_attention(q, k_cache, v_cache, block_tables,
                                                          cu_seqlens_q, seq_lens, scale)
