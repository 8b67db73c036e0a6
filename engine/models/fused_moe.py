"""A mixture-of-experts MLP layer: a router picks `top_k` of `num_experts` SwiGLU experts per
token and the layer returns their routing-weighted sum (Mixtral, Shazeer et al. 2017).

Experts run grouped (kernels.fused_moe): a token's rows are sorted by expert and each expert
runs one GEMM over all the rows routed to it, never one token at a time.

Tensor parallel shards every expert's intermediate dimension (Megatron's MLP split applied per
expert, vLLM's default for MoE under TP): rank r holds rows [r*I/k, (r+1)*I/k) of every
expert's gate and up and those columns of its down, and the partial sums meet in the same one
all-reduce as a dense MLP. Placing whole experts per rank (expert parallel) would need an
all-to-all each way, and a rank's work would follow the routing: a batch whose tokens go
mostly to one expert would leave the other ranks idle. Sharding keeps every rank's work equal
for any routing and any expert count; it needs k to divide the expert intermediate size.

The experts run as one custom op, `pdcluster::fused_moe`, as attention does
(engine.attention_layer): a compiled graph calls it as an opaque node, since the grouping depends
on the routing's values (the torch path sizes each expert's GEMM from them), which a traced graph
cannot hold.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pdcluster import kernels
from pdcluster.engine.parallel import TPGroup, load_shard


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing: router_logits [T, E] -> (weights float32 [T, top_k], expert ids int64
    [T, top_k]). The softmax runs in float32 over all experts, then the top_k are kept, and
    with `renormalize` divided by their sum (Mixtral always; Qwen3-MoE when
    `norm_topk_prob`), as transformers' routers do."""
    probs = torch.softmax(router_logits.to(torch.float32), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    """Every expert of one layer, stacked (this rank's shard): `w13` [E, 2 I/k, H] (gate rows,
    then up rows), `w2` [E, H, I/k]. x [T, H], routing [T, top_k] -> [T, H] (all-reduced).

    `sources`: the checkpoint's names of an expert's gate, up and down linears
    (`<layer>.experts.<e>.<name>.weight`). Raises ValueError if k does not divide
    `intermediate_size`."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TPGroup,
                 sources: Sequence[str]) -> None:
        super().__init__()
        self.tp = tp
        start, end = tp.shard(intermediate_size, "expert intermediate size")
        self.local_intermediate = end - start
        self.sources = tuple(sources)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.local_intermediate, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.local_intermediate))

    def checkpoint_tensors(self, module_name: str) -> dict[str, Callable[[Any], None]]:
        """Each expert's gate/up rows and down columns of this rank (engine.models.base)."""
        gate, up, down = self.sources
        local, tp = self.local_intermediate, self.tp
        loaders: dict[str, Callable[[Any], None]] = {}
        for expert in range(self.w13.shape[0]):
            for part, source in enumerate((gate, up)):
                name = f"{module_name}.{expert}.{source}.weight"
                loaders[name] = (lambda loaded, e=expert, p=part, n=name: load_shard(
                    self.w13[e].narrow(0, p * local, local), loaded, n, 0, tp))
            name = f"{module_name}.{expert}.{down}.weight"
            loaders[name] = (lambda loaded, e=expert, n=name: load_shard(
                self.w2[e], loaded, n, 1, tp))
        return loaders

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
                ) -> torch.Tensor:
        if torch.compiler.is_compiling():
            out = torch.ops.pdcluster.fused_moe(x, self.w13, self.w2, topk_weights, topk_ids)
        else:
            out = kernels.fused_moe(x, self.w13, self.w2, topk_weights, topk_ids)
        return self.tp.all_reduce(out)


@torch.library.custom_op("pdcluster::fused_moe", mutates_args=())
def _fused_moe_op(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    return kernels.fused_moe(x, w13, w2, topk_weights, topk_ids)


@_fused_moe_op.register_fake
def _(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
      topk_ids: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


class Router(nn.Module):
    """The gate's weight [num_experts, hidden], replicated (it is small)."""

    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))


class SparseMoeBlock(nn.Module):
    """Router `gate` and `experts` (HF's `<layer>.mlp.gate`, `<layer>.mlp.experts.<e>`):
    x [T, H] -> [T, H]."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, tp: TPGroup, sources: Sequence[str]) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in [1, num_experts {num_experts}]")
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = Router(num_experts, hidden_size)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, tp, sources)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.nn.functional.linear(x, self.gate.weight)
        weights, ids = select_experts(logits, self.top_k, self.renormalize)
        return self.experts(x, weights, ids)
