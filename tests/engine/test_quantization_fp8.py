"""FP8 checkpoints (engine.quantization.fp8) against the format's own tools: weights quantized
by transformers' `Fp8Quantize` read back as transformers' `Fp8Dequantize` reads them, whole
and as a tensor-parallel rank's rows or columns; whole models' logits equal transformers'
model loaded from the same FP8 checkpoint (which dequantizes on a CPU), fp32, within the
family tests' bound; a checkpoint that lacks or misshapes a scale, a format or scheme not
served, and a `--quantization` that does not match fail at load, naming what is wrong.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.loader import CheckpointReader, WeightLoadError
from pdcluster.engine.model_config import ModelConfig, ModelConfigError
from pdcluster.engine.quantization import UnsupportedQuantizationError
from pdcluster.engine.quantization.fp8 import Fp8Config
from pdcluster.engine.runner import ModelRunner
from tests.engine.test_model_families import BLOCK, _check_prefill_then_decode
from tests.models.factory import build, quantize_fp8


def _transformers_ops(block):
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize

    hf = SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=block))
    return Fp8Quantize(hf), Fp8Dequantize(hf)


@pytest.mark.parametrize("block", [[32, 32], [16, 64], None], ids=["32x32", "16x64", "tensor"])
def test_a_widened_weight_is_transformers_dequantized_one_whole_and_in_shards(tmp_path, block):
    quantize, dequantize = _transformers_ops(block)
    torch.manual_seed(0)
    weight = torch.randn(96, 128) * torch.logspace(-2, 1, 128)  # scales differ by block
    tensors = quantize.convert({"w.weight": weight})
    expected = dequantize._dequantize_one(tensors["w.weight"], tensors["w.weight_scale_inv"],
                                          torch.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    with CheckpointReader(tmp_path) as reader:
        fp8 = Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": block})
        source = fp8.checkpoint_source(reader)
        assert source.names() == ["w.weight"]
        loaded = source.slice("w.weight")
        assert loaded.get_shape() == [96, 128]
        torch.testing.assert_close(loaded[:], expected, rtol=0, atol=0)
        torch.testing.assert_close(loaded[40:56], expected[40:56], rtol=0, atol=0)
        torch.testing.assert_close(loaded[:, 48:112], expected[:, 48:112], rtol=0, atol=0)
    assert (expected - weight).abs().max() > 0  # it was quantized


def test_per_channel_weight_scale_as_vllm_serializes_it(tmp_path):
    """vLLM's serialized FP8 (AutoFP8): `weight_scale` per output channel; w = q * scale."""
    torch.manual_seed(1)
    q = (torch.randn(24, 40) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(24, 1) + 0.1
    save_file({"w.weight": q, "w.weight_scale": scale, "w.input_scale": torch.ones(1)},
              tmp_path / "model.safetensors")
    with CheckpointReader(tmp_path) as reader:
        source = Fp8Config.from_config({"quant_method": "fp8"}).checkpoint_source(reader)
        assert source.names() == ["w.weight"]
        torch.testing.assert_close(source.slice("w.weight")[:], q.float() * scale,
                                   rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v2"])
def test_an_fp8_checkpoint_runs_as_transformers_runs_it(family, tmp_path):
    """Dense, MoE experts and MLA's projections quantized; a 16 x 16 block tiles every
    projection of the tiny models but for what transformers leaves in full precision."""
    build(family, tmp_path)
    reference = quantize_fp8(tmp_path, (16, 16))
    runner = ModelRunner(EngineConfig(model=str(tmp_path), block_size=BLOCK, num_kv_blocks=64,
                                      enforce_eager=True))
    assert ModelConfig.from_pretrained(tmp_path).quantization.name == "fp8"
    _check_prefill_then_decode(f"{family} fp8", reference, runner)


def _fp8_llama(tmp_path):
    build("llama", tmp_path)
    quantize_fp8(tmp_path, (16, 16))
    return load_file(tmp_path / "model.safetensors")


def _runner(path, **engine):
    return ModelRunner(EngineConfig(model=str(path), block_size=BLOCK, num_kv_blocks=16,
                                    enforce_eager=True, **engine))


def test_a_missing_or_misshapen_scale_fails_naming_the_weight(tmp_path):
    tensors = _fp8_llama(tmp_path)
    name = "model.layers.1.mlp.down_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != name + "_scale_inv"},
              tmp_path / "model.safetensors")
    with pytest.raises(WeightLoadError, match=f"{name} has no scale"):
        _runner(tmp_path)
    save_file({**tensors, name + "_scale_inv": torch.ones(3, 5)}, tmp_path / "model.safetensors")
    with pytest.raises(WeightLoadError, match=rf"{name} .*scale shape \(3, 5\)"):
        _runner(tmp_path)


def test_formats_and_schemes_not_served_fail_naming_them_and_the_supported(tmp_path):
    build("llama", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    for quantization, message in (
            ({"quant_method": "awq", "bits": 4},
             r"'awq' is not supported; supported: compressed-tensors, fp8"),
            ({"quant_method": "fp8", "fmt": "e5m2"}, r"fmt 'e5m2'; supported: e4m3"),
            ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
            ({"quant_method": "fp8", "activation_scheme": "tensor"}, "activation_scheme")):
        (tmp_path / "config.json").write_text(json.dumps({**raw, "quantization_config":
                                                          quantization}))
        with pytest.raises(ModelConfigError, match=message):
            ModelConfig.from_pretrained(tmp_path)


def test_quantization_flag_must_match_the_checkpoint(tmp_path):
    plain = tmp_path / "plain"
    build("llama", plain)
    with pytest.raises(UnsupportedQuantizationError, match="no quantization_config"):
        _runner(plain, quantization="fp8")
    with pytest.raises(UnsupportedQuantizationError, match=r"'gptq' is not supported"):
        _runner(plain, quantization="gptq")
    fp8 = tmp_path / "fp8"
    _fp8_llama(fp8)
    _runner(fp8, quantization="fp8")  # the checkpoint's own method
