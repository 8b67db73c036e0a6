"""Qwen3: Llama's decoder with an RMSNorm over each head's q and k before RoPE (transformers'
Qwen3Attention: `q_norm`, `k_norm` of width head_dim, one weight shared by every head), no
q/k/v biases, and usually a head_dim other than hidden_size / num_heads.

The norm sits between the q|k|v GEMM and RoPE, so the rotation cannot be the GEMM's epilogue
as in Llama: q and k are normed, then rotated (kernels.rotary_embedding).
"""

from __future__ import annotations

import torch
from torch import nn

from pdcluster import kernels
from pdcluster.engine.model_config import ModelConfig
from pdcluster.engine.models.base import DecoderForCausalLM, RMSNorm
from pdcluster.engine.models.llama import LlamaAttention, LlamaMLP
from pdcluster.engine.parallel import TPGroup


class Qwen3Attention(LlamaAttention):
    """LlamaAttention with per-head q/k RMSNorm before RoPE."""

    def __init__(self, config: ModelConfig, tp: TPGroup, layer: int) -> None:
        super().__init__(config, tp, layer)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        positions, cos_sin_cache = rope
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, _ = self.q_norm(q.reshape(num_tokens * self.num_heads, self.head_dim))
        k, _ = self.k_norm(k.reshape(num_tokens * self.num_kv_heads, self.head_dim))
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        kernels.rotary_embedding(positions, q, k, cos_sin_cache)
        return self.attend(q, k, v.view(num_tokens, self.num_kv_heads, self.head_dim))


class Qwen3ForCausalLM(DecoderForCausalLM):
    """transformers' Qwen3ForCausalLM."""

    def build_attention(self, config: ModelConfig, tp: TPGroup, layer: int) -> nn.Module:
        return Qwen3Attention(config, tp, layer)

    def build_mlp(self, config: ModelConfig, tp: TPGroup, layer: int) -> nn.Module:
        return LlamaMLP(config, tp)
