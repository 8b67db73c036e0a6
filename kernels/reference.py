"""Torch implementations of the engine's kernels other than attention (CPU path and test
oracle; paged attention's CPU path is `kernels.torch_attention`).

Paged cache layout (vLLM / nano-vllm "NHD" blocks), per layer:

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset            (slot -1 = padding, skipped)
    token t of a sequence lives in block block_table[t // block_size], offset t % block_size
"""

from __future__ import annotations

import torch


def store_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k/v [num_tokens, num_kv_heads, head_dim] into the caches at `slot_mapping`, in place.

    slot_mapping: int64 [num_tokens]; -1 entries are skipped (nano-vllm's store_kvcache,
    vLLM's reshape_and_cache). k/v are cast to the cache dtype.
    """
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(torch.int64)
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, optionally fused with the residual add.

    x, residual: [..., hidden]; weight: [hidden]. With a residual: new_residual = x + residual and
    out = norm(new_residual) (vLLM's fused_add_rms_norm); without: new_residual = x.
    The normalization runs in float32 and is cast back before the weight multiply, like
    transformers' LlamaRMSNorm. Returns (out, new_residual) in x's dtype.
    """
    hidden = x if residual is None else x + residual
    h32 = hidden.to(torch.float32)
    normed = h32 * torch.rsqrt(h32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), hidden


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation: x [..., 2 * d] = gate | up  ->  silu(gate) * up, [..., d] (vLLM op)."""
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox/HF "rotate half" RoPE of q [T, num_heads, D] and k [T, num_kv_heads, D], in place.

    positions: int [T]; cos_sin_cache: [max_position, D] = cos | sin, each [max_position, D/2]
    (vLLM's layout; row p holds cos(p * inv_freq) then sin(p * inv_freq)). With x = x1 | x2
    (halves): out = x1 cos - x2 sin | x2 cos + x1 sin, i.e. transformers' apply_rotary_pos_emb
    (x * cos + rotate_half(x) * sin with the frequencies repeated twice). cos/sin are cast to each
    input's dtype first, as transformers does. Returns (q, k), the same tensors.
    """
    cos, sin = cos_sin_cache[positions.to(torch.int64)].chunk(2, dim=-1)
    q.copy_(_rotate(q, cos, sin))
    k.copy_(_rotate(k, cos, sin))
    return q, k


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """Routing-weighted sum of SwiGLU experts, grouped by expert.

    x [T, H]; w13 [E, 2I, H] (each expert's gate rows, then up rows); w2 [E, H, I];
    topk_weights float [T, k]; topk_ids int [T, k] (experts in [0, E)). Returns [T, H] in x's
    dtype: sum_j topk_weights[t, j] * w2[e] @ silu_and_mul(w13[e] @ x[t]) with e =
    topk_ids[t, j]. The T*k (token, slot) rows are sorted by expert (stable) and each expert
    with rows runs one GEMM over them; products are weighted in float32 and summed over the
    slots in float32, then cast.
    """
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    rows = x[order // top_k]
    out = torch.empty(rows.shape[0], w2.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            end = start + count
            hidden = silu_and_mul(torch.nn.functional.linear(rows[start:end], w13[expert]))
            out[start:end] = torch.nn.functional.linear(hidden, w2[expert])
            start = end
    by_slot = torch.empty_like(out)
    by_slot[order] = out
    weighted = by_slot.view(num_tokens, top_k, -1).to(torch.float32) * topk_weights[..., None]
    return weighted.sum(dim=1).to(x.dtype)
