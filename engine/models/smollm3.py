"""SmolLM3: transformers' SmolLM3ForCausalLM, Llama's decoder with no position encoding in some
layers (NoPE; Hugging Face's SmolLM3 report): `no_rope_layers[i]` is 1 where layer i rotates q
and k, 0 where it does not (by default every `no_rope_layer_interval`-th layer), as
transformers reads them. A NoPE layer's q|k|v GEMM has no RoPE epilogue; the C++ decode stack,
which rotates every layer, does not run this family.
"""

from __future__ import annotations

import torch
from torch import nn

from pdcluster.engine.model_config import ModelConfig
from pdcluster.engine.models.llama import LlamaAttention, LlamaForCausalLM
from pdcluster.engine.parallel import TPGroup


def uses_rope(config: ModelConfig, layer: int) -> bool:
    """Whether layer `layer` rotates q and k (transformers' SmolLM3Config.no_rope_layers)."""
    flags = config.hf_config.get("no_rope_layers")
    if flags is None:
        interval = int(config.hf_config.get("no_rope_layer_interval", 4))
        return (layer + 1) % interval != 0
    return bool(flags[layer])


class SmolLM3Attention(LlamaAttention):
    """LlamaAttention, without RoPE in a NoPE layer."""

    def __init__(self, config: ModelConfig, tp: TPGroup, layer: int) -> None:
        super().__init__(config, tp, layer)
        self.use_rope = uses_rope(config, layer)

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        if self.use_rope:
            return super().forward(hidden, rope)
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        return self.attend(q.view(num_tokens, self.num_heads, self.head_dim),
                           k.view(num_tokens, self.num_kv_heads, self.head_dim),
                           v.view(num_tokens, self.num_kv_heads, self.head_dim))


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """transformers' SmolLM3ForCausalLM (see the module docstring)."""

    runs_cpu_decode_stack = False

    def build_attention(self, config: ModelConfig, tp: TPGroup, layer: int) -> nn.Module:
        return SmolLM3Attention(config, tp, layer)
