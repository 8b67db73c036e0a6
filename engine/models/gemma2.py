"""Gemma 2: transformers' Gemma2ForCausalLM (Gemma Team 2024, "Gemma 2", §2). Gemma 3's
decoder (engine.models.gemma3: sandwich norms, (1 + w) RMSNorms, GeGLU, scaled embeddings,
`query_pre_attn_scalar`, final-logit soft-cap) without q/k norms and with one RoPE for every
layer, alternating sliding-window and global layers, and soft-capped attention scores:
s -> c * tanh(s / c) with c = `attn_logit_softcapping`. The kernels have no such step, so a
layer with it attends in torch (engine.attention.softcapped_attention).
"""

from __future__ import annotations

import torch
from torch import nn

from pdcluster.engine.attention_layer import unified_attention
from pdcluster.engine.model_config import ModelConfig
from pdcluster.engine.models.gemma3 import Gemma3DecoderLayer, Gemma3ForCausalLM
from pdcluster.engine.models.llama import LlamaAttention
from pdcluster.engine.parallel import TPGroup


class Gemma2Attention(LlamaAttention):
    """LlamaAttention with Gemma's query scale and soft-capped scores."""

    def __init__(self, config: ModelConfig, tp: TPGroup, layer: int) -> None:
        super().__init__(config, tp, layer)
        self.scale = float(config.hf_config.get("query_pre_attn_scalar", config.head_dim)) ** -0.5
        self.softcap = float(config.hf_config.get("attn_logit_softcapping") or 0.0)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = unified_attention(q, k, v, self.layer, self.scale, self.sliding_window,
                                self.softcap)
        return self.o_proj(out.reshape(q.shape[0], self.num_heads * self.head_dim))


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """transformers' Gemma2ForCausalLM (see the module docstring)."""

    def build_layer(self, config: ModelConfig, tp: TPGroup, layer: int) -> nn.Module:
        return Gemma3DecoderLayer(config, tp, Gemma2Attention(config, tp, layer))
