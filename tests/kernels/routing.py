"""MoE routings for kernel tests."""

from __future__ import annotations

import torch


def skewed_routing(gen: torch.Generator, num_tokens: int, num_experts: int, top_k: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """topk ids [T, k] where expert 0 takes a slot of most tokens and the last expert none;
    weights [T, k] float32 summing to one per token."""
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    scores[:, -1] = -1.0
    scores[: num_tokens * 3 // 4, 0] = 2.0
    ids = scores.topk(top_k, dim=-1).indices
    weights = torch.rand(num_tokens, top_k, generator=gen) + 0.1
    return weights / weights.sum(-1, keepdim=True), ids
