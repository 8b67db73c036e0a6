"""IBM Granite 3.x (dense): transformers' GraniteForCausalLM, Llama's decoder with four
scalars from its config (its µP-style parametrization): `embedding_multiplier` on the
embeddings, `attention_multiplier` as the softmax scale (instead of head_dim ** -0.5),
`residual_multiplier` on each sublayer's output before it joins the residual stream, and the
logits divided by `logits_scaling`. The C++ decode stack, which has none of them, does not
run this family.
"""

from __future__ import annotations

import torch
from torch import nn

from pdcluster.engine.model_config import ModelConfig
from pdcluster.engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from pdcluster.engine.parallel import TPGroup


class GraniteAttention(LlamaAttention):
    """LlamaAttention with Granite's softmax scale and residual multiplier."""

    def __init__(self, config: ModelConfig, tp: TPGroup, layer: int) -> None:
        super().__init__(config, tp, layer)
        self.scale = float(config.hf_config.get("attention_multiplier", self.scale))
        self.residual_multiplier = float(config.hf_config.get("residual_multiplier", 1.0))

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        return super().forward(hidden, rope) * self.residual_multiplier


class GraniteMLP(LlamaMLP):
    """LlamaMLP with Granite's residual multiplier."""

    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__(config, tp)
        self.residual_multiplier = float(config.hf_config.get("residual_multiplier", 1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.residual_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    """transformers' GraniteForCausalLM (see the module docstring)."""

    runs_cpu_decode_stack = False

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__(config, tp)
        self.embedding_multiplier = float(config.hf_config.get("embedding_multiplier", 1.0))
        self.logits_scaling = float(config.hf_config.get("logits_scaling", 1.0))

    def build_attention(self, config: ModelConfig, tp: TPGroup, layer: int) -> nn.Module:
        return GraniteAttention(config, tp, layer)

    def build_mlp(self, config: ModelConfig, tp: TPGroup, layer: int) -> nn.Module:
        return GraniteMLP(config, tp)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * self.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling
