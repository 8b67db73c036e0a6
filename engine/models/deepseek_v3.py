"""DeepSeek-V3 (and the checkpoints of its architecture: R1, Kimi K2, Moonlight): DeepSeek-V2's
MLA and DeepSeekMoE (engine.models.deepseek_v2) with V3's router (DeepSeek-AI 2024,
"DeepSeek-V3", §2.1.2), as transformers' DeepseekV3TopkRouter computes it:

- affinities are sigmoids of the router logits (float32), not a softmax;
- each expert's `e_score_correction_bias` (auxiliary-loss-free balancing) is added for the
  choice only: groups rank by the sum of their two best biased scores, the `topk_group` best
  are kept, and the top `num_experts_per_tok` biased scores among their experts are chosen;
- a chosen expert weighs its unbiased affinity, normalized over the chosen ones when
  `norm_topk_prob`, times `routed_scaling_factor`.

The multi-token-prediction layers a checkpoint carries after its last layer
(`num_nextn_predict_layers`, §2.2) are not read: this engine decodes one token per step.
RoPE pairs are interleaved as in V2; a checkpoint with `rope_interleave: false` is refused.
"""

from __future__ import annotations

import torch
from torch import nn

from pdcluster.engine.model_config import ModelConfig, ModelConfigError
from pdcluster.engine.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV2MoE
from pdcluster.engine.models.fused_moe import Router
from pdcluster.engine.models.llama import LlamaMLP
from pdcluster.engine.parallel import TPGroup


class CorrectedRouter(Router):
    """The gate's weight [num_experts, hidden] and its `e_score_correction_bias`
    [num_experts], replicated."""

    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__(num_experts, hidden_size)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts))


def select_experts_biased(logits: torch.Tensor, bias: torch.Tensor, top_k: int, num_groups: int,
                          topk_groups: int, normalize: bool, scaling: float
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """V3 routing (module docstring): float32 logits [T, E], bias [E] -> (weights float32
    [T, top_k], ids int64 [T, top_k]). E / num_groups must be at least 2."""
    scores = logits.sigmoid()
    choice = scores + bias.to(torch.float32)
    num_tokens, num_experts = scores.shape
    group_scores = choice.view(num_tokens, num_groups, -1).topk(2, dim=-1).values.sum(dim=-1)
    chosen = group_scores.topk(topk_groups, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    choice = choice.masked_fill(~keep.repeat_interleave(num_experts // num_groups, dim=1),
                                float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


class DeepseekV3MoE(DeepseekV2MoE):
    """DeepseekV2MoE with V3's router."""

    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__(config, tp)
        self.gate = CorrectedRouter(int(config.hf_config["n_routed_experts"]), config.hidden_size)
        self.normalize = bool(config.hf_config.get("norm_topk_prob", True))

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts_biased(logits, self.gate.e_score_correction_bias, self.top_k,
                                     self.num_groups, self.topk_groups, self.normalize,
                                     self.scaling)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """transformers' DeepseekV3ForCausalLM (see the module docstring). Raises
    ModelConfigError for `rope_interleave: false`."""

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        if config.hf_config.get("rope_interleave", True) is False:
            raise ModelConfigError("DeepSeek-V3 with rope_interleave: false is not supported")
        super().__init__(config, tp)
        first = config.num_hidden_layers
        extra = int(config.hf_config.get("num_nextn_predict_layers") or 0)
        self.checkpoint_ignored = tuple(f"model.layers.{layer}." for layer in
                                        range(first, first + extra))

    def build_mlp(self, config: ModelConfig, tp: TPGroup, layer: int) -> nn.Module:
        if layer < int(config.hf_config.get("first_k_dense_replace") or 0):
            return LlamaMLP(config, tp)
        return DeepseekV3MoE(config, tp)
