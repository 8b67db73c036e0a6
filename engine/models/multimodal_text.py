"""The language model of a vision-language checkpoint, served as text: the decoder is a family
module of its own (Gemma 3's; Llama's for Mistral 3, LLaVA and Qwen2.5-VL; Qwen3's for
Qwen3-VL), read from the checkpoint's `text_config` (engine.model_config) and from its
language-model tensors; the vision tower and the projector are never read, so a request is
text only (an image part is refused by the API).

Tensor names: the Hub's checkpoints hold the decoder as `language_model.model.*` and
`language_model.lm_head.*` (Qwen2.5-VL: `model.*` beside `visual.*`), transformers 4.52 and
later save it as `model.language_model.*` beside a top-level `lm_head.*` (transformers'
"llava" and "qwen2_vl" conversion mappings).

The Qwen-VL decoders rotate by multimodal RoPE (three position axes, each over its section
of the frequencies); a text token has the same position on all three, which is RoPE.
"""

from __future__ import annotations

from pdcluster.engine.models.gemma3 import Gemma3ForCausalLM
from pdcluster.engine.models.llama import LlamaForCausalLM
from pdcluster.engine.models.qwen3 import Qwen3ForCausalLM


class TextOfVisionLanguage:
    """Mixed in before a family's class: the decoder's tensors under either naming, the
    vision tower's and projector's not read."""

    checkpoint_renames = {"model.language_model.": "model.", "language_model.model.": "model.",
                          "language_model.lm_head.": "lm_head."}
    checkpoint_ignored = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                          "model.multi_modal_projector.", "visual.", "model.visual.")


class Gemma3ForConditionalGeneration(TextOfVisionLanguage, Gemma3ForCausalLM):
    """transformers' Gemma3ForConditionalGeneration (gemma-3-4b and up) as text."""


class Mistral3ForConditionalGeneration(TextOfVisionLanguage, LlamaForCausalLM):
    """transformers' Mistral3ForConditionalGeneration (Mistral Small 3.1 and 3.2) as text:
    its decoder is Mistral's."""


class LlavaForConditionalGeneration(TextOfVisionLanguage, LlamaForCausalLM):
    """transformers' LlavaForConditionalGeneration over a Llama or Mistral decoder (LLaVA 1.5,
    Pixtral) as text."""


class Qwen2_5_VLForConditionalGeneration(TextOfVisionLanguage, LlamaForCausalLM):
    """transformers' Qwen2_5_VLForConditionalGeneration as text: Qwen2's decoder."""


class Qwen3VLForConditionalGeneration(TextOfVisionLanguage, Qwen3ForCausalLM):
    """transformers' Qwen3VLForConditionalGeneration as text: Qwen3's decoder (the deepstack
    visual inputs of its first layers only come with an image)."""
