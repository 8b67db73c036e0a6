"""Torch reference implementations of the engine's kernels (CPU path and test oracle).

Paged cache layout (vLLM / nano-vllm "NHD" blocks), per layer:

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset            (slot -1 = padding, skipped)
    token t of a sequence lives in block block_table[t // block_size], offset t % block_size

GQA: query head h reads KV head h // (num_heads // num_kv_heads) (transformers' repeat_kv).
Attention math runs in float32 and the output is cast back to q's dtype.
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


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` tokens of one sequence: [seq_len, num_kv_heads, head_dim] (a copy)."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache[block_table[:num_blocks].to(torch.int64)]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed new tokens over each sequence's whole paged K/V.

    q: [total_q, num_heads, head_dim], the new tokens of all sequences packed back to back;
    block_tables: int32 [num_seqs, max_blocks]; cu_seqlens_q: int32 [num_seqs + 1];
    seq_lens: int32 [num_seqs], cached prefix + new tokens (their K/V already stored).
    New token i of a sequence with L new tokens and length S sits at position S - L + i and
    attends to positions 0..S-L+i: FlashAttention's `flash_attn_varlen_func(causal=True)` with
    seqlen_k >= seqlen_q (bottom-right aligned mask) and a paged K/V (vLLM's
    `flash_attn_varlen_func(block_table=...)`). Returns [total_q, num_heads, head_dim] in q's dtype;
    rows past cu_seqlens_q[-1] (padding) are zero.
    """
    out = torch.zeros_like(q)
    num_heads = q.shape[1]
    starts = cu_seqlens_q.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[seq], starts[seq + 1]
        num_new = end - start
        if num_new == 0:
            continue
        k = gather_kv(k_cache, block_tables[seq], seq_len).to(torch.float32)
        v = gather_kv(v_cache, block_tables[seq], seq_len).to(torch.float32)
        group = num_heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1)  # [S, H, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].to(torch.float32), k) * scale
        query_pos = torch.arange(seq_len - num_new, seq_len, device=q.device)
        key_pos = torch.arange(seq_len, device=q.device)
        future = key_pos[None, :] > query_pos[:, None]  # [L, S]
        scores.masked_fill_(future[None], float("-inf"))
        probs = scores.softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged K/V (vLLM's paged_attention_v1).

    q: [num_seqs, num_heads, head_dim]; block_tables: int32 [num_seqs, max_blocks];
    seq_lens: int32 [num_seqs] including the new token (already stored). The new token is the last
    position, so it attends to all seq_len cached tokens. Returns [num_seqs, num_heads, head_dim]
    in q's dtype. Batched: gathers max_blocks blocks per sequence and masks the tail.
    """
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    table = block_tables.to(torch.int64)
    k = k_cache[table].reshape(num_seqs, -1, num_kv_heads, head_dim).to(torch.float32)
    v = v_cache[table].reshape(num_seqs, -1, num_kv_heads, head_dim).to(torch.float32)
    qg = q.to(torch.float32).view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("bngd,btnd->bngt", qg, k) * scale
    key_pos = torch.arange(k.shape[1], device=q.device)
    beyond = key_pos[None, :] >= seq_lens.to(torch.int64)[:, None]  # [B, T]
    scores.masked_fill_(beyond[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    out = torch.einsum("bngt,btnd->bngd", probs, v)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


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
