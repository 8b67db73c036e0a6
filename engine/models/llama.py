"""Llama-family decoder (Llama 2/3, Mistral, Qwen2 / Qwen2.5) over a paged KV cache, in plain
torch; the families differ in config only (q/k/v biases, head_dim, tied embeddings, each
layer's sliding window: `ModelConfig.layer_windows`).

q/k/v_proj load into one qkv_proj and gate/up_proj into one gate_up_proj (vLLM's stacked
parameters), so each reads its input once in one GEMM, and RoPE is applied as the q|k|v GEMM
writes its output (kernels.linear_qk_rope).

Tensor parallel (engine.parallel; TP=1 is the same code with no communication): q/k/v and
gate/up are column-parallel, o/down row-parallel (an all-reduce each), so a rank holds
num_heads/k query heads, num_kv_heads/k KV heads (its slice of the paged cache) and
intermediate_size/k of the MLP; embeddings, norms and lm_head are replicated.
"""

from __future__ import annotations

import torch
from torch import nn

from pdcluster.engine.attention_layer import unified_attention
from pdcluster.engine.model_config import ModelConfig
from pdcluster.engine.models.base import DecoderForCausalLM
from pdcluster.engine.parallel import MergedColumnParallelLinear, RowParallelLinear, TPGroup

QKV_SOURCES = ("q_proj", "k_proj", "v_proj")
GATE_UP_SOURCES = ("gate_proj", "up_proj")


class LlamaAttention(nn.Module):
    """GQA self-attention with RoPE; K/V go to the layer's paged cache before attending."""

    def __init__(self, config: ModelConfig, tp: TPGroup, layer: int) -> None:
        super().__init__()
        self.layer = layer  # its cache in the forward context's PagedKVCache
        self.num_heads = config.num_attention_heads // tp.world_size  # this rank's heads
        self.num_kv_heads = config.num_key_value_heads // tp.world_size
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        #: this layer's sliding window in tokens, 0: it attends to every earlier position
        self.sliding_window = config.layer_windows[layer] if config.layer_windows else 0
        q_size = config.num_attention_heads * self.head_dim
        kv_size = config.num_key_value_heads * self.head_dim
        hidden, bias = config.hidden_size, config.qkv_bias
        self.qkv_proj = MergedColumnParallelLinear(hidden, (q_size, kv_size, kv_size), bias, tp,
                                                   QKV_SOURCES)
        self.o_proj = RowParallelLinear(q_size, hidden, config.o_bias, tp)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        positions, cos_sin_cache = rope
        qkv = self.qkv_proj.forward_rope(hidden, positions, cos_sin_cache, self.head_dim)
        q, k, v = self.qkv_proj.split(qkv)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # strided views of one output
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        return self.attend(q, k, v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Paged attention of q [T, H, D], k/v [T, Hkv, D] (RoPE applied), then o_proj."""
        out = unified_attention(q, k, v, self.layer, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(q.shape[0], self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)), of `intermediate_size` (the config's unless
    given: a MoE family's dense layers have their own)."""

    def __init__(self, config: ModelConfig, tp: TPGroup, intermediate_size: int | None = None
                 ) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, config.mlp_bias
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden, (inter, inter), bias, tp,
                                                       GATE_UP_SOURCES)
        self.down_proj = RowParallelLinear(inter, hidden, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_silu_and_mul(x))


class LlamaForCausalLM(DecoderForCausalLM):
    """transformers' LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM (see the module
    docstring); its decode steps may run on the CPU decode stack."""

    runs_cpu_decode_stack = True

    def build_attention(self, config: ModelConfig, tp: TPGroup, layer: int) -> nn.Module:
        return LlamaAttention(config, tp, layer)

    def build_mlp(self, config: ModelConfig, tp: TPGroup, layer: int) -> nn.Module:
        return LlamaMLP(config, tp)
