"""Qwen3-MoE: Qwen3's attention (per-head q/k norm) with a sparse MoE MLP: `num_experts`
SwiGLU experts of `moe_intermediate_size`, the top `num_experts_per_tok` by softmax,
renormalized only when `norm_topk_prob`. A layer is sparse when it is not in
`mlp_only_layers` and (layer + 1) is a multiple of `decoder_sparse_step`; the others have a
dense MLP of `intermediate_size` (transformers' Qwen3MoeDecoderLayer).
"""

from __future__ import annotations

from torch import nn

from pdcluster.engine.model_config import ModelConfig
from pdcluster.engine.models.base import DecoderForCausalLM
from pdcluster.engine.models.fused_moe import SparseMoeBlock
from pdcluster.engine.models.llama import GATE_UP_SOURCES, LlamaMLP
from pdcluster.engine.models.qwen3 import Qwen3Attention
from pdcluster.engine.parallel import TPGroup


def num_experts(config: ModelConfig) -> int:
    """`num_experts` (Qwen's checkpoints) or `num_local_experts` (transformers 5's key)."""
    raw = config.hf_config
    return int(raw.get("num_experts") or raw.get("num_local_experts") or 0)


def is_sparse(config: ModelConfig, layer: int) -> bool:
    raw = config.hf_config
    return (layer not in (raw.get("mlp_only_layers") or []) and num_experts(config) > 0
            and (layer + 1) % int(raw.get("decoder_sparse_step") or 1) == 0)


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """transformers' Qwen3MoeForCausalLM."""

    def build_attention(self, config: ModelConfig, tp: TPGroup, layer: int) -> nn.Module:
        return Qwen3Attention(config, tp, layer)

    def build_mlp(self, config: ModelConfig, tp: TPGroup, layer: int) -> nn.Module:
        if not is_sparse(config, layer):
            return LlamaMLP(config, tp)
        raw = config.hf_config
        return SparseMoeBlock(config.hidden_size, num_experts(config),
                              int(raw["num_experts_per_tok"]), int(raw["moe_intermediate_size"]),
                              bool(raw.get("norm_topk_prob", False)), tp,
                              (*GATE_UP_SOURCES, "down_proj"))

    @classmethod
    def tp_split_sizes(cls, config: ModelConfig) -> dict[str, int]:
        sizes = super().tp_split_sizes(config)
        if num_experts(config):
            sizes["moe_intermediate_size"] = int(config.hf_config["moe_intermediate_size"])
        return sizes
