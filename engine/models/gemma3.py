"""Gemma 3, text only: transformers' Gemma3ForCausalLM (gemma-3-1b; the language model of the
multimodal checkpoints, gemma-3-4b and up, is engine.models.multimodal_text's). Llama's attention and paged cache, with what the Gemma 3 report
(Gemma Team 2025, §2) and transformers' modeling_gemma3 change:

- every RMSNorm scales by (1 + weight), in float32, then casts back (`GemmaRMSNorm`);
- a "sandwich" block: the attention's and the MLP's outputs are normed again before each joins
  the residual stream (`post_attention_layernorm`, `post_feedforward_layernorm`), and the MLP's
  input has its own norm (`pre_feedforward_layernorm`);
- q and k are RMS-normed per head before RoPE (Qwen3's attention), and attention scales by
  `query_pre_attn_scalar ** -0.5` instead of head_dim's;
- GeGLU: down(gelu_tanh(gate(x)) * up(x));
- embeddings are multiplied by sqrt(hidden_size), rounded to the model's dtype;
- local (sliding-window) layers rotate with their own base and no scaling
  (`ModelConfig.sliding_rope`, DecoderForCausalLM.forward), global layers with `rope_theta`
  and the rope scaling;
- `final_logit_softcapping`, where set: logits = cap * tanh(logits / cap).

The activation and the extra norms run as torch ops (no fused epilogue), on every device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.engine.model_config import ModelConfig
from pdcluster.engine.models.base import DecoderForCausalLM
from pdcluster.engine.models.llama import GATE_UP_SOURCES
from pdcluster.engine.models.qwen3 import Qwen3Attention
from pdcluster.engine.parallel import MergedColumnParallelLinear, RowParallelLinear, TPGroup


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaling by (1 + weight), computed in float32 and cast back to x's dtype
    (transformers' Gemma3RMSNorm; the checkpoint stores weight - 1), with RMSNorm's residual
    interface: x [..., dim] (+ residual) -> (out, x + residual, or x)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype), x


class Gemma3Attention(Qwen3Attention):
    """Qwen3's attention (per-head q/k norms before RoPE) with Gemma's norms and query
    scale."""

    def __init__(self, config: ModelConfig, tp: TPGroup, layer: int) -> None:
        super().__init__(config, tp, layer)
        self.scale = float(config.hf_config.get("query_pre_attn_scalar", config.head_dim)) ** -0.5
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)


class Gemma3MLP(nn.Module):
    """GeGLU MLP: down(gelu_tanh(gate(x)) * up(x)) (transformers' `gelu_pytorch_tanh`)."""

    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden, (inter, inter), False, tp,
                                                       GATE_UP_SOURCES)
        self.down_proj = RowParallelLinear(inter, hidden, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    """The sandwich block, h += post_attn_norm(attn(input_norm(h))) then
    h += post_ff_norm(mlp(pre_ff_norm(h))), with the residual stream carried as in
    DecoderLayer: each add is the next norm's fused residual."""

    def __init__(self, config: ModelConfig, tp: TPGroup, self_attn: nn.Module) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = self_attn
        self.mlp = Gemma3MLP(config, tp)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden, _ = self.post_attention_layernorm(self.self_attn(hidden, rope))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden, _ = self.post_feedforward_layernorm(self.mlp(hidden))
        return hidden, residual


class Gemma3ForCausalLM(DecoderForCausalLM):
    """transformers' Gemma3ForCausalLM (see the module docstring)."""

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__(config, tp)
        self.model.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        #: sqrt(hidden_size) as transformers rounds it: to the weights' dtype
        self.embed_scale = {
            dtype: torch.tensor(config.hidden_size**0.5, device="cpu").to(dtype).item()
            for dtype in (torch.float32, torch.bfloat16, torch.float16)}
        self.final_logit_softcapping = config.hf_config.get("final_logit_softcapping")

    def build_layer(self, config: ModelConfig, tp: TPGroup, layer: int) -> nn.Module:
        return Gemma3DecoderLayer(config, tp, Gemma3Attention(config, tp, layer))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        return hidden * self.embed_scale[hidden.dtype]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap
