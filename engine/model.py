"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a paged KV cache, in plain torch.

Tokens arrive flattened ([num_tokens], several sequences packed; see engine.attention), so every
module works on [num_tokens, ...] tensors. Module and parameter names mirror transformers'
LlamaForCausalLM, so HF checkpoint names map one to one. Separate q/k/v/o and gate/up/down
linears keep a later tensor-parallel split (column-parallel q/k/v/gate/up, row-parallel o/down)
a per-linear change.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from engine.attention import AttentionMetadata, paged_attention
from engine.config import ModelConfig
from engine.kv_cache import PagedKVCache
from engine.loader import WeightLoadError
from engine.rope import RotaryEmbedding, apply_rotary_emb


class RMSNorm(nn.Module):
    """RMSNorm with optional fused residual add (kernels.rms_norm); returns (out, residual)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.rms_norm(x, self.weight, self.eps, residual)


class LlamaAttention(nn.Module):
    """GQA self-attention with RoPE; K/V go to the layer's paged cache before attending."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_bias)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q = self.q_proj(hidden).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary_emb(q, k, *rope)
        out = paged_attention(q, k, v, k_cache, v_cache, attn, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = torch.cat((self.gate_proj(x), self.up_proj(x)), dim=-1)
        return self.down_proj(kernels.silu_and_mul(gate_up))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried separately (vLLM's fused add+norm style)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, k_cache, v_cache, attn)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF prefix `model.`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The whole model. forward -> final hidden states; compute_logits -> float32 logits."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: PagedKVCache,
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: int64 [num_tokens] -> final-normed hidden [num_tokens, hidden].

        Writes each layer's new K/V into `kv_cache` at `attn.slot_mapping`."""
        rope = (positions, self.rotary.cos_sin_cache(positions.device))  # kernels.rotary_embedding's inputs
        hidden, residual = self.model.embed_tokens(input_ids), None
        for index, layer in enumerate(self.model.layers):
            hidden, residual = layer(hidden, residual, rope, kv_cache.k[index], kv_cache.v[index], attn)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> float32 logits [n, vocab] (lm_head, or the embedding if tied)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return nn.functional.linear(hidden, weight).to(torch.float32)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors (`model.layers.N.self_attn.q_proj.weight`, ...) into the parameters.

        Casts to each parameter's dtype and device. `lm_head.weight` is ignored when embeddings are
        tied; rotary `inv_freq` buffers some checkpoints carry are ignored. Raises WeightLoadError
        for a missing parameter, a shape mismatch or an unexpected tensor name.
        """
        params = dict(self.named_parameters())
        unexpected = sorted(
            name
            for name in state_dict
            if name not in params
            and not name.endswith("rotary_emb.inv_freq")
            and not (name == "lm_head.weight" and self.lm_head is None)
        )
        if unexpected:
            raise WeightLoadError(f"checkpoint has tensors the model does not: {unexpected[:5]}")
        missing = sorted(name for name in params if name not in state_dict)
        if missing:
            raise WeightLoadError(f"checkpoint lacks tensors: {missing[:5]} ({len(missing)} in all)")
        with torch.no_grad():
            for name, param in params.items():
                tensor = state_dict[name]
                if tensor.shape != param.shape:
                    raise WeightLoadError(
                        f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}"
                    )
                param.copy_(tensor)


def build_model(config: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> LlamaForCausalLM:
    """An uninitialized model with parameters allocated in `dtype` on `device`, in eval mode.

    Built on the meta device then materialized, so no time goes into random init; call
    `load_weights` before use."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device=device).to(dtype)
    return model.eval().requires_grad_(False)
