"""Paged attention in plain torch without gathering copies: the CPU path of the engine.

Caches use `kernels.reference`'s paged layout. GQA: query head h reads KV head
h // (num_heads // num_kv_heads) (transformers' repeat_kv). The contracts here are those of
the Triton kernels too; the plain oracle both are checked against is
tests/kernels/attention_oracle.py. What this path saves is memory traffic, which decides CPU
decode speed (measured: the oracle's padded gather + einsum copies took ~70 % of a 100M-model
decode step at batch 32; see docs/notes/cpu-attention-findings.md, "CPU attention path"):

- a sequence whose block table is a run of consecutive block ids reads its K/V as a *view* of
  the cache (no copy); otherwise `index_select` copies only its own blocks, never a padded
  max_blocks slab;
- GQA never repeats K/V: the query heads of one KV head form the rows of one matrix
  ([num_kv_heads, group, head_dim] @ [num_kv_heads, head_dim, seq_len]), and the strided K/V
  views go to BLAS as they are;
- prefill runs `torch.nn.functional.scaled_dot_product_attention` per sequence (its fused CPU
  kernel),
  with a bottom-right causal mask when a cached prefix precedes the new tokens (FlashAttention's
  `causal=True` convention for seqlen_k > seqlen_q).

Math in float32, output cast back to q's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sequence_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                start: int = 0) -> torch.Tensor:
    """Tokens [start, seq_len) of one sequence from a paged cache [num_blocks, block_size,
    num_kv_heads, head_dim]: [seq_len - start, num_kv_heads, head_dim], float32; a view of the
    cache when its blocks are consecutive ids in a float32 cache, else a copy of those blocks
    only (blocks before `start`'s are never read)."""
    block_size = cache.shape[1]
    first_block = start // block_size
    table = block_table[first_block:-(-seq_len // block_size)].to(torch.int64)
    num_blocks = table.shape[0]
    first = int(table[0])
    if num_blocks == 1 or bool((table[1:] - table[:-1] == 1).all()):
        blocks = cache[first:first + num_blocks]
    else:
        blocks = cache.index_select(0, table)
    offset = start - first_block * block_size
    return blocks.reshape(-1, *cache.shape[2:])[offset:seq_len - first_block * block_size].to(
        torch.float32)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged K/V (vLLM's paged_attention_v1).

    q: [num_seqs, num_heads, head_dim]; block_tables: int32 [num_seqs, max_blocks];
    seq_lens: int32 [num_seqs] including the new token (already stored). The new token is the last
    position, so it attends to all seq_len cached tokens, or with `sliding_window` W > 0 to the
    last W of them (Mistral's window: a query at p sees keys p - W < k <= p, as transformers'
    sliding-window mask and FlashAttention's window_size=(W - 1, 0)); blocks wholly before the
    window are not read. Returns [num_seqs, num_heads, head_dim] in q's dtype.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    qg = q.to(torch.float32).view(num_seqs, num_kv_heads, group, head_dim)
    out = torch.empty(num_seqs, num_kv_heads, group, head_dim, dtype=torch.float32,
                      device=q.device)
    for seq, seq_len in enumerate(seq_lens.tolist()):
        start = max(0, seq_len - sliding_window) if sliding_window > 0 else 0
        k = sequence_kv(k_cache, block_tables[seq], seq_len, start)  # [S, N, D]
        v = sequence_kv(v_cache, block_tables[seq], seq_len, start)
        scores = torch.bmm(qg[seq], k.permute(1, 2, 0)).mul_(scale)  # [N, G, S]
        torch.bmm(scores.softmax(dim=-1), v.transpose(0, 1), out=out[seq])  # [N, G, D]
    return out.view(num_seqs, num_heads, head_dim).to(q.dtype)


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
    """Causal attention of packed new tokens over each sequence's whole paged K/V.

    q: [total_q, num_heads, head_dim], the new tokens of all sequences packed back to back;
    block_tables: int32 [num_seqs, max_blocks]; cu_seqlens_q: int32 [num_seqs + 1];
    seq_lens: int32 [num_seqs], cached prefix + new tokens (their K/V already stored).
    New token i of a sequence with L new tokens and length S sits at position S - L + i and
    attends to positions 0..S-L+i: FlashAttention's `flash_attn_varlen_func(causal=True)` with
    seqlen_k >= seqlen_q (bottom-right aligned mask) and a paged K/V (vLLM's
    `flash_attn_varlen_func(block_table=...)`). With `sliding_window` W > 0 a token at p attends
    to positions p - W < k <= p only (as in `paged_decode_attention`). Returns [total_q,
    num_heads, head_dim] in q's dtype; rows past cu_seqlens_q[-1] (padding) are zero.
    """
    out = q.new_zeros((*q.shape[:2], v_cache.shape[-1]))
    starts = cu_seqlens_q.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[seq], starts[seq + 1]
        num_new = end - start
        if num_new == 0:
            continue
        # the first key any new token sees
        first_key = max(0, seq_len - num_new - sliding_window + 1) if sliding_window > 0 else 0
        k = sequence_kv(k_cache, block_tables[seq], seq_len, first_key).transpose(0, 1)  # [N, S, D]
        v = sequence_kv(v_cache, block_tables[seq], seq_len, first_key).transpose(0, 1)
        qs = q[start:end].to(torch.float32).transpose(0, 1)  # [H, L, D]
        if num_new == seq_len and sliding_window <= 0:
            mask, causal = None, True
        else:  # bottom-right aligned: new token i sits at position seq_len - num_new + i
            key_pos = torch.arange(first_key, seq_len, device=q.device)
            query_pos = torch.arange(seq_len - num_new, seq_len, device=q.device)
            mask, causal = key_pos[None, :] <= query_pos[:, None], False
            if sliding_window > 0:
                mask &= key_pos[None, :] > query_pos[:, None] - sliding_window
        # 4-D inputs: CPU SDPA takes its fused (flash) kernel with a mask only with a batch dim
        o = F.scaled_dot_product_attention(qs[None], k[None], v[None], attn_mask=mask,
                                           is_causal=causal, scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1).to(q.dtype)  # [H, L, D] -> [L, H, D]
    return out


def paged_mla_attention(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    v_dim: int,
) -> torch.Tensor:
    """Multi-head latent attention over a paged latent cache, in the latent space (the
    up-projections absorbed into the query and the output: DeepSeek-V2 §2.1, vLLM's MLA
    backend): one cached entry per token, [c | k_rope], serves every query head as its key,
    and its first `v_dim` features (c) as its value.

    q: [total_q, num_heads, D] (the absorbed q_nope | q_rope, D = v_dim + rope dims);
    latent_cache: [num_blocks, block_size, 1, D]; the rest as `paged_prefill_attention`
    (a decode row is a one-token chunk). Returns [total_q, num_heads, v_dim] in q's dtype.
    An all-decode batch runs as one batched product over each sequence's gathered latents
    (a single read of them serves as key and value); chunks run per sequence.
    """
    if q.shape[0] == seq_lens.shape[0]:
        return _mla_decode(q, latent_cache, block_tables, seq_lens, scale, v_dim)
    return paged_prefill_attention(q, latent_cache, latent_cache[..., :v_dim], block_tables,
                                   cu_seqlens_q, seq_lens, scale)


def _mla_decode(q: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, scale: float, v_dim: int) -> torch.Tensor:
    block_size, dim = latent_cache.shape[1], latent_cache.shape[3]
    lens = seq_lens.to(torch.int64)
    positions = torch.arange(int(lens.max()), device=q.device)
    slots = (block_tables[:, positions // block_size].to(torch.int64) * block_size
             + positions % block_size)  # [S, max_len]
    latents = latent_cache.reshape(-1, dim)[slots].to(torch.float32)  # [S, max_len, D]
    scores = torch.bmm(q.to(torch.float32), latents.transpose(1, 2)).mul_(scale)  # [S, H, T]
    scores.masked_fill_((positions[None, :] >= lens[:, None])[:, None, :], float("-inf"))
    out = torch.bmm(scores.softmax(dim=-1), latents[..., :v_dim])  # [S, H, v_dim]
    return out.to(q.dtype)
