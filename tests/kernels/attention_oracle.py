"""Paged attention as plainly as torch writes it: the oracle the engine's attention paths
(`kernels.torch_attention`, the Triton kernels) are checked against, and the baseline of
benchmarks/cpu_attention.py.

Same contracts as `kernels.torch_attention` (cache layout, shapes, masks, GQA mapping); each
sequence's K/V is gathered into a dense copy and GQA repeats the KV heads (transformers'
repeat_kv). Attention math runs in float32 and the output is cast back to q's dtype.
"""

from __future__ import annotations

import torch


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
    sliding_window: int = 0,
) -> torch.Tensor:
    """Causal attention of packed new tokens over each sequence's whole paged K/V (the
    contract: `kernels.torch_attention.paged_prefill_attention`), one sequence at a time with
    an explicit bottom-right mask; with `sliding_window` W > 0 keys at or before p - W are
    masked too."""
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
        if sliding_window > 0:
            future |= key_pos[None, :] <= query_pos[:, None] - sliding_window
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
    sliding_window: int = 0,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged K/V (the contract:
    `kernels.torch_attention.paged_decode_attention`). Batched: gathers max_blocks blocks per
    sequence and masks the tail, and with `sliding_window` W > 0 the keys before the last W."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    table = block_tables.to(torch.int64)
    k = k_cache[table].reshape(num_seqs, -1, num_kv_heads, head_dim).to(torch.float32)
    v = v_cache[table].reshape(num_seqs, -1, num_kv_heads, head_dim).to(torch.float32)
    qg = q.to(torch.float32).view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("bngd,btnd->bngt", qg, k) * scale
    key_pos = torch.arange(k.shape[1], device=q.device)
    beyond = key_pos[None, :] >= seq_lens.to(torch.int64)[:, None]  # [B, T]
    if sliding_window > 0:
        beyond |= key_pos[None, :] < seq_lens.to(torch.int64)[:, None] - sliding_window
    scores.masked_fill_(beyond[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    out = torch.einsum("bngt,btnd->bngd", probs, v)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)
