"""A step's model inputs in persistent buffers (vLLM's persistent batch inputs).

Token ids, positions, the slot mapping, block tables, sequence lengths and query start offsets
are written in place into buffers allocated once, and each step hands the model views of their
first rows: no tensor is allocated per step, and a compiled graph (or, on CUDA, a captured one)
reads inputs at stable addresses. The buffers grow, by doubling, only when a step holds more
tokens or sequences than any before it.

On CPU the tensors share memory with numpy arrays that the host-side preparation writes; on
another device the host arrays are copied into device buffers of the same shape each step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.core.blocks import num_blocks_for


@dataclass(frozen=True)
class SequenceChunk:
    """New tokens of one sequence for one forward pass.

    token_ids: the new tokens (>= 1); num_computed_tokens: tokens of this sequence already in the
    KV cache (positions 0..n-1); block_table: physical block ids covering at least
    num_computed_tokens + len(token_ids) tokens (block j holds positions j*block_size ...);
    lora_slot: the runner's index of the sequence's LoRA adapter (engine.lora), -1: none.
    """

    token_ids: Sequence[int]
    num_computed_tokens: int
    block_table: Sequence[int]
    lora_slot: int = -1


class _Buffer:
    """A host numpy array and the tensor the model reads it through (the same memory on CPU)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.host_tensor = torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")
        self.host = self.host_tensor.numpy()
        self.device_tensor = (self.host_tensor if device.type == "cpu"
                              else torch.zeros(shape, dtype=dtype, device=device))

    def view(self, *index: slice) -> torch.Tensor:
        """The device tensor's rows `index`, holding the host rows' values (copied now off
        CPU). The copy is synchronous: the host rows are rewritten by the next step."""
        if self.device_tensor is not self.host_tensor:
            self.device_tensor[index].copy_(self.host_tensor[index])
        return self.device_tensor[index]


class InputBuffers:
    """Persistent inputs of one runner: up to `max_tokens` new tokens of up to `max_seqs`
    sequences per step (both grow on demand), block tables `max_model_len / block_size`
    blocks wide."""

    def __init__(self, max_tokens: int, max_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self.max_blocks = num_blocks_for(max_model_len, block_size)
        self._arange = np.arange(max_model_len, dtype=np.int64)
        #: counts the (re)allocations: views taken before a change point at dropped buffers
        self.generation = 0
        self._allocate_tokens(max_tokens)
        self._allocate_seqs(max_seqs)

    def _allocate_tokens(self, n: int) -> None:
        self.generation += 1
        self.max_tokens = n
        self._input_ids = _Buffer((n,), torch.int64, self.device)
        self._positions = _Buffer((n,), torch.int64, self.device)
        self._slot_mapping = _Buffer((n,), torch.int64, self.device)

    def _allocate_seqs(self, n: int) -> None:
        self.generation += 1
        self.max_seqs = n
        self._block_tables = _Buffer((n, self.max_blocks), torch.int32, self.device)
        self._seq_lens = _Buffer((n,), torch.int32, self.device)
        self._query_start_loc = _Buffer((n + 1,), torch.int32, self.device)

    def prepare(self, chunks: Sequence[SequenceChunk], pad_to: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids int64 [T], positions int64 [T], the batch's AttentionMetadata) for
        validated chunks (block tables long enough, sequences within max_model_len), as views
        of the buffers valid until the next `prepare`. block_tables is [S, max_blocks]; a
        row's entries past its sequence's blocks are stale and never read.

        `pad_to`: a batch of decode chunks (one token each) is padded with padding sequences
        up to `pad_to` sequences (and tokens): token 0 at position 0, slot -1 (its K/V is not
        stored), seq_len 1, block table row [0, ...] (it reads block 0; its output is
        meaningless). Raises ValueError if a chunk has more than one token or pad_to is below
        the batch."""
        num_tokens = sum(len(chunk.token_ids) for chunk in chunks)
        if pad_to is not None:
            if num_tokens != len(chunks) or pad_to < len(chunks):
                raise ValueError(f"padding to {pad_to} needs at most {pad_to} one-token chunks")
            num_tokens = pad_to
        num_seqs = len(chunks) if pad_to is None else pad_to
        if num_tokens > self.max_tokens:
            self._allocate_tokens(max(num_tokens, 2 * self.max_tokens))
        if num_seqs > self.max_seqs:
            self._allocate_seqs(max(num_seqs, 2 * self.max_seqs))
        ids, positions = self._input_ids.host, self._positions.host
        slots, tables = self._slot_mapping.host, self._block_tables.host
        seq_lens, starts = self._seq_lens.host, self._query_start_loc.host
        block_size, t, max_seq_len = self.block_size, 0, 0
        starts[0] = 0
        for row, chunk in enumerate(chunks):
            start, num_new = chunk.num_computed_tokens, len(chunk.token_ids)
            seq_len, end = start + num_new, t + num_new
            num_blocks = num_blocks_for(seq_len, block_size)
            tables[row, :num_blocks] = chunk.block_table[:num_blocks]
            if num_blocks and chunk.block_table[0] < 0:
                # released blocks (NULL_BLOCK, a prefix of the table: outside a sliding window)
                # read block 0, whose keys the window masks, as vLLM's null block
                np.maximum(tables[row, :num_blocks], 0, out=tables[row, :num_blocks])
            ids[t:end] = chunk.token_ids
            chunk_positions = positions[t:end]
            chunk_positions[:] = self._arange[start:seq_len]
            chunk_slots = slots[t:end]
            np.floor_divide(chunk_positions, block_size, out=chunk_slots)
            chunk_slots[:] = tables[row][chunk_slots]
            chunk_slots *= block_size
            chunk_slots += chunk_positions % block_size
            seq_lens[row] = seq_len
            starts[row + 1] = end
            t, max_seq_len = end, max(max_seq_len, seq_len)
        if num_seqs > t:  # padding sequences, one token each
            ids[t:num_seqs] = 0
            positions[t:num_seqs] = 0
            slots[t:num_seqs] = -1
            tables[t:num_seqs, 0] = 0
            seq_lens[t:num_seqs] = 1
            starts[t + 1:num_seqs + 1] = np.arange(t + 1, num_seqs + 1)
            t, max_seq_len = num_seqs, max(max_seq_len, 1)
        attn = AttentionMetadata(
            slot_mapping=self._slot_mapping.view(slice(0, t)),
            block_tables=self._block_tables.view(slice(0, num_seqs)),
            seq_lens=self._seq_lens.view(slice(0, num_seqs)),
            query_start_loc=self._query_start_loc.view(slice(0, num_seqs + 1)),
            max_seq_len=max_seq_len,
        )
        return self._input_ids.view(slice(0, t)), self._positions.view(slice(0, t)), attn
