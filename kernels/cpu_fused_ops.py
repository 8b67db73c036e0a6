"""The C++ elementwise ops of a decoder layer for CPU (`cpu_fused_ops.cpp`, built by
`kernels.cpu_extension`): each reads and writes its data once where eager torch runs several
ops with temporaries between them. Same contracts as `kernels.reference`, in float32 or
bfloat16 (`supports`); math in float32, bfloat16 intermediates rounded where the reference's
ops round them. Results equal the reference's up to the order of float additions in the
RMSNorm sum and the exp of SiLU (relative error below 1e-5 in float32; in bfloat16 the same
before the last rounding, so at most one bfloat16 step apart)."""

from __future__ import annotations

import torch

from pdcluster.kernels import cpu_extension


_DTYPES = (torch.float32, torch.bfloat16)


def supports(*tensors: torch.Tensor) -> bool:
    """Whether the C++ ops take these tensors: all on CPU in one dtype, float32 or bfloat16,
    and the extension built. (RoPE's cos/sin cache is float32 whatever the dtype: not one of
    these.)"""
    dtype = tensors[0].dtype
    return (dtype in _DTYPES and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)
            and cpu_extension.available())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See `reference.rms_norm`; x, residual [..., hidden] with contiguous rows (new tensors
    are returned; the inputs are not written)."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    out, new_residual = cpu_extension.module().fused_add_rms_norm(
        rows, weight, eps, None if residual is None else residual.reshape(-1, shape[-1]))
    return out.view(shape), new_residual.view(shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """See `reference.silu_and_mul`; x [..., 2d] with contiguous rows -> [..., d]."""
    out = cpu_extension.module().silu_and_mul(x.reshape(-1, x.shape[-1]))
    return out.view(*x.shape[:-1], x.shape[-1] // 2)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See `reference.rotary_embedding` (in place; q, k may be strided views of one
    projection, each head's row contiguous). Raises RuntimeError for a position outside the
    cache."""
    cpu_extension.module().rotary_embedding(positions, q, k, cos_sin_cache)
    return q, k


def store_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """See `reference.store_kv_cache` (caches in k's dtype). Raises RuntimeError for a slot
    outside the cache."""
    cpu_extension.module().store_kv_cache(k, v, k_cache, v_cache, slot_mapping)
