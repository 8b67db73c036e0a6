"""Mixtral: Llama's attention with a sparse MoE MLP in every layer (Jiang et al. 2024,
"Mixtral of Experts"): `num_local_experts` SwiGLU experts of `intermediate_size`, the top
`num_experts_per_tok` by softmax, their weights renormalized to sum to one.

The checkpoint names each layer's MoE `block_sparse_moe` with experts' `w1` (gate), `w3` (up)
and `w2` (down); here it is the layer's `mlp` (engine.models.fused_moe).
"""

from __future__ import annotations

from torch import nn

from pdcluster.engine.model_config import ModelConfig
from pdcluster.engine.models.base import DecoderForCausalLM
from pdcluster.engine.models.fused_moe import SparseMoeBlock
from pdcluster.engine.models.llama import LlamaAttention
from pdcluster.engine.parallel import TPGroup


class MixtralForCausalLM(DecoderForCausalLM):
    """transformers' MixtralForCausalLM."""

    checkpoint_renames = {".block_sparse_moe.": ".mlp."}

    def build_attention(self, config: ModelConfig, tp: TPGroup, layer: int) -> nn.Module:
        return LlamaAttention(config, tp, layer)

    def build_mlp(self, config: ModelConfig, tp: TPGroup, layer: int) -> nn.Module:
        raw = config.hf_config
        return SparseMoeBlock(config.hidden_size, int(raw["num_local_experts"]),
                              int(raw["num_experts_per_tok"]), config.intermediate_size,
                              True, tp, ("w1", "w3", "w2"))
