"""Every served family against transformers, on its tiny random checkpoint
(tests/models/factory.py): paged logits of a chunked prefill then 32 decode steps across block
boundaries, and of a prompt that reuses another's cached prefix blocks, equal the reference's
(fp32, max abs diff <= 1e-4); bf16 logits stay within the Llama bf16 test's bound. The
sliding-window cases run prompts of several windows, in chunks, and decode past the window.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.loader import WeightLoadError
from pdcluster.engine.model_config import ModelConfig
from pdcluster.engine.models.base import check_tensor_parallel
from pdcluster.engine.runner import ModelRunner, SequenceChunk
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
    # YaRN (Qwen2.5's and Qwen3's long-context setting): the cos/sin table scaled
    "llama-yarn": ("llama", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
        "original_max_position_embeddings": 128}}),
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
    "mixtral": ("mixtral", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "deepseek_v2": ("deepseek_v2", {}),
    "deepseek_v2-q_lora": ("deepseek_v2", {"q_lora_rank": 24}),
    "deepseek_v3": ("deepseek_v3", {}),
    # the released checkpoints' YaRN: DeepSeek's mscale on the softmax scale
    "deepseek_v2-yarn": ("deepseek_v2", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "mscale": 0.707,
        "mscale_all_dim": 0.707, "original_max_position_embeddings": 128}}),
    "smollm3": ("smollm3", {}),
    "granite": ("granite", {}),
    "olmo2": ("olmo2", {}),
    # a sliding layer of 2 blocks with plain RoPE, a full one with YaRN
    "olmo3": ("olmo3", {"sliding_window": 2 * BLOCK}),
    # stacked q|k|v and gate|up; Phi-3-mini's window on every layer
    "phi3": ("phi3", {}),
    "phi3-window": ("phi3", {"sliding_window": 2 * BLOCK}),
    # soft-capped scores (torch attention), a window of 2 blocks on layer 0
    "gemma2": ("gemma2", {"sliding_window": 2 * BLOCK}),
    # the local layer's window of 2 blocks: decodes run past it
    "gemma3": ("gemma3", {"sliding_window": 2 * BLOCK}),
    # its language model in a multimodal checkpoint (the Hub's tensor names)
    "gemma3_mm": ("gemma3_mm", {"sliding_window": 2 * BLOCK}),
    "mistral3_mm": ("mistral3_mm", {}),
    "llava_mm": ("llava_mm", {}),
    "qwen2_5_vl_mm": ("qwen2_5_vl_mm", {}),
    "qwen3_vl_mm": ("qwen3_vl_mm", {}),
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


def _rewritten(path: Path, dest: Path, tensors: dict, **config) -> ModelRunner:
    """A runner over `path`'s checkpoint with `tensors` in place of its weights and `config`
    over its config.json, written to `dest`."""
    for file in path.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, dest / file.name)
    raw = json.loads((path / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**raw, **config}))
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return ModelRunner(EngineConfig(model=str(dest), block_size=BLOCK, num_kv_blocks=64,
                                    enforce_eager=True))


@pytest.mark.parametrize("family", ["gemma3_mm"], indirect=True)
def test_gemma3_multimodal_checkpoint_saved_by_transformers_4(family, tmp_path):
    """transformers 4.52 to 4.57 saved a multimodal Gemma 3 as `model.language_model.*` and
    `model.vision_tower.*` (the Hub's and transformers 5's: `language_model.model.*`): read
    as well, to the same logits."""
    name, path, hf, _ = family
    renames = (("language_model.model.", "model.language_model."),
               ("vision_tower.", "model.vision_tower."),
               ("multi_modal_projector.", "model.multi_modal_projector."))
    tensors = {}
    for old, tensor in load_file(path / "model.safetensors").items():
        new = next((old.replace(a, b, 1) for a, b in renames if old.startswith(a)), old)
        tensors[new] = tensor
    assert any(n.startswith("model.language_model.") for n in tensors)
    _check_prefill_then_decode(f"{name} (transformers 4 names)", hf,
                               _rewritten(path, tmp_path, tensors))


@pytest.mark.parametrize("family", ["deepseek_v3"], indirect=True)
def test_deepseek_v3_multi_token_prediction_layers_are_not_read(family, tmp_path):
    """V3's checkpoints carry `num_nextn_predict_layers` layers after the last one: read past,
    to the same logits; a layer the config does not declare stays an unexpected tensor."""
    name, path, hf, _ = family
    tensors = {**load_file(path / "model.safetensors"),
               "model.layers.2.eh_proj.weight": torch.zeros(4, 4)}
    with pytest.raises(WeightLoadError, match="model.layers.2.eh_proj"):
        _rewritten(path, tmp_path, tensors, num_nextn_predict_layers=0)
    assert json.loads((path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    _check_prefill_then_decode(f"{name} with an MTP layer", hf,
                               _rewritten(path, tmp_path, tensors))


@pytest.mark.parametrize("family", ["olmo2"], indirect=True)
def test_olmo_refuses_tensor_parallel(family):
    """Its q/k norms span every head: a rank's heads alone cannot be normed."""
    _, path, _, _ = family
    with pytest.raises(ValueError, match="tensor parallel is not supported"):
        check_tensor_parallel(ModelConfig.from_pretrained(path), 2)


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
