"""compressed-tensors checkpoints (engine.quantization.compressed_tensors), made by the
compressed-tensors library itself (tests.models.factory.compress_checkpoint: its qparams and
its compressor per format): logits equal transformers' model holding the weights the library
decompresses from the same checkpoint (fp32, within the family tests' bound), for INT8
W8A16 and W8A8, INT4 W4A16 packed with and without zero points, and FP8; dense, MoE and MLA
models. A module lacking a stored tensor, and a format not served, fail at load naming them.
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.loader import WeightLoadError
from pdcluster.engine.model_config import ModelConfig, ModelConfigError
from pdcluster.engine.runner import ModelRunner
from tests.engine.test_model_families import BLOCK, _check_prefill_then_decode
from tests.models.factory import build, compress_checkpoint

SCHEMES = {
    "w8a16-int8-channel": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}},
    "w8a8-int8": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                  "input_activations": {"num_bits": 8, "type": "int", "strategy": "token",
                                        "dynamic": True}},
    "w4a16-group": {"weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                "group_size": 16}},
    "w4a16-group-asym": {"weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                     "group_size": 16, "symmetric": False}},
    "fp8-dynamic": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                          "dynamic": True}},
}


def _runner(path) -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(path), block_size=BLOCK, num_kv_blocks=64,
                                    enforce_eager=True))


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_a_compressed_checkpoint_runs_as_its_decompressed_weights_do(scheme, tmp_path):
    hf = build("llama", tmp_path)
    reference = compress_checkpoint(hf, tmp_path, SCHEMES[scheme])
    assert ModelConfig.from_pretrained(tmp_path).quantization.name == "compressed-tensors"
    _check_prefill_then_decode(f"llama {scheme}", reference, _runner(tmp_path))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_experts_and_mla_projections_compressed(family, tmp_path):
    hf = build(family, tmp_path)
    reference = compress_checkpoint(hf, tmp_path, SCHEMES["w4a16-group"])
    _check_prefill_then_decode(f"{family} w4a16", reference, _runner(tmp_path))


@pytest.mark.parametrize("scheme", ["w4a16-group", "w8a16-int8-channel"])
def test_a_module_lacking_a_stored_tensor_fails_naming_it(scheme, tmp_path):
    """Packed, the module still stores `weight_packed`; int8, its `weight` is int8: either
    way it is known to be quantized, and its scale missing."""
    hf = build("llama", tmp_path)
    compress_checkpoint(hf, tmp_path, SCHEMES[scheme])
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight_scale"
    save_file({k: v for k, v in tensors.items() if k != name}, tmp_path / "model.safetensors")
    with pytest.raises(WeightLoadError,
                       match=r"model.layers.0.self_attn.o_proj lacks .*weight_scale"):
        _runner(tmp_path)


def test_a_format_not_served_fails_naming_it(tmp_path):
    hf = build("llama", tmp_path)
    compress_checkpoint(hf, tmp_path, SCHEMES["w4a16-group"])
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"]["format"] = "nvfp4-pack-quantized"
    raw["quantization_config"]["config_groups"]["group_0"]["format"] = "nvfp4-pack-quantized"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelConfigError, match="'nvfp4-pack-quantized' of group_0; supported"):
        ModelConfig.from_pretrained(tmp_path)
