"""DeepSeek-V2: multi-head latent attention (MLA) and DeepSeekMoE (DeepSeek-AI 2024,
"DeepSeek-V2", §2.1 and §2.2), as transformers' DeepseekV2ForCausalLM.

MLA. Each token caches one latent entry per layer: c = RMSNorm(W_DKV x) of `kv_lora_rank`
features and the decoupled RoPE key k_rope of `qk_rope_head_dim`, shared by every head (a
latent cache, engine.kv_cache with kv_parts 1). Keys and values per head would be
k_h = [W_UK_h c | k_rope] and v_h = W_UV_h c; attention runs in the latent space instead, with
the up-projections absorbed (§2.1.2; vLLM's MLA backend): the query becomes
[W_UK_h^T q_nope_h | q_rope_h], its scores against [c | k_rope] are the expanded ones, and the
output W_UV_h (sum_t p_t c_t) is the expanded output. Prefill and decode both attend so; the
cache never holds an expanded K or V. RoPE here rotates interleaved pairs (2i, 2i + 1), as
DeepSeek's and transformers' `apply_rotary_emb` do, not rotate-half. With YaRN rope scaling
(the released checkpoints') the cos/sin table carries YaRN's attention factor
(engine.rope.attention_factor) and the softmax scale is multiplied by
yarn_mscale(factor, mscale_all_dim)^2, as DeepSeek's reference and transformers' do.

MoE. Layers from `first_k_dense_replace` on have `n_routed_experts` routed experts of
`moe_intermediate_size` (engine.models.fused_moe) and `n_shared_experts` always-on ones (one
MLP of n_shared x moe_intermediate_size). Routing: softmax over the experts in float32, the top
`num_experts_per_tok` (greedy, or `group_limited_greedy`: only among the `topk_group` groups of
`n_group` whose best expert scores highest, §2.2.2), times `routed_scaling_factor`, not
renormalized. The earlier layers have a dense MLP of `intermediate_size`.

Tensor parallel: the heads split (q_proj, kv_b_proj column-parallel, o_proj row-parallel),
the experts' intermediate dimension splits (engine.models.fused_moe), and the latent stays
whole: kv_a_proj_with_mqa is replicated, so every rank computes and caches the same latent
entries, and a block in the KV pool's layout is any rank's (engine.runner: a latent cache's
wire reads are rank 0's own, its writes broadcast), so a prefill of any TP size serves a
decode of any other.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pdcluster.engine.attention_layer import unified_mla_attention
from pdcluster.engine.model_config import ModelConfig
from pdcluster.engine.models.base import DecoderForCausalLM, RMSNorm
from pdcluster.engine.models.fused_moe import FusedMoE, Router
from pdcluster.engine.models.llama import GATE_UP_SOURCES, LlamaMLP
from pdcluster.engine.parallel import ColumnParallelLinear, RowParallelLinear, TPGroup, load_shard
from pdcluster.engine.rope import yarn_mscale

#: transformers' DeepseekV2RMSNorm default, which its q_a / kv_a norms keep
_LATENT_NORM_EPS = 1e-6


def rotate_interleaved(positions: torch.Tensor, x: torch.Tensor,
                       cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """RoPE of x [T, H, R] on interleaved pairs (x[2i], x[2i+1]) at `positions` [T], in float32
    and cast back (transformers' DeepSeek `apply_rotary_emb`); cos_sin_cache [max_pos, R] is
    cos | sin of the R/2 frequencies (engine.rope)."""
    cos, sin = cos_sin_cache[positions.to(torch.int64)].chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    pairs = x.to(torch.float32).unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


class KVUpProjection(nn.Module):
    """kv_b_proj's weight [heads/k * (nope + v), kv_lora_rank]: this rank's heads' W_UK and
    W_UV, read as views (never packed: attention absorbs them into the query and output)."""

    def __init__(self, kv_lora_rank: int, rows_per_head: int, num_heads: int, tp: TPGroup
                 ) -> None:
        super().__init__()
        self.tp = tp
        start, end = tp.shard(num_heads, "attention heads")
        self.weight = nn.Parameter(torch.empty((end - start) * rows_per_head, kv_lora_rank))

    def weight_loader(self, param: nn.Parameter, loaded: Any, name: str = "") -> None:
        load_shard(param, loaded, name, 0, self.tp)


class DeepseekV2Attention(nn.Module):
    """MLA over the layer's latent cache (see the module docstring)."""

    def __init__(self, config: ModelConfig, tp: TPGroup, layer: int) -> None:
        super().__init__()
        raw = config.hf_config
        self.layer = layer
        self.num_heads = config.num_attention_heads // tp.world_size
        self.nope = int(raw["qk_nope_head_dim"])
        self.rope = int(raw["qk_rope_head_dim"])
        self.v_dim = int(raw["v_head_dim"])
        self.kv_lora_rank = int(raw["kv_lora_rank"])
        self.scale = (self.nope + self.rope) ** -0.5
        scaling = config.rope_scaling or {}
        if scaling.get("mscale_all_dim"):  # YaRN's temperature on the scores (DeepSeek's)
            self.scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
        hidden, bias = config.hidden_size, bool(raw.get("attention_bias", False))
        q_size = config.num_attention_heads * (self.nope + self.rope)
        q_lora_rank = raw.get("q_lora_rank")
        whole = TPGroup()  # replicated: every rank computes the whole of these
        if q_lora_rank:
            self.q_a_proj = ColumnParallelLinear(hidden, int(q_lora_rank), bias, whole)
            self.q_a_layernorm = RMSNorm(int(q_lora_rank), _LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(int(q_lora_rank), q_size, False, tp)
        else:
            self.q_proj = ColumnParallelLinear(hidden, q_size, False, tp)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(hidden, self.kv_lora_rank + self.rope,
                                                       bias, whole)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = KVUpProjection(self.kv_lora_rank, self.nope + self.v_dim,
                                        config.num_attention_heads, tp)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.v_dim, hidden, bias, tp)

    def _query(self, hidden: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(hidden)
        q_a, _ = self.q_a_layernorm(self.q_a_proj(hidden))
        return self.q_b_proj(q_a)

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        positions, cos_sin_cache = rope
        q = self._query(hidden).view(num_tokens, self.num_heads, self.nope + self.rope)
        q_nope, q_rope = q.split((self.nope, self.rope), dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(hidden).split((self.kv_lora_rank, self.rope), dim=-1)
        c, _ = self.kv_a_layernorm(c.contiguous())
        q_rope = rotate_interleaved(positions, q_rope, cos_sin_cache)
        k_rope = rotate_interleaved(positions, k_rope[:, None, :], cos_sin_cache)
        up = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = up[:, :self.nope], up[:, self.nope:]
        q_latent = torch.einsum("thn,hnl->thl", q_nope, w_uk)
        query = torch.cat((q_latent, q_rope), dim=-1)
        latent = torch.cat((c[:, None, :], k_rope), dim=-1)
        out = unified_mla_attention(query, latent, self.layer, self.scale, self.kv_lora_rank)
        out = torch.einsum("thl,hvl->thv", out, w_uv)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_dim))


def select_experts_grouped(router_logits: torch.Tensor, top_k: int, num_groups: int,
                           topk_groups: int, method: str, scaling: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2 routing (module docstring): router_logits float32 [T, E] -> (weights
    float32 [T, top_k], ids int64 [T, top_k]). Raises ValueError for another `topk_method`."""
    scores = torch.softmax(router_logits, dim=-1)
    if method == "group_limited_greedy":
        num_tokens, num_experts = scores.shape
        group_best = scores.view(num_tokens, num_groups, -1).max(dim=-1).values
        chosen = torch.topk(group_best, topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_best, dtype=torch.bool).scatter_(1, chosen, True)
        scores = scores.masked_fill(~keep.repeat_interleave(num_experts // num_groups, dim=1), 0.0)
    elif method != "greedy":
        raise ValueError(f"topk_method {method!r} is not supported (greedy, group_limited_greedy)")
    weights, ids = torch.topk(scores, top_k, dim=-1)
    return weights * scaling, ids


class DeepseekV2MoE(nn.Module):
    """Routed experts plus the shared ones (HF's `mlp.gate`, `mlp.experts.<e>`,
    `mlp.shared_experts`)."""

    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        raw = config.hf_config
        num_experts, inter = int(raw["n_routed_experts"]), int(raw["moe_intermediate_size"])
        self.top_k = int(raw["num_experts_per_tok"])
        self.num_groups = int(raw.get("n_group") or 1)
        self.topk_groups = int(raw.get("topk_group") or 1)
        self.method = raw.get("topk_method", "greedy")
        self.scaling = float(raw.get("routed_scaling_factor", 1.0))
        self.gate = Router(num_experts, config.hidden_size)
        self.experts = FusedMoE(num_experts, config.hidden_size, inter, tp,
                                (*GATE_UP_SOURCES, "down_proj"))
        shared = int(raw.get("n_shared_experts") or 0)
        self.shared_experts = LlamaMLP(config, tp, inter * shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.nn.functional.linear(x.to(torch.float32), self.gate.weight.to(torch.float32))
        weights, ids = self.route(logits)
        out = self.experts(x, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 router logits [T, E] -> (weights float32 [T, top_k], ids int64 [T, top_k])."""
        return select_experts_grouped(logits, self.top_k, self.num_groups, self.topk_groups,
                                      self.method, self.scaling)


class DeepseekV2ForCausalLM(DecoderForCausalLM):
    """transformers' DeepseekV2ForCausalLM (see the module docstring)."""

    def build_attention(self, config: ModelConfig, tp: TPGroup, layer: int) -> nn.Module:
        return DeepseekV2Attention(config, tp, layer)

    def build_mlp(self, config: ModelConfig, tp: TPGroup, layer: int) -> nn.Module:
        if layer < int(config.hf_config.get("first_k_dense_replace") or 0):
            return LlamaMLP(config, tp)
        return DeepseekV2MoE(config, tp)

    @classmethod
    def tp_split_sizes(cls, config: ModelConfig) -> dict[str, int]:
        """Heads, the dense MLP and the experts split; the latent never does."""
        return {"num_attention_heads": config.num_attention_heads,
                "intermediate_size": config.intermediate_size,
                "moe_intermediate_size": int(config.hf_config["moe_intermediate_size"])}
