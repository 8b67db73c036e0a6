"""Llama-family architectures that differ from Llama in config only, against transformers: a
tiny random Qwen2 (biases on q, k and v) and a tiny random Mistral (no sliding window within
these lengths), each saved as safetensors and loaded by the engine like any checkpoint. Paged
logits of a chunked prefill and of decode steps across block boundaries equal the reference's
(fp32, max abs diff <= 1e-4)."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine.config import EngineConfig
from engine.runner import ModelRunner, SequenceChunk
from tests.engine.test_paged_logits import ATOL, _max_diff, _prompt, _shuffled_tables

BLOCK = 4
SHAPE = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)

FAMILIES = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                {"sliding_window": None, "head_dim": 16}),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    config_cls, model_cls, extra = FAMILIES[request.param]
    torch.manual_seed(0)
    model = model_cls(config_cls(**SHAPE, **extra)).eval()
    if request.param == "qwen2":  # random biases: transformers initialises them at zero
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    runner = ModelRunner(EngineConfig(model=str(path), block_size=BLOCK, num_kv_blocks=64,
                                      enforce_eager=True))
    return model, runner


def test_chunked_prefill_then_decode_matches_transformers(family):
    hf, runner = family
    tokens = _prompt(11, 13, SHAPE["vocab_size"])
    num_decodes = 2 * BLOCK + 3
    (table,) = _shuffled_tables(1, -(-(len(tokens) + num_decodes) // BLOCK))
    steps = [runner.execute([SequenceChunk(tokens[:6], 0, table)], all_logits=True),
             runner.execute([SequenceChunk(tokens[6:], 6, table)], all_logits=True)]
    for _ in range(num_decodes):
        tokens.append(int(steps[-1][-1].argmax()))
        steps.append(runner.execute([SequenceChunk(tokens[-1:], len(tokens) - 1, table)]))
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0].float()
    diff = _max_diff(torch.cat(steps), expected)
    print(f"{type(hf).__name__}: prefill + {num_decodes} decodes, max abs diff {diff:.2e}")
    assert diff <= ATOL
