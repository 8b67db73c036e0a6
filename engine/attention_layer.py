"""A decoder layer's attention as one custom op, `pdcluster::unified_attention` (vLLM's split
point): a compiled graph calls it as an opaque node and everything else of the layer compiles
around it.

Inside, it reads the forward context (engine.forward_context), runs the KV connector's
`wait_for_layer_load` for the layer, stores the new K/V into the layer's paged cache and attends
(engine.attention.paged_attention, on the device's kernels), then runs `save_kv_layer`, which
may raise the connector's StepCancelled. The cache is written through the context, not through
an argument, so the compiled graph never copies it; order is kept because each layer's
attention consumes the previous layer's output.
"""

from __future__ import annotations

import torch

from pdcluster import kernels
from pdcluster.engine.attention import paged_attention
from pdcluster.engine.forward_context import get_forward_context


def unified_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                      scale: float, sliding_window: int = 0, softcap: float = 0.0
                      ) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] of decoder layer `layer` -> attention output [T, H, D]
    over the forward context's cache (see engine.attention.paged_attention; `sliding_window`
    W > 0: the layer's window in tokens; `softcap` > 0: scores soft-capped, Gemma 2's). Eager
    calls run the op's body directly; a traced graph records the custom op. Raises
    RuntimeError outside a forward context."""
    if torch.compiler.is_compiling():
        return torch.ops.pdcluster.unified_attention(q, k, v, layer, scale, sliding_window,
                                                     softcap)
    return _attend(q, k, v, layer, scale, sliding_window, softcap)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
            scale: float, sliding_window: int, softcap: float) -> torch.Tensor:
    context = get_forward_context()
    hooks, cache = context.layer_hooks, context.kv_cache
    if hooks is not None:
        hooks.wait_for_layer_load(layer)
    out = paged_attention(q, k, v, cache.k[layer], cache.v[layer], context.attn, scale,
                          sliding_window, softcap)
    if hooks is not None:
        hooks.save_kv_layer(layer)
    return out


@torch.library.custom_op("pdcluster::unified_attention", mutates_args=())
def _unified_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                          scale: float, sliding_window: int, softcap: float) -> torch.Tensor:
    return _attend(q, k, v, layer, scale, sliding_window, softcap)


@_unified_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
      scale: float, sliding_window: int, softcap: float) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def unified_mla_attention(q: torch.Tensor, latent: torch.Tensor, layer: int, scale: float,
                          v_dim: int) -> torch.Tensor:
    """MLA's counterpart of `unified_attention`: q [T, H, D] (absorbed, D = v_dim + rope
    dims), latent [T, 1, D] this step's cache entries -> [T, H, v_dim] in the latent space,
    over the forward context's latent cache (engine.kv_cache with kv_parts 1;
    kernels.paged_mla_attention). Raises RuntimeError outside a forward context."""
    if torch.compiler.is_compiling():
        return torch.ops.pdcluster.unified_mla_attention(q, latent, layer, scale, v_dim)
    return _attend_latent(q, latent, layer, scale, v_dim)


def _attend_latent(q: torch.Tensor, latent: torch.Tensor, layer: int, scale: float,
                   v_dim: int) -> torch.Tensor:
    context = get_forward_context()
    hooks, cache, attn = context.layer_hooks, context.kv_cache.k[layer], context.attn
    if hooks is not None:
        hooks.wait_for_layer_load(layer)
    kernels.store_kv_cache(latent, latent, cache, cache, attn.slot_mapping)
    out = kernels.paged_mla_attention(q, cache, attn.block_tables, attn.query_start_loc,
                                      attn.seq_lens, scale, v_dim)
    if hooks is not None:
        hooks.save_kv_layer(layer)
    return out


@torch.library.custom_op("pdcluster::unified_mla_attention", mutates_args=())
def _unified_mla_attention_op(q: torch.Tensor, latent: torch.Tensor, layer: int, scale: float,
                              v_dim: int) -> torch.Tensor:
    return _attend_latent(q, latent, layer, scale, v_dim)


@_unified_mla_attention_op.register_fake
def _(q: torch.Tensor, latent: torch.Tensor, layer: int, scale: float,
      v_dim: int) -> torch.Tensor:
    return q.new_empty((*q.shape[:2], v_dim))
