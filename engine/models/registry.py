"""Which module serves which checkpoint: `config.json`'s `architectures` entry -> the model
class, as vLLM's model registry maps it. Importing this module imports no torch, so the
gateway can check a model directory before any worker starts; `model_class` imports the
family's module on first use.
"""

from __future__ import annotations

import importlib

#: HF architecture name -> (module under engine.models, class). Families that differ from
#: Llama in config only (biases, head_dim, untied embeddings) share its module.
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "SmolLM3ForCausalLM": ("smollm3", "SmolLM3ForCausalLM"),
    "GraniteForCausalLM": ("granite", "GraniteForCausalLM"),
    "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "Olmo3ForCausalLM": ("olmo2", "Olmo3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    # vision-language checkpoints' language models, as text (the vision tower is not read)
    "Gemma3ForConditionalGeneration": ("multimodal_text", "Gemma3ForConditionalGeneration"),
    "Mistral3ForConditionalGeneration": ("multimodal_text", "Mistral3ForConditionalGeneration"),
    "LlavaForConditionalGeneration": ("multimodal_text", "LlavaForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("multimodal_text",
                                           "Qwen2_5_VLForConditionalGeneration"),
    "Qwen3VLForConditionalGeneration": ("multimodal_text", "Qwen3VLForConditionalGeneration"),
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCHITECTURES)


class UnsupportedArchitectureError(ValueError):
    """A checkpoint names no architecture this engine serves."""


def resolve_architecture(architectures: object) -> str:
    """The first of a config.json's `architectures` list that is served.

    Raises UnsupportedArchitectureError, naming the supported ones, when none is (or the
    field is missing or not a list of names)."""
    names = architectures if isinstance(architectures, list) else []
    for name in names:
        if name in ARCHITECTURES:
            return name
    raise UnsupportedArchitectureError(
        f"unsupported architecture {architectures!r}; supported: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def model_class(architecture: str) -> type:
    """The nn.Module class serving `architecture` (imports its module).
    Raises UnsupportedArchitectureError for one not in ARCHITECTURES."""
    if architecture not in ARCHITECTURES:
        resolve_architecture([architecture])
    module, name = ARCHITECTURES[architecture]
    return getattr(importlib.import_module(f"pdcluster.engine.models.{module}"), name)
