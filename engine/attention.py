"""Paged attention for one layer: store the new K/V, then attend over each sequence's blocks.

Batch layout (vLLM v1 / FlashAttention varlen): the new tokens of all sequences are packed
back to back; sequence i owns rows query_start_loc[i]:query_start_loc[i + 1] and has
seq_lens[i] tokens in the cache once they are stored (cached prefix + new tokens).

    slot_mapping[t] = block_tables[i][p // block_size] * block_size + p % block_size
                      for new token t of sequence i at position p;  -1 = padding, skipped
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pdcluster import kernels


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

    @functools.cached_property
    def mixed_rows(self) -> MixedRows | None:
        """For a batch of decode rows (one new token) beside prefill chunks, where each kind's
        rows are; None when every sequence is a decode or none is. Computed once per step,
        on the first layer that asks."""
        num_new = self.query_start_loc[1:] - self.query_start_loc[:-1]
        decoding = num_new == 1
        if bool(decoding.all()) or not bool(decoding.any()):
            return None
        chunked = ~decoding
        counts = num_new[chunked]
        cu = torch.zeros(counts.shape[0] + 1, dtype=torch.int32, device=counts.device)
        torch.cumsum(counts, 0, out=cu[1:])
        # query rows are packed in sequence order from 0, so row t belongs to sequence
        # repeat_interleave(num_new)[t]
        owner_chunked = chunked.repeat_interleave(num_new)
        return MixedRows(decoding, self.query_start_loc[:-1].to(torch.int64)[decoding],
                         chunked, owner_chunked.nonzero().squeeze(1), cu)


@dataclass(frozen=True)
class MixedRows:
    """A mixed batch's decode sequences (mask [num_seqs]) and their query rows, its chunked
    sequences (mask) and their query rows, and the chunks' cumulative new-token counts."""

    decoding: torch.Tensor
    decode_rows: torch.Tensor
    chunked: torch.Tensor
    chunk_rows: torch.Tensor
    chunk_cu: torch.Tensor


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Store k/v, then attend. q [T, H, D], k/v [T, Hkv, D]; caches [blocks, block_size, Hkv, D].
    `sliding_window` W > 0: each query sees the last W positions only (kernels). `softcap`
    c > 0: each score s becomes c * tanh(s / c) before the softmax (Gemma 2's attention logit
    soft-capping), computed by `softcapped_attention` in torch, the kernels having no such
    step.

    Uses the decode kernel when every sequence has exactly one new token (T == num_seqs), the
    varlen prefill kernel otherwise; where the decode kernel batches the rows
    (`kernels.decode_batches_rows`), a batch mixing decode rows and prefill chunks sends each
    kind to its own kernel. Returns [T, H, D]; rows past query_start_loc[-1] are zero.
    """
    kernels.store_kv_cache(k, v, k_cache, v_cache, attn.slot_mapping)
    if softcap > 0:
        return softcapped_attention(q, k_cache, v_cache, attn, scale, sliding_window, softcap)
    if q.shape[0] == attn.num_seqs:
        return kernels.paged_decode_attention(q, k_cache, v_cache, attn.block_tables,
                                              attn.seq_lens, scale, sliding_window)
    mixed = (attn.mixed_rows if sliding_window <= 0 and kernels.decode_batches_rows(q, k_cache)
             else None)
    if mixed is None:
        return kernels.paged_prefill_attention(q, k_cache, v_cache, attn.block_tables,
                                               attn.query_start_loc, attn.seq_lens, scale,
                                               sliding_window)
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)  # padding rows stay 0
    out[mixed.decode_rows] = kernels.paged_decode_attention(
        q[mixed.decode_rows], k_cache, v_cache, attn.block_tables[mixed.decoding],
        attn.seq_lens[mixed.decoding], scale)
    out[mixed.chunk_rows] = kernels.paged_prefill_attention(
        q[mixed.chunk_rows], k_cache, v_cache, attn.block_tables[mixed.chunked],
        mixed.chunk_cu, attn.seq_lens[mixed.chunked], scale)
    return out


def softcapped_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         attn: AttentionMetadata, scale: float, sliding_window: int,
                         softcap: float) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached K/V with soft-capped
    scores, in float32 torch, a sequence at a time (transformers' eager Gemma 2 attention):
    q [T, H, D], caches [blocks, block_size, Hkv, D] -> [T, H, D] in q's dtype."""
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    starts, lengths = attn.query_start_loc.tolist(), attn.seq_lens.tolist()
    for i, (start, end) in enumerate(zip(starts, starts[1:])):
        if end == start:
            continue
        length = lengths[i]
        blocks = attn.block_tables[i, :-(-length // block_size)].to(torch.int64)
        keys = k_cache[blocks].flatten(0, 1)[:length].float().repeat_interleave(group, dim=1)
        values = v_cache[blocks].flatten(0, 1)[:length].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * scale
        scores = softcap * torch.tanh(scores / softcap)
        query_pos = torch.arange(length - (end - start), length, device=q.device)[:, None]
        key_pos = torch.arange(length, device=q.device)[None, :]
        visible = key_pos <= query_pos
        if sliding_window > 0:
            visible &= key_pos > query_pos - sliding_window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out
