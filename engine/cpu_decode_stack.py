"""An all-decode step's decoder layers on CPU in one C++ call (kernels/cpu_decode_stack.cpp):
the CPU's counterpart of the decode CUDA graphs (engine.cuda_graphs).

An eager decode step on CPU is its kernels plus Python's dispatch between them: per layer a
dozen module calls, views and backend checks. On a slow core that dispatch is a sizeable
share of the step (docs/notes/cpu-engine-findings.md, "Decode steps without Python between
the kernels"). The stack holds each layer's weights once (the norms and the GEMMs' packed
copies) and runs the embedding, every layer and the final norm in C++. It calls the same
kernels in the same order as the model's eager forward, so its hidden states are the
forward's, bit for bit.

Each projection runs where `kernels.cpu_gemm.linear` would run it: the skinny GEMM (for
bfloat16 on AMX, the tile GEMM) up to `skinny_max_rows` rows, oneDNN's matmul over the packed
weight above (called from C++ too), so a decode batch of any size stays off Python. Batches
above the skinny rows stay on the forward only where the weights were not packed for oneDNN.

What stays on the forward: steps with a prefill chunk, steps with the KV connector's layer
hooks (a prefill worker's), a kernel backend other than "auto", and every model `build` turns
down: tensor-parallel ranks (their all-reduces), a compiled forward, or weights, dtype or head
size the C++ kernels do not take.
"""

from __future__ import annotations

from typing import Any

import torch

from pdcluster import kernels
from pdcluster.kernels import cpu_extension
from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.kv_cache import PagedKVCache
from pdcluster.engine.models.base import DecoderForCausalLM
from pdcluster.kernels.cpu_gemm import skinny_max_rows

_DTYPES = (torch.float32, torch.bfloat16)


def build(model: DecoderForCausalLM, kv_cache: PagedKVCache) -> CPUDecodeStack | None:
    """The stack for `model` (eager, after `process_weights_after_loading`) over `kv_cache`,
    or None where it does not apply: a family whose layers are not Llama's
    (`runs_cpu_decode_stack`) or a sliding window (its attention has none), not on CPU, TP > 1, no C++ extension, a kernel backend
    other than "auto", a dtype other than float32 / bfloat16, a head size the attention kernel
    has no specialization for, or a linear without its skinny copy."""
    dtype = model.model.embed_tokens.weight.dtype
    if (not model.runs_cpu_decode_stack or model.config.sliding_window is not None
            or kv_cache.device.type != "cpu"
            or model.tp.world_size != 1 or dtype not in _DTYPES
            or kv_cache.dtype != dtype or kernels.get_backend() != "auto"
            or not cpu_extension.available()
            or not cpu_extension.module().supports_head_dim(model.config.head_dim)):
        return None
    if any(linear.skinny_weight is None or linear.skinny_weight.dtype != dtype
           for linear in _projections(model)):
        return None
    return CPUDecodeStack(model, kv_cache)


def _projections(model: DecoderForCausalLM) -> list[Any]:
    """Every layer's four linears the stack runs: q|k|v, o, gate|up, down."""
    return [linear for layer in model.model.layers
            for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                           layer.mlp.gate_up_proj, layer.mlp.down_proj)]


class CPUDecodeStack:
    """The model's decoder layers for decode batches (one new token per sequence) of the
    sizes `takes` accepts; `forward` runs them."""

    def __init__(self, model: DecoderForCausalLM, kv_cache: PagedKVCache) -> None:
        ext = cpu_extension.module()
        config = model.config
        #: the most rows a projection runs on its second copy (the skinny or the tile GEMM),
        #: in the model's dtype
        self.skinny_max_rows = skinny_max_rows(model.model.embed_tokens.weight.dtype)

        def bias(linear: Any) -> torch.Tensor | None:
            return None if linear.bias is None else linear.bias.detach()

        def packed(linear: Any) -> torch.Tensor | None:
            return linear.weight.detach() if linear.weight.is_mkldnn else None

        layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(ext.DecodeLayer(
                input_norm=layer.input_layernorm.weight.detach(),
                qkv=attn.qkv_proj.skinny_weight, o=attn.o_proj.skinny_weight,
                post_norm=layer.post_attention_layernorm.weight.detach(),
                gate_up=mlp.gate_up_proj.skinny_weight, down=mlp.down_proj.skinny_weight,
                qkv_bias=bias(attn.qkv_proj), o_bias=bias(attn.o_proj),
                gate_up_bias=bias(mlp.gate_up_proj), down_bias=bias(mlp.down_proj),
                qkv_packed=packed(attn.qkv_proj), o_packed=packed(attn.o_proj),
                gate_up_packed=packed(mlp.gate_up_proj), down_packed=packed(mlp.down_proj)))
        #: whether every projection has its oneDNN-packed weight: then any batch runs here
        self.packed = all(linear.weight.is_mkldnn for linear in _projections(model))
        first = model.model.layers[0].self_attn
        self._stack = ext.DecodeStack(
            embedding=model.model.embed_tokens.weight.detach(), layers=layers,
            final_norm=model.model.norm.weight.detach(), eps=model.model.norm.eps,
            num_heads=first.num_heads, num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim, intermediate_size=config.intermediate_size,
            scale=first.scale, skinny_max_rows=self.skinny_max_rows)
        self._rotary = model.rotary
        self._kv_cache = kv_cache

    def takes(self, num_rows: int) -> bool:
        """Whether a decode batch of `num_rows` sequences runs here: any size where the weights
        are packed for oneDNN, else up to the skinny GEMM's rows."""
        return self.packed or num_rows <= self.skinny_max_rows

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions int64 [n] (`takes(n)`, one new token per sequence, as
        `InputBuffers.prepare` lays out a decode batch) -> final-normed hidden [n, hidden];
        writes each layer's new K/V into the cache at `attn.slot_mapping`. Raises
        RuntimeError for inputs the kernels reject (e.g. a slot outside the cache)."""
        cache = self._kv_cache
        return self._stack.forward(input_ids, positions, self._rotary.cos_sin_cache(cache.device),
                                   cache.k, cache.v, attn.slot_mapping, attn.block_tables,
                                   attn.seq_lens)
