"""Kernel dispatch: the engine calls these functions, never an implementation directly.

Every function currently runs its torch reference (`kernels.reference`). The Triton kernels
(CUDA tensors, or CPU under TRITON_INTERPRET=1) plug in here: pick the implementation per call
from the tensors' device, keeping the reference as the fallback and the test oracle.
Shapes, dtypes and semantics are documented on the reference functions.
"""

from __future__ import annotations

import torch

from kernels import reference

__all__ = [
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "store_kv_cache",
]


def store_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter k/v [T, num_kv_heads, head_dim] into paged caches at slots; -1 skipped. In place.

    See `reference.store_kv_cache`."""
    reference.store_kv_cache(k, v, k_cache, v_cache, slot_mapping)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Varlen causal attention of packed new tokens over paged K/V -> [total_q, num_heads, head_dim].

    See `reference.paged_prefill_attention`."""
    return reference.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One-token-per-sequence attention over paged K/V -> [num_seqs, num_heads, head_dim].

    See `reference.paged_decode_attention`."""
    return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm, fused with the residual add when given -> (out, new_residual).

    See `reference.rms_norm`."""
    return reference.rms_norm(x, weight, eps, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x [..., 2d] = gate | up -> [..., d]. See `reference.silu_and_mul`."""
    return reference.silu_and_mul(x)


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q [T, H, D] and k [T, Hkv, D] with cos/sin [T, D] -> (q, k).

    See `reference.rotary_embedding`."""
    return reference.rotary_embedding(q, k, cos, sin)
