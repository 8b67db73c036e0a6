"""Every served family against transformers, on its tiny random checkpoint
(tests/models/factory.py): paged logits of a chunked prefill then 32 decode steps across block
boundaries, and of a prompt that reuses another's cached prefix blocks, equal the reference's
(fp32, max abs diff <= 1e-4); bf16 logits stay within the Llama bf16 test's bound. The
sliding-window cases run prompts of several windows, in chunks, and decode past the window.
"""

from __future__ import annotations

import copy

import pytest
import torch

from engine.config import EngineConfig
from engine.runner import ModelRunner, SequenceChunk
from tests.engine.test_paged_logits import ATOL, _max_diff, _prompt, _shuffled_tables
from tests.models.factory import BASE, build

BLOCK = 4
NUM_DECODES = 32
#: id -> (family, config overrides): each family, plus the edge cases of the factory
CASES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "mistral": ("mistral", {}),
    # a window of 2 blocks: every prompt and decode here runs past it
    "mistral-window": ("mistral", {"sliding_window": 2 * BLOCK}),
    # the window on layer 1 only (max_window_layers)
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 2 * BLOCK,
                               "max_window_layers": 1}),
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
    "mixtral": ("mixtral", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "deepseek_v2": ("deepseek_v2", {}),
    "deepseek_v2-q_lora": ("deepseek_v2", {"q_lora_rank": 24}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def family(request, tmp_path_factory):
    name, overrides = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = build(name, path, **overrides)
    runner = ModelRunner(EngineConfig(model=str(path), block_size=BLOCK, num_kv_blocks=64,
                                      enforce_eager=True))
    return request.param, path, hf, runner


def _reference(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def test_chunked_prefill_then_decode_matches_transformers(family):
    name, _, hf, runner = family
    _check_prefill_then_decode(name, hf, runner)


def _check_prefill_then_decode(name: str, hf, runner: ModelRunner) -> None:
    tokens = _prompt(11, 13, BASE["vocab_size"])
    (table,) = _shuffled_tables(1, -(-(len(tokens) + NUM_DECODES) // BLOCK))
    steps = [runner.execute([SequenceChunk(tokens[:6], 0, table)], all_logits=True),
             runner.execute([SequenceChunk(tokens[6:], 6, table)], all_logits=True)]
    for _ in range(NUM_DECODES):
        tokens.append(int(steps[-1][-1].argmax()))
        steps.append(runner.execute([SequenceChunk(tokens[-1:], len(tokens) - 1, table)]))
    diff = _max_diff(torch.cat(steps), _reference(hf, tokens))
    print(f"{name}: prefill + {NUM_DECODES} decodes, max abs diff {diff:.2e}")
    assert diff <= ATOL


@pytest.mark.parametrize("family", ["deepseek_v2"], indirect=True)
def test_compiled_moe_and_mla_forward_matches_transformers(family):
    """The experts are a custom op, so a MoE and MLA model compiles whole (no fallback to
    eager) and its logits are the reference's."""
    name, path, hf, _ = family
    compiled = ModelRunner(EngineConfig(model=str(path), block_size=BLOCK, num_kv_blocks=64,
                                        enforce_eager=False))
    assert compiled.forward_mode == "compiled"
    _check_prefill_then_decode(f"{name} compiled", hf, compiled)


def test_prefix_hit_matches_transformers(family):
    """B's first 3 blocks are A's, already in the cache; only B's tail is computed."""
    name, _, hf, runner = family
    a = _prompt(31, 3 * BLOCK + 2, BASE["vocab_size"])
    b = a[:3 * BLOCK] + _prompt(32, 7, BASE["vocab_size"])[1:]
    table_a, tail = _shuffled_tables(3, -(-len(a) // BLOCK), 2)
    runner.execute([SequenceChunk(a, 0, table_a)])
    table_b = table_a[:3] + tail
    got = runner.execute([SequenceChunk(b[3 * BLOCK:], 3 * BLOCK, table_b)], all_logits=True)
    diff = _max_diff(got, _reference(hf, b)[3 * BLOCK:])
    print(f"{name}: prefix hit of {3 * BLOCK} tokens, max abs diff {diff:.2e}")
    assert diff <= ATOL


def test_bfloat16_close_to_transformers(family):
    """Against transformers in bf16 too: a MoE's routing may pick other experts in bf16 than
    in fp32 (transformers' own bf16 run differs from its fp32 one as much), so the reference
    runs in the engine's dtype; the bound is the Llama bf16 test's."""
    name, path, hf, _ = family
    tokens = _prompt(41, 19, BASE["vocab_size"])
    (table,) = _shuffled_tables(4, -(-len(tokens) // BLOCK))
    bf16 = ModelRunner(EngineConfig(model=str(path), block_size=BLOCK, num_kv_blocks=64,
                                    enforce_eager=True, dtype="bfloat16"))
    got = bf16.execute([SequenceChunk(tokens, 0, table)], all_logits=True)
    expected = _reference(copy.deepcopy(hf).to(torch.bfloat16), tokens)
    diff = (got - expected).abs().max()
    print(f"{name}: bf16 max abs diff {diff:.3f} (bound {0.1 * expected.abs().max():.3f})")
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert diff < 0.1 * expected.abs().max()


@pytest.mark.parametrize("family", ["mistral-window"], indirect=True)
def test_prompt_of_four_windows_in_chunks(family):
    name, _, hf, runner = family
    window = runner.model_config.sliding_window
    tokens = _prompt(51, 4 * window + 3, BASE["vocab_size"])
    (table,) = _shuffled_tables(5, -(-len(tokens) // BLOCK))
    steps = [runner.execute([SequenceChunk(tokens[start:start + 5], start, table)], all_logits=True)
             for start in range(0, len(tokens), 5)]
    diff = _max_diff(torch.cat(steps), _reference(hf, tokens))
    print(f"{name}: {len(tokens)}-token prompt in 5-token chunks, max abs diff {diff:.2e}")
    assert diff <= ATOL
