"""Phi-3 and Phi-4: transformers' Phi3ForCausalLM, Llama's decoder (SwiGLU, RoPE, no biases)
whose checkpoint stacks q|k|v in one `qkv_proj` and gate|up in one `gate_up_proj`, the
layout this engine's merged linears already have, so only the loading differs
(`MergedColumnParallelLinear.stacked_in_checkpoint`). A `sliding_window` applies to every
layer, as in transformers' Phi3Attention. LongRoPE scaling and a partial rotary factor (the
128k and Phi-4-mini checkpoints) are refused by engine.model_config.
"""

from __future__ import annotations

from torch import nn

from pdcluster.engine.model_config import ModelConfig
from pdcluster.engine.models.llama import LlamaForCausalLM
from pdcluster.engine.parallel import TPGroup


class Phi3ForCausalLM(LlamaForCausalLM):
    """transformers' Phi3ForCausalLM (see the module docstring); its decode steps may run
    on the CPU decode stack, as Llama's."""

    def build_attention(self, config: ModelConfig, tp: TPGroup, layer: int) -> nn.Module:
        attention = super().build_attention(config, tp, layer)
        attention.qkv_proj.stacked_in_checkpoint = True
        return attention

    def build_mlp(self, config: ModelConfig, tp: TPGroup, layer: int) -> nn.Module:
        mlp = super().build_mlp(config, tp, layer)
        mlp.gate_up_proj.stacked_in_checkpoint = True
        return mlp
