"""ModelRunner: turns a batch of sequence chunks into one paged forward pass and logits.

A chunk is the next slice of one sequence: a whole prompt, one piece of a chunked prefill (its
earlier pieces, or a reused cached prefix, already in the cache), or the single token of a
decode step. Any mix can share one `execute` call. The caller (a worker's scheduler) owns block
allocation; the runner only checks that each block table covers the chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

import kernels

from engine.attention import AttentionMetadata
from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import PagedKVCache
from engine.loader import load_state_dict
from engine.model import build_model


@dataclass(frozen=True)
class SequenceChunk:
    """New tokens of one sequence for one forward pass.

    token_ids: the new tokens (>= 1); num_computed_tokens: tokens of this sequence already in the
    KV cache (positions 0..n-1); block_table: physical block ids covering at least
    num_computed_tokens + len(token_ids) tokens (block j holds positions j*block_size ...).
    """

    token_ids: Sequence[int]
    num_computed_tokens: int
    block_table: Sequence[int]


class ModelRunner:
    """Owns the model weights and this worker's paged KV cache; runs batches of chunks."""

    def __init__(self, engine_config: EngineConfig, model_config: ModelConfig | None = None) -> None:
        """Load config (unless given) and weights from `engine_config.model`, allocate the cache.

        Raises ModelConfigError / WeightsNotFoundError / WeightLoadError for a bad checkpoint and
        ValueError for a max_model_len beyond the model's limit. Sets torch's intra-op threads
        (process-wide) to `engine_config.torch_threads`.
        """
        self.engine_config = engine_config
        self.model_config = model_config or ModelConfig.from_pretrained(engine_config.model)
        self.max_model_len = engine_config.resolved_max_model_len(self.model_config)
        torch.set_num_threads(engine_config.torch_threads)
        kernels.set_backend(engine_config.kernel_backend)
        self.device = torch.device(engine_config.device)
        dtype = engine_config.torch_dtype()
        self.model = build_model(self.model_config, dtype, self.device)
        self.model.load_weights(load_state_dict(engine_config.model))
        self.kv_cache = PagedKVCache(
            num_layers=self.model_config.num_hidden_layers,
            num_blocks=engine_config.num_kv_blocks,
            block_size=engine_config.block_size,
            num_kv_heads=self.model_config.num_key_value_heads,
            head_dim=self.model_config.head_dim,
            dtype=dtype,
            device=self.device,
        )

    @torch.inference_mode()
    def execute(self, chunks: list[SequenceChunk], *, all_logits: bool = False) -> torch.Tensor:
        """Run one forward pass over `chunks`, writing their K/V into the cache.

        Returns float32 logits on the engine device: [len(chunks), vocab] for each chunk's last
        token, or [total new tokens, vocab] in chunk order if `all_logits`.
        Raises ValueError for an empty batch or chunk, a negative num_computed_tokens, a sequence
        longer than max_model_len, or a block table too short or naming a block outside the cache.
        """
        if not chunks:
            raise ValueError("execute needs at least one chunk")
        input_ids, positions, attn = self._prepare(chunks)
        hidden = self.model(input_ids, positions, self.kv_cache, attn)
        if not all_logits:
            hidden = hidden[attn.query_start_loc[1:].to(torch.int64) - 1]
        return self.model.compute_logits(hidden)

    def _prepare(self, chunks: list[SequenceChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        block_size = self.kv_cache.block_size
        token_ids: list[int] = []
        positions, slots, tables = [], [], []
        seq_lens, query_start_loc = [], [0]
        for index, chunk in enumerate(chunks):
            start, num_new = chunk.num_computed_tokens, len(chunk.token_ids)
            seq_len = start + num_new
            self._validate(index, chunk, seq_len)
            table = torch.tensor(list(chunk.block_table[: -(-seq_len // block_size)]), dtype=torch.int64)
            chunk_positions = torch.arange(start, seq_len, dtype=torch.int64)
            token_ids.extend(chunk.token_ids)
            positions.append(chunk_positions)
            slots.append(table[chunk_positions // block_size] * block_size + chunk_positions % block_size)
            tables.append(table)
            seq_lens.append(seq_len)
            query_start_loc.append(query_start_loc[-1] + num_new)
        block_tables = torch.zeros((len(chunks), max(len(t) for t in tables)), dtype=torch.int32)
        for row, table in enumerate(tables):
            block_tables[row, : len(table)] = table
        device = self.device
        attn = AttentionMetadata(
            slot_mapping=torch.cat(slots).to(device),
            block_tables=block_tables.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            max_seq_len=max(seq_lens),
        )
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
        return input_ids, torch.cat(positions).to(device), attn

    def _validate(self, index: int, chunk: SequenceChunk, seq_len: int) -> None:
        block_size, num_blocks = self.kv_cache.block_size, self.kv_cache.num_blocks
        if not chunk.token_ids:
            raise ValueError(f"chunk {index}: token_ids is empty")
        if chunk.num_computed_tokens < 0:
            raise ValueError(f"chunk {index}: num_computed_tokens {chunk.num_computed_tokens} < 0")
        if seq_len > self.max_model_len:
            raise ValueError(
                f"chunk {index}: positions up to {seq_len - 1} exceed max_model_len {self.max_model_len}"
            )
        needed = -(-seq_len // block_size)
        if len(chunk.block_table) < needed:
            raise ValueError(
                f"chunk {index}: block_table has {len(chunk.block_table)} blocks, {seq_len} tokens "
                f"need {needed} (block_size {block_size})"
            )
        bad = [b for b in chunk.block_table[:needed] if not 0 <= b < num_blocks]
        if bad:
            raise ValueError(f"chunk {index}: block ids {bad[:5]} outside the cache's [0, {num_blocks})")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in chunk.token_ids):
            raise ValueError(f"chunk {index}: token id outside the vocabulary [0, {vocab})")
