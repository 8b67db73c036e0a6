"""Paged attention for one layer: store the new K/V, then attend over each sequence's blocks.

Batch layout (vLLM v1 / FlashAttention varlen): the new tokens of all sequences are packed
back to back; sequence i owns rows query_start_loc[i]:query_start_loc[i + 1] and has
seq_lens[i] tokens in the cache once they are stored (cached prefix + new tokens).

    slot_mapping[t] = block_tables[i][p // block_size] * block_size + p % block_size
                      for new token t of sequence i at position p;  -1 = padding, skipped
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels


@dataclass
class AttentionMetadata:
    """Where a batch's tokens go in the paged cache and what each sequence attends to.

    slot_mapping: int64 [num_tokens]; block_tables: int32 [num_seqs, max_blocks], padded with 0;
    seq_lens: int32 [num_seqs], tokens in the cache incl. the new ones; query_start_loc: int32
    [num_seqs + 1], cumulative new-token counts; max_seq_len: max(seq_lens).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Store k/v, then attend. q [T, H, D], k/v [T, Hkv, D]; caches [blocks, block_size, Hkv, D].

    Uses the decode kernel when every sequence has exactly one new token (T == num_seqs), the
    varlen prefill kernel otherwise (any mix of prefill chunks and decodes). Returns [T, H, D].
    """
    kernels.store_kv_cache(k, v, k_cache, v_cache, attn.slot_mapping)
    if q.shape[0] == attn.num_seqs:
        return kernels.paged_decode_attention(q, k_cache, v_cache, attn.block_tables, attn.seq_lens, scale)
    return kernels.paged_prefill_attention(
        q, k_cache, v_cache, attn.block_tables, attn.query_start_loc, attn.seq_lens, scale
    )
