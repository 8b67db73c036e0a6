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
    varlen prefill kernel otherwise; on CPU a batch mixing decode rows and prefill chunks sends
    each kind to its own kernel. Returns [T, H, D]; rows past query_start_loc[-1] are zero.
    One opaque op (`torch.ops.pdcluster.paged_attention`), so a compiled model splits its graph
    here, as vLLM's does at its attention op: the kernels' per-sequence work stays eager.
    """
    return torch.ops.pdcluster.paged_attention(q, k, v, k_cache, v_cache, attn.slot_mapping,
                                               attn.block_tables, attn.seq_lens,
                                               attn.query_start_loc, scale)


@torch.library.custom_op("pdcluster::paged_attention", mutates_args=("k_cache", "v_cache"))
def _paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    kernels.store_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    if q.shape[0] == seq_lens.shape[0]:
        return kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    num_new = query_start_loc[1:] - query_start_loc[:-1]
    decoding = num_new == 1
    if q.is_cuda or not bool(decoding.any()):
        return kernels.paged_prefill_attention(q, k_cache, v_cache, block_tables,
                                               query_start_loc, seq_lens, scale)
    # A mixed CPU batch (decode rows beside prefill chunks): the decode rows take the decode
    # kernel together, the chunks the prefill kernel, instead of one attention call per row.
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)  # padding rows stay 0
    rows = query_start_loc[:-1].to(torch.int64)
    decode_rows = rows[decoding]
    out[decode_rows] = kernels.paged_decode_attention(
        q[decode_rows], k_cache, v_cache, block_tables[decoding], seq_lens[decoding], scale)
    chunked = ~decoding
    counts = num_new[chunked]
    chunk_rows = torch.cat([torch.arange(int(start), int(start) + int(n))
                            for start, n in zip(rows[chunked], counts)]).to(q.device)
    cu = torch.zeros(counts.shape[0] + 1, dtype=torch.int32, device=q.device)
    torch.cumsum(counts, 0, out=cu[1:])
    out[chunk_rows] = kernels.paged_prefill_attention(
        q[chunk_rows], k_cache, v_cache, block_tables[chunked], cu, seq_lens[chunked], scale)
    return out


@_paged_attention_op.register_fake
def _(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale):
    return q.new_empty(q.shape)
