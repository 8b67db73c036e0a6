"""ModelConfig / EngineConfig parsing, safetensors loading and RoPE frequencies vs transformers."""

from __future__ import annotations

import json
import pathlib

import pydantic
import pytest
import torch
from transformers import Gemma3Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Olmo3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from pdcluster.engine.config import BUNDLED_MODEL, CPU_COMPUTE_BOUND_TOKENS, EngineConfig
from pdcluster.engine.loader import CheckpointReader, WeightsNotFoundError
from pdcluster.engine.model_config import ModelConfig, ModelConfigError
from pdcluster.engine.rope import attention_factor, compute_inv_freq

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
    mistral_dir = _write_config(tmp_path / "m", model_type="mistral", sliding_window=128,
                                num_key_value_heads=2)
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


def _assert_ropes_by_layer_type(ours: ModelConfig, theirs) -> None:
    """Our full and sliding layers' (theta, scaling) are the transformers config's
    rope_parameters of each layer type."""
    for (theta, scaling), kind in ((ours.sliding_rope, "sliding_attention"),
                                   ((ours.rope_theta, ours.rope_scaling), "full_attention")):
        expected = dict(theirs.rope_parameters[kind])
        assert theta == expected.pop("rope_theta")
        assert (scaling or {"rope_type": "default"}) == expected


@pytest.mark.parametrize("hub_fields", [
    {},  # every default: bases 1e6 / 1e4, a full layer every 6th
    {"rope_theta": 5e5, "rope_local_base_freq": 2e4, "sliding_window_pattern": 3,
     "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
])
def test_gemma3_hub_config_reads_as_transformers_reads_it(tmp_path, hub_fields):
    """The Hub's Gemma 3 configs predate `layer_types` and per-type `rope_parameters`; the
    local and global RoPE and each layer's window are what Gemma3TextConfig makes of them."""
    fields = {"model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh",
              "num_hidden_layers": 7, "sliding_window": 8, **hub_fields}
    ours = ModelConfig.from_pretrained(_write_config(tmp_path, **fields))
    theirs = Gemma3TextConfig(**{**BASE, **fields})
    _assert_ropes_by_layer_type(ours, theirs)
    assert ours.layer_windows == tuple(8 if kind == "sliding_attention" else 0
                                       for kind in theirs.layer_types)
    assert ours.architecture == "Gemma3ForCausalLM"


def test_olmo3_hub_config_reads_as_transformers_reads_it(tmp_path):
    """OLMo 3's released configs: a top-level YaRN rope_scaling for the full layers, the
    sliding ones unscaled, and a full layer every fourth when layer_types is absent."""
    fields = {"model_type": "olmo3", "num_hidden_layers": 8, "sliding_window": 4096,
              "rope_theta": 5e5, "rope_scaling": {
                  "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
                  "attention_factor": 1.2079, "beta_fast": 32, "beta_slow": 1}}
    ours = ModelConfig.from_pretrained(_write_config(tmp_path, **fields))
    theirs = Olmo3Config(**{**BASE, **fields})
    _assert_ropes_by_layer_type(ours, theirs)
    assert ours.layer_windows == tuple(4096 if kind == "sliding_attention" else 0
                                       for kind in theirs.layer_types)


def test_gemma3_multimodal_config_serves_its_text_config(tmp_path):
    """gemma-3-4b-it's config.json: its text_config lists only what differs from
    Gemma3TextConfig's defaults, the EOS ids are the top level's; every field read is what
    transformers makes of it."""
    hub = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "eos_token_id": [1, 106], "mm_tokens_per_image": 256,
           "text_config": {"model_type": "gemma3_text", "hidden_size": 2560,
                           "intermediate_size": 10240, "num_hidden_layers": 34,
                           "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152,
                             "image_size": 896, "patch_size": 14}}
    (tmp_path / "config.json").write_text(json.dumps(hub))
    ours = ModelConfig.from_pretrained(tmp_path)
    theirs = Gemma3Config(**hub).text_config
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim",
                 "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                 "bos_token_id"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.hf_config["query_pre_attn_scalar"] == theirs.query_pre_attn_scalar
    assert (ours.rope_theta, ours.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert ours.sliding_rope == (1e4, None)
    assert ours.layer_windows == tuple(1024 if kind == "sliding_attention" else 0
                                       for kind in theirs.layer_types)
    assert ours.eos_token_ids == (1, 106)
    assert (ours.architecture, ours.model_type) == ("Gemma3ForConditionalGeneration",
                                                    "gemma3_text")


def test_qwen2_5_vl_hub_config_reads_as_qwen2_with_rope(tmp_path):
    """Qwen2.5-VL's config.json keeps the text fields at the top and names its rope "mrope",
    which on text is RoPE (tests/engine/test_model_families.py checks the logits)."""
    ours = ModelConfig.from_pretrained(_write_config(
        tmp_path, architectures=["Qwen2_5_VLForConditionalGeneration"], model_type="qwen2_5_vl",
        num_key_value_heads=2, rope_theta=1e6, vision_config={"depth": 32},
        rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}))
    assert (ours.rope_theta, ours.rope_scaling) == (1e6, None)
    assert ours.qkv_bias and not ours.o_bias
    assert ours.architecture == "Qwen2_5_VLForConditionalGeneration"


@pytest.mark.parametrize(("model_type", "config_class"), [
    ("gemma3_text", Gemma3TextConfig), ("llama", LlamaConfig), ("mistral", MistralConfig)])
def test_a_field_left_out_takes_transformers_default(tmp_path, model_type, config_class):
    """A config.json of its model type alone reads as the config class's defaults (the Hub's
    vision-language checkpoints leave most of their text_config out)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    ours, theirs = ModelConfig.from_pretrained(tmp_path), config_class()
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim",
                 "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                 "bos_token_id"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.eos_token_ids == (theirs.eos_token_id,)
    types = getattr(theirs, "layer_types", None) or ["sliding_attention"] * ours.num_hidden_layers
    window = getattr(theirs, "sliding_window", None) or 0
    assert ours.layer_windows == tuple(window if kind == "sliding_attention" else 0
                                       for kind in types)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"model_type": "gpt2"}, "unsupported architecture"),
        ({"architectures": ["GPT2LMHeadModel"]}, "supported: LlamaForCausalLM, "),
        ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0}}, "unsupported rope type"),
        ({"rope_parameters": {"rope_type": "yarn"}}, "needs fields"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "unsupported rope type"),
        ({"rope_scaling": {"type": "linear"}}, "needs fields"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}},
         "'gptq' is not supported; supported: compressed-tensors, fp8"),
        ({"model_type": "gemma3_text", "hidden_activation": "silu"}, "hidden_activation"),
        ({"model_type": "gemma3_text", "sliding_window": None}, "sliding_window"),
        ({"model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh",
          "sliding_window": 8, "use_bidirectional_attention": True}, "causal"),
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
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
         "original_max_position_embeddings": 128},
        {"rope_type": "yarn", "rope_theta": 1e6, "factor": 40.0, "beta_fast": 16,
         "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 0.707,
         "original_max_position_embeddings": 64, "truncate": False},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "attention_factor": 1.5,
         "original_max_position_embeddings": 64},
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
    assert attention_factor(config.rope_scaling) == pytest.approx(attention_scaling, rel=1e-12)
    assert got.dtype == torch.float32 and got.shape == (32,)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    if rope_type != "default":
        assert not torch.allclose(got, compute_inv_freq(config.head_dim, config.rope_theta, None))
