"""Tiny random checkpoints of every served family, built from the architecture's own
transformers config class and saved as safetensors with the bundled tokenizer, so the engine
and `pdcluster serve --model DIR` load them like any checkpoint, and transformers (the
reference, never the serving path) runs the same weights.

`FAMILIES` names each family's config and model classes and its base shape; `variant`s add
the edge cases: untied or tied embeddings, a head_dim other than hidden / heads, routing
over more experts than the batch fills.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers

from pdcluster.engine.config import BUNDLED_MODEL

#: shared by every family; the bundled tokenizer's 512 ids
BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "generation_config.json")


@dataclass(frozen=True)
class Family:
    config_class: type
    model_class: type
    extra: dict = field(default_factory=dict)
    #: name endings of tensors transformers initialises at zero or alike (biases, norms,
    #: routing biases), drawn from N(0, 0.2) so a missed or swapped one shows
    randomized: tuple[str, ...] = ()


FAMILIES: dict[str, Family] = {
    "llama": Family(transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": Family(transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                    randomized=("q_proj.bias", "k_proj.bias", "v_proj.bias")),
    "mistral": Family(transformers.MistralConfig, transformers.MistralForCausalLM,
                      {"sliding_window": None, "head_dim": 16}),
    # head_dim 24 != 64 / 4, as Qwen3's 128 != hidden / heads
    "qwen3": Family(transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 24}),
    "mixtral": Family(transformers.MixtralConfig, transformers.MixtralForCausalLM,
                      {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None,
                       "head_dim": 16}),
    # 8 experts, top 2, normalized; layer 1 dense (mlp_only_layers)
    "qwen3_moe": Family(transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                        {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                         "norm_topk_prob": True, "mlp_only_layers": [1], "head_dim": 16}),
    # MLA (latent 32 + rope 8) and DeepSeekMoE: layer 0 dense, then 8 routed experts in 4
    # groups (top 2 from the best 2 groups) and a shared one
    "deepseek_v2": Family(transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM,
                          {"num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": None,
                           "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
                           "n_routed_experts": 8, "num_experts_per_tok": 2,
                           "n_shared_experts": 1, "moe_intermediate_size": 32,
                           "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2,
                           "topk_method": "group_limited_greedy",
                           "routed_scaling_factor": 1.5}),
    # V3's router: sigmoid affinities, a correction bias for the choice, groups ranked by
    # their two best; 8 experts in 4 groups (top 2 from the best 2), normalized, scaled
    "deepseek_v3": Family(transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
                          {"num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 24,
                           "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
                           "n_routed_experts": 8, "num_experts_per_tok": 2,
                           "n_shared_experts": 1, "moe_intermediate_size": 32,
                           "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2,
                           "norm_topk_prob": True, "routed_scaling_factor": 2.5},
                          randomized=("e_score_correction_bias",)),
    # q|k|v and gate|up stacked in the checkpoint
    "phi3": Family(transformers.Phi3Config, transformers.Phi3ForCausalLM, {"pad_token_id": 0}),
    # layer 1 without RoPE (NoPE)
    "smollm3": Family(transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM,
                      {"no_rope_layer_interval": 2, "pad_token_id": 0}),
    # every multiplier away from 1 (Granite 3's are of these sizes)
    "granite": Family(transformers.GraniteConfig, transformers.GraniteForCausalLM,
                      {"embedding_multiplier": 12.0, "attention_multiplier": 0.0078125,
                       "residual_multiplier": 0.22, "logits_scaling": 8.0, "pad_token_id": 0}),
    # post-norms, q/k norms over all heads
    "olmo2": Family(transformers.Olmo2Config, transformers.Olmo2ForCausalLM,
                    {"pad_token_id": 0}, randomized=("norm.weight",)),
    # a sliding layer with plain RoPE, then a full one with YaRN
    "olmo3": Family(transformers.Olmo3Config, transformers.Olmo3ForCausalLM,
                    {"pad_token_id": 0, "sliding_window": 16,
                     "layer_types": ["sliding_attention", "full_attention"],
                     "rope_parameters": {
                         "sliding_attention": {"rope_type": "default", "rope_theta": 5e5},
                         "full_attention": {"rope_type": "yarn", "rope_theta": 5e5,
                                            "factor": 4.0,
                                            "original_max_position_embeddings": 128}}},
                    randomized=("norm.weight",)),
    # a sliding layer then a global one, soft-capped scores and logits
    "gemma2": Family(transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
                     {"head_dim": 24, "query_pre_attn_scalar": 20, "sliding_window": 16,
                      "attn_logit_softcapping": 2.0, "final_logit_softcapping": 8.0,
                      "tie_word_embeddings": True, "pad_token_id": 0},
                     randomized=("norm.weight",)),
    # a local layer then a global one, each with its own RoPE (base 1e4; 1e6 scaled by 2), a
    # query scale other than head_dim's, tied embeddings and soft-capped logits
    "gemma3": Family(transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
                     {"head_dim": 24, "query_pre_attn_scalar": 20, "sliding_window": 16,
                      "layer_types": ["sliding_attention", "full_attention"],
                      "rope_parameters": {
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                          "full_attention": {"rope_type": "linear", "factor": 2.0,
                                             "rope_theta": 1e6}},
                      "final_logit_softcapping": 8.0, "tie_word_embeddings": True,
                      "pad_token_id": 0},
                     randomized=("norm.weight",)),
}
#: gemma-3-4b and up: Gemma 3's decoder inside a multimodal checkpoint, with a vision tower of
#: one tiny SigLIP layer the server does not read; no logit soft-capping, as in every Gemma 3
#: checkpoint (transformers' multimodal class would skip it)
FAMILIES["gemma3_mm"] = Family(
    lambda **text: transformers.Gemma3Config(
        text_config=text, mm_tokens_per_image=4,
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "image_size": 28, "patch_size": 14}),
    transformers.Gemma3ForConditionalGeneration,
    {**FAMILIES["gemma3"].extra, "final_logit_softcapping": None}, randomized=("norm.weight",))
#: Mistral Small 3.x and LLaVA: a Mistral or Llama decoder in a vision-language checkpoint,
#: with one tiny vision layer (Pixtral's, CLIP's) the server does not read
_TINY_VISION = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
FAMILIES["mistral3_mm"] = Family(
    lambda **text: transformers.Mistral3Config(
        text_config={**text, "model_type": "mistral"},
        vision_config={**_TINY_VISION, "head_dim": 8}),
    transformers.Mistral3ForConditionalGeneration, FAMILIES["mistral"].extra)
FAMILIES["llava_mm"] = Family(
    lambda **text: transformers.LlavaConfig(text_config={**text, "model_type": "llama"},
                                            vision_config=dict(_TINY_VISION)),
    transformers.LlavaForConditionalGeneration)
#: Qwen2.5-VL and Qwen3-VL: Qwen2's and Qwen3's decoders with multimodal RoPE, which on text
#: (the same position on its three axes) is RoPE
_TINY_QWEN_VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                     "patch_size": 14, "out_hidden_size": 64}
FAMILIES["qwen2_5_vl_mm"] = Family(
    lambda **text: transformers.Qwen2_5_VLConfig(
        text_config={**text, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                 "mrope_section": [2, 3, 3]}},
        vision_config=dict(_TINY_QWEN_VISION)),
    transformers.Qwen2_5_VLForConditionalGeneration,
    randomized=("q_proj.bias", "k_proj.bias", "v_proj.bias"))
FAMILIES["qwen3_vl_mm"] = Family(
    lambda **text: transformers.Qwen3VLConfig(
        text_config={**text, "head_dim": 16,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                         "mrope_section": [2, 3, 3], "mrope_interleaved": True}},
        vision_config={**_TINY_QWEN_VISION, "num_position_embeddings": 16,
                       "deepstack_visual_indexes": []}),
    transformers.Qwen3VLForConditionalGeneration)


def build(family: str, directory: Path, seed: int | None = None, **overrides) -> torch.nn.Module:
    """Save a random `family` checkpoint (BASE, the family's extras, then `overrides`) and the
    bundled tokenizer into `directory`; returns the transformers model (fp32, eval). The
    weights' seed defaults to the family's place in FAMILIES, so no two families share them."""
    spec = FAMILIES[family]
    torch.manual_seed(list(FAMILIES).index(family) if seed is None else seed)
    config = spec.config_class(**{**BASE, **spec.extra, **overrides})
    model = spec.model_class(config).eval()
    with torch.no_grad():
        for name, tensor in (*model.named_parameters(), *model.named_buffers()):
            if spec.randomized and name.endswith(spec.randomized):
                tensor.normal_(0, 0.2)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        if (BUNDLED_MODEL / name).exists() and not (directory / name).exists():
            shutil.copy(BUNDLED_MODEL / name, directory / name)
    return model


def reference_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of `prompt`, `n` tokens, EOS ignored: each token the
    argmax of a full forward over the sequence so far."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def build_lora(hf: torch.nn.Module, directory: Path, targets: tuple[str, ...], rank: int,
               seed: int, use_rslora: bool = False) -> torch.nn.Module:
    """Save a random PEFT LoRA adapter of `hf` (rank `rank`, alpha 2 × rank, on the modules
    named `targets`) into `directory`; returns the adapted transformers model (eval), the
    reference for the adapter. B is random too (PEFT initialises it at zero)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                        init_lora_weights=False, use_rslora=use_rslora)
    adapted = get_peft_model(copy.deepcopy(hf), config)
    adapted.save_pretrained(directory)
    return adapted.eval()


