"""Tiny random checkpoints of every served family, built from the architecture's own
transformers config class and saved as safetensors with the bundled tokenizer, so the engine
and `pdcluster serve --model DIR` load them like any checkpoint, and transformers (the
reference, never the serving path) runs the same weights.

`FAMILIES` names each family's config and model classes and its base shape; `variant`s add
the edge cases: untied or tied embeddings, a head_dim other than hidden / heads, routing
over more experts than the batch fills.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

from engine.config import BUNDLED_MODEL

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
    #: q/k/v biases transformers initialises at zero, randomized so a missed bias shows
    random_qkv_bias: bool = False


FAMILIES: dict[str, Family] = {
    "llama": Family(transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": Family(transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                    random_qkv_bias=True),
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
}


def build(family: str, directory: Path, seed: int | None = None, **overrides) -> torch.nn.Module:
    """Save a random `family` checkpoint (BASE, the family's extras, then `overrides`) and the
    bundled tokenizer into `directory`; returns the transformers model (fp32, eval). The
    weights' seed defaults to the family's place in FAMILIES, so no two families share them."""
    spec = FAMILIES[family]
    torch.manual_seed(list(FAMILIES).index(family) if seed is None else seed)
    config = spec.config_class(**{**BASE, **spec.extra, **overrides})
    model = spec.model_class(config).eval()
    if spec.random_qkv_bias:
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
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
