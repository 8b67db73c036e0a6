"""Acceptance: paged-engine logits equal transformers' LlamaForCausalLM (fp32, max abs diff <= 1e-4).

Each test runs on the eager forward and on the compiled one (engine.compilation), and eager
on a cross-layer cache (engine.kv_cache). Two
checkpoints: the bundled stories260K, and a random 2-layer GQA model with untied embeddings,
Llama-3 rope scaling (original_max_position_embeddings=64, so the scaling changes every position)
saved sharded. Block tables are shuffled so blocks are never contiguous; decode steps cross
several block boundaries; HF runs the full sequence once and every engine step is compared with
its rows.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass

import pytest
import torch
import transformers

from pdcluster.engine.config import BUNDLED_MODEL, EngineConfig
from pdcluster.engine.kv_cache import PagedKVCache
from pdcluster.engine.model_config import ModelConfig
from pdcluster.engine.runner import ModelRunner, SequenceChunk

ATOL = 1e-4
NUM_BLOCKS = 64
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@dataclass
class Case:
    path: str
    block_size: int
    runner: ModelRunner
    hf: transformers.LlamaForCausalLM

    def engine_config(self, **overrides) -> EngineConfig:
        fields = {"model": self.path, "block_size": self.block_size, "num_kv_blocks": NUM_BLOCKS,
                  "enforce_eager": self.runner.forward_mode == "eager", **overrides}
        return EngineConfig(**fields)

    def hf_logits(self, tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.hf(torch.tensor([tokens])).logits[0].float()


@pytest.fixture(scope="module")
def random_llama3_checkpoint(tmp_path_factory) -> str:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, max_position_embeddings=512,
        initializer_range=0.2, rope_parameters=dict(LLAMA3_ROPE), bos_token_id=1, eos_token_id=2,
    )
    path = tmp_path_factory.mktemp("random_llama3")
    transformers.LlamaForCausalLM(config).save_pretrained(path, max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file() and not (path / "model.safetensors").exists()
    return str(path)


@pytest.fixture(scope="module", params=[("stories260K", "eager"), ("random_llama3", "eager"),
                                        ("stories260K", "compiled"),
                                        ("random_llama3", "compiled"),
                                        ("stories260K", "eager", "cross-layer"),
                                        ("random_llama3", "eager", "cross-layer")],
                ids=lambda p: "-".join(p))
def case(request) -> Case:
    name, mode, *layout = request.param  # the cache's layout: a tensor per layer by default
    if name == "stories260K":
        path, block_size = str(BUNDLED_MODEL), 16
    else:
        path, block_size = request.getfixturevalue("random_llama3_checkpoint"), 4
    hf = transformers.LlamaForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    runner = ModelRunner(EngineConfig(model=path, block_size=block_size, num_kv_blocks=NUM_BLOCKS,
                                      enforce_eager=mode == "eager",
                                      kv_cache_layout=layout[0] if layout else "auto"))
    assert runner.forward_mode == mode
    assert runner.kv_cache.layout == (layout[0] if layout else "layer")
    return Case(path, block_size, runner, hf)


def _shuffled_tables(seed: int, *lengths: int) -> list[list[int]]:
    order = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(order)
    tables, start = [], 0
    for length in lengths:
        tables.append(order[start : start + length])
        start += length
    return tables


def _prompt(seed: int, length: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, vocab) for _ in range(length - 1)]


def _max_diff(got: torch.Tensor, expected: torch.Tensor) -> float:
    assert got.dtype == torch.float32 and got.shape == expected.shape
    return (got - expected).abs().max().item()


def test_chunked_prefill_then_decode_matches_hf(case):
    vocab = case.runner.model_config.vocab_size
    tokens = _prompt(11, 13, vocab)
    num_decodes = 2 * case.block_size + 3
    (table,) = _shuffled_tables(1, -(-(len(tokens) + num_decodes) // case.block_size))
    step_logits = [case.runner.execute([SequenceChunk(tokens[:6], 0, table)], all_logits=True)]
    # Second chunk attends to the first chunk's K/V from the cache.
    step_logits.append(case.runner.execute([SequenceChunk(tokens[6:], 6, table)], all_logits=True))
    for _ in range(num_decodes):
        tokens.append(int(step_logits[-1][-1].argmax()))
        step_logits.append(case.runner.execute([SequenceChunk(tokens[-1:], len(tokens) - 1, table)]))
    got = torch.cat(step_logits)
    expected = case.hf_logits(tokens)
    diff = _max_diff(got, expected)
    print(f"{case.runner.model_config.name}: prefill + {num_decodes} decodes, max abs diff {diff:.2e}")
    assert diff <= ATOL


def test_two_sequences_batched_match_hf(case):
    vocab = case.runner.model_config.vocab_size
    bs = case.block_size
    a, b = _prompt(21, 10 + 2 * bs, vocab), _prompt(22, 13 + 2 * bs + 3, vocab)
    table_a, table_b = _shuffled_tables(2, -(-len(a) // bs), -(-len(b) // bs))
    expected_a, expected_b = case.hf_logits(a), case.hf_logits(b)
    diffs = []
    # Step 1: two prefills packed together.
    chunks = [SequenceChunk(a[:9], 0, table_a), SequenceChunk(b[:5], 0, table_b)]
    out = case.runner.execute(chunks, all_logits=True)
    diffs += [_max_diff(out[:9], expected_a[:9]), _max_diff(out[9:], expected_b[:5])]
    # Step 2: a decode of A mixed with B's second prefill chunk (prefill kernel path).
    out = case.runner.execute([SequenceChunk(a[9:10], 9, table_a), SequenceChunk(b[5:13], 5, table_b)])
    diffs += [_max_diff(out[0], expected_a[9]), _max_diff(out[1], expected_b[12])]
    # Then pure decode batches (decode kernel path) until A ends, B alone after.
    for pos_a, pos_b in zip(range(10, len(a)), range(13, len(b))):
        chunks = [SequenceChunk([a[pos_a]], pos_a, table_a), SequenceChunk([b[pos_b]], pos_b, table_b)]
        out = case.runner.execute(chunks)
        diffs += [_max_diff(out[0], expected_a[pos_a]), _max_diff(out[1], expected_b[pos_b])]
    for pos_b in range(pos_b + 1, len(b)):
        out = case.runner.execute([SequenceChunk([b[pos_b]], pos_b, table_b)])
        diffs.append(_max_diff(out[0], expected_b[pos_b]))
    print(f"{case.runner.model_config.name}: batched max abs diff {max(diffs):.2e}")
    assert max(diffs) <= ATOL


def test_blocks_migrated_to_another_cache_keep_logits(case):
    """Prefill on one runner, copy its blocks into another runner's cache, decode there."""
    vocab, bs = case.runner.model_config.vocab_size, case.block_size
    tokens = _prompt(31, bs + 3, vocab) + _prompt(32, bs + 1, vocab)[1:]
    prefill_len = bs + 3
    src_table, dst_table = _shuffled_tables(3, -(-len(tokens) // bs), -(-len(tokens) // bs))
    case.runner.execute([SequenceChunk(tokens[:prefill_len], 0, src_table)])
    used = -(-prefill_len // bs)
    blocks = case.runner.kv_cache.read_blocks(src_table[:used])
    decoder = ModelRunner(case.engine_config())
    decoder.kv_cache.write_blocks(dst_table[:used], blocks)
    expected = case.hf_logits(tokens)
    diffs = [
        _max_diff(decoder.execute([SequenceChunk([tokens[pos]], pos, dst_table)])[0], expected[pos])
        for pos in range(prefill_len, len(tokens))
    ]
    assert max(diffs) <= ATOL


def test_old_style_config_keys_give_same_config_and_logits(case, tmp_path):
    config_path = tmp_path / "old" / "config.json"
    shutil.copytree(case.path, config_path.parent)
    raw = json.loads(config_path.read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type")
    raw["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **rope}
    config_path.write_text(json.dumps(raw))
    old = ModelConfig.from_pretrained(config_path.parent)
    new = case.runner.model_config
    assert {**vars(old), "name": new.name, "hf_config": {}} == {**vars(new), "hf_config": {}}
    tokens = _prompt(41, 3 * case.block_size, new.vocab_size)
    (table,) = _shuffled_tables(4, 3)
    chunk = [SequenceChunk(tokens, 0, table)]
    old_runner = ModelRunner(case.engine_config(model=str(config_path.parent)))
    old_logits = old_runner.execute(chunk, all_logits=True)
    torch.testing.assert_close(old_logits, case.runner.execute(chunk, all_logits=True), atol=0, rtol=0)


def test_bfloat16_engine_close_to_fp32(case):
    tokens = _prompt(51, 20, case.runner.model_config.vocab_size)
    (table,) = _shuffled_tables(5, -(-20 // case.block_size))
    chunk = [SequenceChunk(tokens, 0, table)]
    bf16 = ModelRunner(case.engine_config(dtype="bfloat16")).execute(chunk, all_logits=True)
    fp32 = case.runner.execute(chunk, all_logits=True)
    assert bf16.dtype == torch.float32 and torch.isfinite(bf16).all()
    assert (bf16 - fp32).abs().max() < 0.1 * fp32.abs().max()


def test_execute_validates_chunks(case):
    runner, bs = case.runner, case.block_size
    with pytest.raises(ValueError, match="block_table"):
        runner.execute([SequenceChunk([5] * (bs + 1), 0, [0])])
    with pytest.raises(ValueError, match="max_model_len"):
        runner.execute([SequenceChunk([5, 6], runner.max_model_len - 1, list(range(NUM_BLOCKS)))])
    with pytest.raises(ValueError, match="outside the cache"):
        runner.execute([SequenceChunk([5], 0, [NUM_BLOCKS])])
    with pytest.raises(ValueError, match="empty"):
        runner.execute([SequenceChunk([], 0, [0])])
    with pytest.raises(ValueError, match="at least one"):
        runner.execute([])


def test_paged_kv_cache_block_roundtrip_and_errors():
    cache = PagedKVCache.attention(
        num_layers=3, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=5, dtype=torch.float32, device="cpu"
    )
    assert cache.block_nbytes == 3 * 2 * 4 * 2 * 5 * 4
    typed = torch.randn(2, 3, 2, 4, 2, 5)  # [n, layers, K|V, block_size, kv_heads, head_dim]
    data = typed.view(2, -1).view(torch.uint8)
    cache.write_blocks([6, 1], data)
    assert torch.equal(cache.read_blocks([6, 1]), data)
    assert torch.equal(cache.k[2][1], typed[1, 2, 0]) and torch.equal(cache.v[0][6], typed[0, 0, 1])
    assert cache.read_blocks([]).shape == (0, cache.block_nbytes)
    with pytest.raises(ValueError, match="shape"):
        cache.write_blocks([0], data)
    with pytest.raises(ValueError, match="dtype"):
        cache.write_blocks([0, 2], data.view(torch.int8))
    with pytest.raises(ValueError, match="out of range"):
        cache.read_blocks([8])
    with pytest.raises(ValueError, match="repeated"):
        cache.write_blocks([3, 3], data)