#: the linear weights a Hugging Face FP8 checkpoint quantizes (its layers' projections; the
#: embeddings, norms, routers and lm_head stay in full precision)
FP8_WEIGHTS = ("_proj.weight", "_proj_with_mqa.weight")


def quantize_fp8(directory: Path, block: tuple[int, int] | None = (16, 16)) -> torch.nn.Module:
    """Rewrite `directory`'s checkpoint (from `build`) as a Hugging Face fine-grained FP8 one,
    quantized by transformers' own quantizing op (`Fp8Quantize`, e4m3 with a float32
    `weight_scale_inv` per `block`; None: one scale per tensor); a weight `block` does not
    tile stays unquantized, as transformers leaves it. Returns transformers' model loaded from
    the result (fp32, eval): on a CPU it dequantizes every weight by its scale, the
    reference for the checkpoint."""
    from safetensors.torch import load_file, save_file
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    config = FineGrainedFP8Config(weight_block_size=list(block) if block else None)
    quantize = Fp8Quantize(SimpleNamespace(quantization_config=config))
    tensors = {}
    for name, tensor in load_file(directory / "model.safetensors").items():
        if name.endswith(FP8_WEIGHTS) and tensor.dim() == 2:
            tensors.update(quantize.convert({name: tensor}))
        else:
            tensors[name] = tensor
    assert any(t.dtype == torch.float8_e4m3fn for t in tensors.values())
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((directory / "config.json").read_text())
    raw["quantization_config"] = json.loads(config.to_json_string())
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return model.eval()


