"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a paged KV cache, in plain torch.

Tokens arrive flattened ([num_tokens], several sequences packed; see engine.attention), so every
module works on [num_tokens, ...] tensors. Module and parameter names mirror transformers'
LlamaForCausalLM, so HF checkpoint names map one to one.

Tensor parallel (engine.parallel; TP=1 is the same code with no communication): q/k/v and
gate/up are column-parallel, o/down row-parallel (an all-reduce each), so a rank holds
num_heads/k query heads, num_kv_heads/k KV heads (its slice of the paged cache) and
intermediate_size/k of the MLP; embeddings, norms and lm_head are replicated.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from engine.attention import AttentionMetadata, paged_attention
from engine.config import ModelConfig
from engine.kv_cache import PagedKVCache
from engine.loader import CheckpointReader, WeightLoadError
from engine.parallel import ColumnParallelLinear, RowParallelLinear, TPGroup, replicated_weight_loader
from engine.rope import RotaryEmbedding


def check_tensor_parallel(config: ModelConfig, tp_size: int) -> None:
    """Raise ValueError unless `tp_size` divides the heads, KV heads and intermediate size."""
    if tp_size < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {tp_size}")
    for what, size in (("num_attention_heads", config.num_attention_heads),
                       ("num_key_value_heads", config.num_key_value_heads),
                       ("intermediate_size", config.intermediate_size)):
        if size % tp_size:
            raise ValueError(f"tensor parallel size {tp_size} does not divide the model's {what} "
                             f"{size} ({config.name}); KV heads are never replicated across ranks")


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

    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads // tp.world_size  # this rank's heads
        self.num_kv_heads = config.num_key_value_heads // tp.world_size
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        q_size = config.num_attention_heads * self.head_dim
        kv_size = config.num_key_value_heads * self.head_dim
        hidden, bias = config.hidden_size, config.qkv_bias
        self.q_proj = ColumnParallelLinear(hidden, q_size, bias, tp)
        self.k_proj = ColumnParallelLinear(hidden, kv_size, bias, tp)
        self.v_proj = ColumnParallelLinear(hidden, kv_size, bias, tp)
        self.o_proj = RowParallelLinear(q_size, hidden, config.o_bias, tp)

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
        positions, cos_sin_cache = rope
        kernels.rotary_embedding(positions, q, k, cos_sin_cache)  # in place
        out = paged_attention(q, k, v, k_cache, v_cache, attn, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = ColumnParallelLinear(hidden, inter, bias, tp)
        self.up_proj = ColumnParallelLinear(hidden, inter, bias, tp)
        self.down_proj = RowParallelLinear(inter, hidden, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = torch.cat((self.gate_proj(x), self.up_proj(x)), dim=-1)
        return self.down_proj(kernels.silu_and_mul(gate_up))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried separately (vLLM's fused add+norm style)."""

    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp)

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

    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        # _weight: no random init (build_model loads every parameter; init on the meta device
        # would cost seconds of one-time imports per process)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, tp) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LMHead(nn.Module):
    """The untied output projection's weight [vocab, hidden], replicated on every rank."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))


class LlamaForCausalLM(nn.Module):
    """The whole model (this rank's shard of it). forward -> final hidden states (replicated);
    compute_logits -> float32 logits. Raises ValueError if tp's size does not divide the heads,
    KV heads and intermediate size."""

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp or TPGroup()
        check_tensor_parallel(config, self.tp.world_size)
        self.config = config
        self.model = LlamaModel(config, self.tp)
        self.lm_head: LMHead | None = None
        if not config.tie_word_embeddings:
            self.lm_head = LMHead(config.hidden_size, config.vocab_size)
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

    def load_checkpoint(self, reader: CheckpointReader) -> None:
        """Copy HF-named tensors (`model.layers.N.self_attn.q_proj.weight`, ...) from lazy
        safetensors slices into the parameters: each parameter's weight_loader reads only this
        rank's rows or columns from disk (engine.parallel), cast to the parameter's dtype and
        device. `lm_head.weight` is ignored when embeddings are tied; rotary `inv_freq` buffers
        some checkpoints carry are ignored.
        Raises WeightLoadError for a missing parameter, a shape mismatch or an unexpected name.
        """
        params = dict(self.named_parameters())
        names = set(reader.names())
        unexpected = sorted(
            name
            for name in names
            if name not in params
            and not name.endswith("rotary_emb.inv_freq")
            and not (name == "lm_head.weight" and self.lm_head is None)
        )
        if unexpected:
            raise WeightLoadError(f"checkpoint has tensors the model does not: {unexpected[:5]}")
        missing = sorted(name for name in params if name not in names)
        if missing:
            raise WeightLoadError(f"checkpoint lacks tensors: {missing[:5]} ({len(missing)} in all)")
        for module_name, module in self.named_modules():
            loader = getattr(module, "weight_loader", None)
            for param_name, param in module.named_parameters(recurse=False):
                name = f"{module_name}.{param_name}" if module_name else param_name
                (loader or replicated_weight_loader)(param, reader.slice(name), name)


def build_model(config: ModelConfig, dtype: torch.dtype, device: str | torch.device,
                tp: TPGroup | None = None) -> LlamaForCausalLM:
    """An uninitialized model (this rank's shard, with `tp`) with parameters allocated in
    `dtype` on `device`, in eval mode.

    Built on the meta device then materialized, so no time goes into random init; call
    `load_checkpoint` before use."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, tp)
    model.to_empty(device=device).to(dtype)
    return model.eval().requires_grad_(False)
