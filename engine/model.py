"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a paged KV cache, in plain torch.

Tokens arrive flattened ([num_tokens], several sequences packed; see engine.attention), so every
module works on [num_tokens, ...] tensors. Module and parameter names mirror transformers'
LlamaForCausalLM, except that q/k/v_proj load into one qkv_proj and gate/up_proj into one
gate_up_proj (vLLM's stacked parameters), so each reads its input once in one GEMM.

Tensor parallel (engine.parallel; TP=1 is the same code with no communication): q/k/v and
gate/up are column-parallel, o/down row-parallel (an all-reduce each), so a rank holds
num_heads/k query heads, num_kv_heads/k KV heads (its slice of the paged cache) and
intermediate_size/k of the MLP; embeddings, norms and lm_head are replicated.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from engine.attention_layer import unified_attention
from engine.config import ModelConfig
from engine.loader import CheckpointReader, WeightLoadError
from engine.parallel import (LinearBase, MergedColumnParallelLinear, RowParallelLinear,
                             TPGroup, replicated_weight_loader)
from engine.rope import RotaryEmbedding


#: Merged module -> the HF modules whose weights it stacks, in order (vLLM's
#: stacked_params_mapping).
_STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


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

    def __init__(self, config: ModelConfig, tp: TPGroup, layer: int) -> None:
        super().__init__()
        self.layer = layer  # its cache in the forward context's PagedKVCache
        self.num_heads = config.num_attention_heads // tp.world_size  # this rank's heads
        self.num_kv_heads = config.num_key_value_heads // tp.world_size
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        q_size = config.num_attention_heads * self.head_dim
        kv_size = config.num_key_value_heads * self.head_dim
        hidden, bias = config.hidden_size, config.qkv_bias
        self.qkv_proj = MergedColumnParallelLinear(hidden, (q_size, kv_size, kv_size), bias, tp)
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
        out = unified_attention(q, k, v, self.layer, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_up_proj = MergedColumnParallelLinear(hidden, (inter, inter), bias, tp)
        self.down_proj = RowParallelLinear(inter, hidden, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_silu_and_mul(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried separately (vLLM's fused add+norm style)."""

    def __init__(self, config: ModelConfig, tp: TPGroup, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, tp, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope)
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
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, tp, layer)
                                    for layer in range(config.num_hidden_layers))
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
        #: lm_head's weight as compute_logits reads it (process_weights_after_loading)
        self.logits_weight: torch.Tensor | None = None
        #: its skinny copy for decode batches on CPU (kernels.pack_skinny_weight), or None
        self.logits_skinny: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: int64 [num_tokens] -> final-normed hidden [num_tokens, hidden].

        Runs inside a forward context (engine.forward_context): writes each layer's new K/V
        into its cache at the context's `attn.slot_mapping`. Raises RuntimeError outside one."""
        rope = (positions, self.rotary.cos_sin_cache(positions.device))  # kernels.rotary_embedding's inputs
        hidden, residual = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            hidden, residual = layer(hidden, residual, rope)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> float32 logits [n, vocab] (lm_head, or the embedding if tied)."""
        weight = self.logits_weight
        if weight is None:
            weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return kernels.linear(hidden, weight, skinny=self.logits_skinny).to(torch.float32)

    def process_weights_after_loading(self) -> None:
        """Repack every GEMM weight for the device's fastest linear (`kernels.pack_linear_weight`,
        vLLM's hook of the same name); call once, after `load_checkpoint`. A tied lm_head gets
        a packed copy of the embedding table (the lookup needs it dense); an untied one is
        packed in place. Each also gets its skinny copy for decode batches, where it applies."""
        for module in self.modules():
            if isinstance(module, LinearBase):
                module.process_weights_after_loading()
        dense = (self.model.embed_tokens.weight if self.lm_head is None
                 else self.lm_head.weight).detach()
        self.logits_skinny = kernels.pack_skinny_weight(dense)
        if self.lm_head is None:
            self.logits_weight = kernels.pack_linear_weight(dense)
        else:
            self.lm_head.weight = nn.Parameter(kernels.pack_linear_weight(dense),
                                               requires_grad=False)
            self.logits_weight = self.lm_head.weight

    def load_checkpoint(self, reader: CheckpointReader) -> None:
        """Copy HF-named tensors (`model.layers.N.self_attn.q_proj.weight`, ...) from lazy
        safetensors slices into the parameters: each parameter's weight_loader reads only this
        rank's rows or columns from disk (engine.parallel), cast to the parameter's dtype and
        device; q/k/v and gate/up land in their part of the merged qkv_proj and gate_up_proj.
        `lm_head.weight` is ignored when embeddings are tied; rotary `inv_freq` buffers some
        checkpoints carry are ignored.
        Raises WeightLoadError for a missing parameter, a shape mismatch or an unexpected name.
        """
        sources = self._checkpoint_sources()
        names = set(reader.names())
        unexpected = sorted(
            name
            for name in names
            if name not in sources
            and not name.endswith("rotary_emb.inv_freq")
            and not (name == "lm_head.weight" and self.lm_head is None)
        )
        if unexpected:
            raise WeightLoadError(f"checkpoint has tensors the model does not: {unexpected[:5]}")
        missing = sorted(name for name in sources if name not in names)
        if missing:
            raise WeightLoadError(f"checkpoint lacks tensors: {missing[:5]} ({len(missing)} in all)")
        for name, (module, param, part) in sources.items():
            if part is not None:
                module.weight_loader(param, reader.slice(name), name, part)
            else:
                loader = getattr(module, "weight_loader", replicated_weight_loader)
                loader(param, reader.slice(name), name)

    def _checkpoint_sources(self) -> dict[str, tuple[nn.Module, nn.Parameter, int | None]]:
        """Checkpoint tensor name -> (module, parameter, part of a merged parameter or None)."""
        sources: dict[str, tuple[nn.Module, nn.Parameter, int | None]] = {}
        for module_name, module in self.named_modules():
            merged = _STACKED.get(module_name.rsplit(".", 1)[-1])
            for param_name, param in module.named_parameters(recurse=False):
                if merged is None:
                    sources[f"{module_name}.{param_name}" if module_name else param_name] = (
                        module, param, None)
                    continue
                prefix = module_name.rsplit(".", 1)[0]
                for part, source in enumerate(merged):
                    sources[f"{prefix}.{source}.{param_name}"] = (module, param, part)
        return sources


def build_model(config: ModelConfig, dtype: torch.dtype, device: str | torch.device,
                tp: TPGroup | None = None) -> LlamaForCausalLM:
    """An uninitialized model (this rank's shard, with `tp`) with parameters allocated in
    `dtype` on `device`, in eval mode.

    Built on the meta device then materialized, so no time goes into random init; call
    `load_checkpoint` before use."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, tp)
    _materialize(model, dtype, torch.device(device))
    return model.eval().requires_grad_(False)


def _materialize(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Replace every meta parameter and buffer with an uninitialized tensor on `device`,
    floating ones in `dtype`; a tensor shared between modules stays shared.

    ``Module.to_empty(...).to(dtype)`` would do the same, but it allocates each floating
    tensor twice where `dtype` is not the default, and its ``empty_like`` of a meta tensor goes
    through torch's Python references, whose first use imports sympy, a large import that
    an eager worker does not otherwise need at start."""
    made: dict[int, torch.Tensor] = {}  # id of a meta tensor -> its replacement

    def replace(t: torch.Tensor, parameter: bool) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty(t.shape, device=device,
                              dtype=dtype if t.is_floating_point() else t.dtype)
            made[id(t)] = nn.Parameter(new, requires_grad=False) if parameter else new
        return made[id(t)]

    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = replace(param, True)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = replace(buffer, False)
