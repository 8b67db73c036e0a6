"""OLMo 2 and OLMo 3: transformers' Olmo2ForCausalLM and Olmo3ForCausalLM (AI2's OLMo 2
report, §3.1). Llama's GQA, SwiGLU and RoPE with two changes:

- norms after each sublayer, none before: h += post_attn_norm(attn(h)), then
  h += post_ff_norm(mlp(h));
- q and k are RMS-normed over all their heads at once (weights of num_heads x head_dim and
  num_kv_heads x head_dim), before RoPE.

OLMo 3 adds sliding-window layers (three of every four by default) that rotate by their own,
unscaled RoPE while full layers carry the rope scaling (ModelConfig.sliding_rope). The q/k
norms span every head, so a rank would need the others' sums of squares: tensor parallel is
refused.
"""

from __future__ import annotations

import torch
from torch import nn

from pdcluster import kernels
from pdcluster.engine.model_config import ModelConfig
from pdcluster.engine.models.base import DecoderForCausalLM, RMSNorm
from pdcluster.engine.models.llama import LlamaAttention, LlamaMLP
from pdcluster.engine.parallel import TPGroup


class Olmo2Attention(LlamaAttention):
    """LlamaAttention with q and k RMS-normed over all heads before RoPE."""

    def __init__(self, config: ModelConfig, tp: TPGroup, layer: int) -> None:
        super().__init__(config, tp, layer)
        self.q_norm = RMSNorm(self.num_heads * self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        positions, cos_sin_cache = rope
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, _ = self.q_norm(q.contiguous())
        k, _ = self.k_norm(k.contiguous())
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        kernels.rotary_embedding(positions, q, k, cos_sin_cache)
        return self.attend(q, k, v.reshape(num_tokens, self.num_kv_heads, self.head_dim))


class Olmo2DecoderLayer(nn.Module):
    """The post-norm block (module docstring); the residual stream is `hidden` itself, so the
    residual DecoderForCausalLM carries stays None."""

    def __init__(self, config: ModelConfig, tp: TPGroup, layer: int) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, tp, layer)
        self.mlp = LlamaMLP(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: None,
                rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, None]:
        hidden = hidden + self.post_attention_layernorm(self.self_attn(hidden, rope))[0]
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden))[0], None


class Olmo2ForCausalLM(DecoderForCausalLM):
    """transformers' Olmo2ForCausalLM (see the module docstring)."""

    def build_layer(self, config: ModelConfig, tp: TPGroup, layer: int) -> nn.Module:
        return Olmo2DecoderLayer(config, tp, layer)

    @classmethod
    def check_tensor_parallel(cls, config: ModelConfig, tp_size: int) -> None:
        """Raises ValueError for a tensor parallel size other than 1 (module docstring)."""
        super().check_tensor_parallel(config, tp_size)
        if tp_size != 1:
            raise ValueError(f"{config.architecture}: its q/k norms span every head; tensor "
                             "parallel is not supported for it")


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """transformers' Olmo3ForCausalLM: OLMo 2's decoder with sliding-window layers that rotate
    by their own RoPE (DecoderForCausalLM.forward)."""