def compress_checkpoint(hf: torch.nn.Module, directory: Path, scheme: dict) -> torch.nn.Module:
    """Rewrite `directory`'s checkpoint (from `build`) as a compressed-tensors one, quantized
    and compressed by the compressed-tensors library as llm-compressor drives it: for each
    projection weight, min / max per the scheme's strategy (tensor, channel or group), the
    library's `calculate_qparams` for scale and zero point, its compressor for the scheme's
    format. `scheme`: the library's QuantizationScheme fields (targets ["Linear"]), e.g.
    `{"weights": {"num_bits": 4, "strategy": "group", "group_size": 16}}`. Returns
    transformers' model (fp32, eval) of `hf`'s config (the model `build` returned) holding
    the weights the library decompresses from the result, loaded from a sibling directory:
    the reference for the checkpoint."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file, save_file

    parsed = QuantizationScheme.model_validate({"targets": ["Linear"], **scheme})
    parsed.format = infer_module_format(torch.nn.Linear, parsed)
    compressor = BaseCompressor.get_value_from_registry(parsed.format)
    args = parsed.weights
    tensors, dense = {}, {}
    for name, tensor in load_file(directory / "model.safetensors").items():
        if not (name.endswith(FP8_WEIGHTS) and tensor.dim() == 2):
            tensors[name] = dense[name] = tensor
            continue
        if args.strategy == "group":
            grouped = tensor.reshape(tensor.shape[0], -1, args.group_size)
            low, high = grouped.amin(-1), grouped.amax(-1)
        elif args.strategy == "channel":
            low, high = tensor.amin(1, keepdim=True), tensor.amax(1, keepdim=True)
        else:
            low, high = tensor.min().reshape(1), tensor.max().reshape(1)
        scale, zero_point = calculate_qparams(low, high, args)
        state = {"weight": tensor, "weight_scale": scale, "weight_zero_point": zero_point}
        stored = compressor.compress(state, parsed)
        module = name.rsplit(".", 1)[0]
        tensors.update({f"{module}.{k}": v.contiguous() for k, v in stored.items()})
        dense[name] = compressor.decompress(dict(stored), parsed)["weight"].to(torch.float32)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = QuantizationConfig(config_groups={"group_0": parsed}, format=parsed.format,
                                quantization_status="compressed", ignore=["lm_head"])
    raw = json.loads((directory / "config.json").read_text())
    raw["quantization_config"] = json.loads(config.model_dump_json(exclude_none=True))
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    # transformers loads the decompressed weights from a checkpoint of its own, converting
    # the per-expert tensors to its fused experts as it loads any checkpoint
    reference = directory.parent / f"{directory.name}-decompressed"
    hf.save_pretrained(reference)
    save_file(dense, reference / "model.safetensors", metadata={"format": "pt"})
    model = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    return model.eval()
