"""ModelConfig / EngineConfig parsing, safetensors loading and RoPE frequencies vs transformers."""

from __future__ import annotations

import json
import pathlib

import pydantic
import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from engine.config import (
    BUNDLED_MODEL,
    CPU_COMPUTE_BOUND_TOKENS,
    EngineConfig,
    ModelConfig,
    ModelConfigError,
)
from engine.loader import CheckpointReader, WeightsNotFoundError
from engine.rope import compute_inv_freq

BASE = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 100,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
}


def _write_config(directory: pathlib.Path, **fields) -> pathlib.Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**BASE, **fields}))
    return directory


def test_bundled_model_config():
    config = ModelConfig.from_pretrained(BUNDLED_MODEL)
    assert BUNDLED_MODEL.is_absolute() and config.name == "stories260K"
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (5, 64, 8)
    assert (config.num_key_value_heads, config.head_dim, config.vocab_size) == (4, 8, 512)
    assert config.rope_theta == 10000.0 and config.rope_scaling is None
    assert config.tie_word_embeddings and config.bos_token_id == 1 and config.eos_token_ids == (2,)
    assert config.model_type == "llama" and not config.qkv_bias


def test_old_and_new_rope_keys_parse_identically(tmp_path):
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    scaling["original_max_position_embeddings"] = 64
    new = _write_config(tmp_path / "new", rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **scaling})
    old_type = _write_config(tmp_path / "old1", rope_theta=5e5, rope_scaling={"type": "llama3", **scaling})
    old_rope_type = _write_config(
        tmp_path / "old2", rope_theta=5e5, rope_scaling={"rope_type": "llama3", **scaling}
    )
    parsed = [ModelConfig.from_pretrained(d) for d in (new, old_type, old_rope_type)]
    assert parsed[0].rope_scaling == {"rope_type": "llama3", **scaling} and parsed[0].rope_theta == 5e5
    for other in parsed[1:]:
        assert ({**vars(other), "name": "", "hf_config": {}}
                == {**vars(parsed[0]), "name": "", "hf_config": {}})
    plain_dir = _write_config(tmp_path / "plain", rope_theta=1e6, rope_scaling=None)
    plain_old = ModelConfig.from_pretrained(plain_dir)
    assert plain_old.rope_theta == 1e6 and plain_old.rope_scaling is None


def test_defaults_eos_list_and_generation_config(tmp_path):
    directory = _write_config(tmp_path, eos_token_id=[5, 7], bos_token_id=None)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    config = ModelConfig.from_pretrained(directory)
    assert config.head_dim == 16 and config.num_key_value_heads == 4
    assert config.eos_token_ids == (5, 7, 9) and config.bos_token_id is None
    assert config.rope_theta == 10000.0 and not config.tie_word_embeddings


def test_qwen2_and_mistral_variants(tmp_path):
    qwen_dir = _write_config(tmp_path / "q", model_type="qwen2", num_key_value_heads=2)
    qwen = ModelConfig.from_pretrained(qwen_dir)
    assert qwen.qkv_bias and not qwen.o_bias and qwen.sliding_window is None
    biased = ModelConfig.from_pretrained(_write_config(tmp_path / "l", attention_bias=True, mlp_bias=True))
    assert biased.qkv_bias and biased.o_bias and biased.mlp_bias
    mistral_dir = _write_config(tmp_path / "m", model_type="mistral", sliding_window=128)
    mistral = ModelConfig.from_pretrained(mistral_dir)
    assert mistral.sliding_window == 128 and mistral.kv_window() == 128
    assert set(mistral.layer_windows) == {128}
    # the window does not cap the context: windowed attention keeps the window's keys
    assert EngineConfig().resolved_max_model_len(mistral) == mistral.max_position_embeddings
    # Qwen2: the window applies from max_window_layers on (transformers' Qwen2Config)
    layers = BASE["num_hidden_layers"]
    qwen_sw = ModelConfig.from_pretrained(_write_config(
        tmp_path / "qs", model_type="qwen2", use_sliding_window=True, sliding_window=64,
        max_window_layers=1))
    assert qwen_sw.layer_windows == (0,) + (64,) * (layers - 1) and qwen_sw.kv_window() is None
    listed = ModelConfig.from_pretrained(_write_config(
        tmp_path / "qt", model_type="qwen3", use_sliding_window=True, sliding_window=32,
        layer_types=["sliding_attention"] * layers))
    assert listed.kv_window() == 32


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"model_type": "gpt2"}, "unsupported architecture"),
        ({"architectures": ["GPT2LMHeadModel"]}, "supported: LlamaForCausalLM, "),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope type"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "unsupported rope type"),
        ({"rope_scaling": {"type": "linear"}}, "needs fields"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "multiple"),
    ],
)
def test_unsupported_configs_raise(tmp_path, fields, message):
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_pretrained(_write_config(tmp_path, **fields))


def test_missing_config_and_weights_raise(tmp_path):
    with pytest.raises(ModelConfigError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(WeightsNotFoundError, match="model.safetensors"):
        CheckpointReader(tmp_path)


def test_read_bundled_checkpoint():
    with CheckpointReader(BUNDLED_MODEL) as reader:
        names = reader.names()
        assert reader.slice("model.embed_tokens.weight")[:].shape == (512, 64)
    assert "lm_head.weight" not in names and len(names) == 2 + 5 * 9


def test_engine_config_validation():
    config = EngineConfig()
    model_config = ModelConfig.from_pretrained(BUNDLED_MODEL)
    assert config.model == str(BUNDLED_MODEL) and config.block_size == 16
    assert config.torch_dtype() is torch.float32
    assert config.resolved_max_model_len(model_config) == 512
    assert EngineConfig(max_model_len=100, dtype="bfloat16").torch_dtype() is torch.bfloat16
    assert EngineConfig(max_model_len=100).resolved_max_model_len(model_config) == 100
    with pytest.raises(ValueError, match="exceeds"):
        EngineConfig(max_model_len=513).resolved_max_model_len(model_config)
    with pytest.raises(pydantic.ValidationError):
        EngineConfig(block_size=0)
    assert config.resolved_prefill_compute_bound_tokens() == CPU_COMPUTE_BOUND_TOKENS
    assert EngineConfig(device="cuda").resolved_prefill_compute_bound_tokens() is None
    assert EngineConfig(device="cuda", prefill_compute_bound_tokens=64) \
        .resolved_prefill_compute_bound_tokens() == 64
    with pytest.raises(pydantic.ValidationError):
        EngineConfig(dtype="float64")
    with pytest.raises(pydantic.ValidationError):
        config.block_size = 8


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_inv_freq_matches_transformers(tmp_path, rope_parameters):
    hf_config = LlamaConfig(
        hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=512,
        rope_parameters=dict(rope_parameters),
    )
    hf_config.save_pretrained(tmp_path)
    rope_type = rope_parameters["rope_type"]
    init = ROPE_INIT_FUNCTIONS.get(rope_type, LlamaRotaryEmbedding.compute_default_rope_parameters)
    expected, attention_scaling = init(hf_config)
    config = ModelConfig.from_pretrained(tmp_path)
    got = compute_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    assert attention_scaling == 1.0 and got.dtype == torch.float32 and got.shape == (32,)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    if rope_type != "default":
        assert not torch.allclose(got, compute_inv_freq(config.head_dim, config.rope_theta, None))
