"""What a scheduling policy sees and returns, and the estimates every policy shares.

A policy never talks to Ray, the index or a clock: the Conductor gathers one frozen
`RouteContext` per request (prefix hits per prefill instance from the global index, queue
estimates and decode loads from a `LoadSource`) and the policy returns plans. The live gateway
and the simulator build the context the same way from different sources, so both run the same
policy code.

Prefix accounting (block granularity, `block_size` tokens per block): for prefill instance p on
node n, `device_blocks` = leading blocks in p's own device cache (G1), `local_blocks` = leading
blocks in p's G1 or in node n's host/SSD tiers (>= device_blocks), and the context's
`global_blocks` = leading blocks held anywhere alive. Blocks not in p's own G1 are moved into it
at `CostModel.t_load_tokens` (its node's tiers at the ``local`` path's rate, the rest pulled
from other nodes at the ``remote`` path's); at least one prompt token is always computed
(`max_hit_blocks`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Sequence

from pdcluster.engine.core.blocks import num_full_blocks
from pdcluster.kvstore.index import Location
from pdcluster.router.cost_model import CostModel


@dataclass(frozen=True)
class PrefillCandidate:
    instance_id: str
    node_id: str | None
    queue_s: float
    device_blocks: int = 0
    local_blocks: int = 0
    exec_scale: float = 1.0  # live calibration of the cost model for this instance


@dataclass(frozen=True)
class DecodeLoad:
    """A decode instance's load: running (and waiting) sequences, the context tokens they hold,
    and how many KV tokens fit (None: unknown). cached_blocks: the request's leading blocks the
    instance holds in its own device cache (its previous turn ran there), which it would not
    need moved."""

    instance_id: str
    batch_size: int = 0
    context_tokens: int = 0
    capacity_tokens: int | None = None
    cached_blocks: int = 0


@dataclass(frozen=True)
class RouteContext:
    request_id: str
    num_tokens: int
    block_size: int
    global_blocks: int
    prefills: tuple[PrefillCandidate, ...]
    decodes: tuple[DecodeLoad, ...]
    cost: CostModel
    now: float = 0.0

    @property
    def max_hit_blocks(self) -> int:
        return num_full_blocks(max(0, self.num_tokens - 1), self.block_size)


@dataclass(frozen=True)
class PrefillPlan:
    """Where the prompt is computed. cached_blocks: reused blocks (own G1, local tiers and
    pulled); pull: fetch the prefix beyond the local one from another node (Mooncake's global
    cache-aware reuse, which replicates hot blocks); exec_s: predicted busy time of the instance
    (loads + prefill); ttft_s: predicted time to first token (queue + exec_s)."""

    instance_id: str
    cached_blocks: int
    pulled_blocks: int
    exec_s: float
    ttft_s: float

    @property
    def pull(self) -> bool:
        return self.pulled_blocks > 0


@dataclass(frozen=True)
class DecodePlan:
    instance_id: str
    tbt_s: float


def estimate(ctx: RouteContext, cand: PrefillCandidate, cached_blocks: int,
             pulled_blocks: int = 0) -> PrefillPlan:
    """T_queue + T_transfer(blocks not in p's G1) + T_prefill(uncached, cached) on `cand`."""
    cached_blocks = min(cached_blocks, ctx.max_hit_blocks)
    pulled_blocks = min(pulled_blocks, max(0, cached_blocks - cand.local_blocks))
    cached = cached_blocks * ctx.block_size
    local = max(0, min(cached_blocks, cand.local_blocks) - cand.device_blocks)
    remote = max(0, cached_blocks - max(cand.local_blocks, cand.device_blocks))
    exec_s = cand.exec_scale * (
        ctx.cost.t_load_tokens(local * ctx.block_size, remote * ctx.block_size)
        + ctx.cost.t_prefill(ctx.num_tokens - cached, cached))
    return PrefillPlan(cand.instance_id, cached_blocks, pulled_blocks, exec_s,
                       cand.queue_s + exec_s)


def local_plan(ctx: RouteContext, cand: PrefillCandidate) -> PrefillPlan:
    """The plan that reuses only what `cand` holds itself (G1 and its node's tiers)."""
    return estimate(ctx, cand, cand.local_blocks)


def predicted_tbt(cost: CostModel, load: DecodeLoad, prompt_tokens: int) -> float:
    """Step time of `load`'s instance once a sequence of `prompt_tokens` joins it."""
    return cost.t_step(load.batch_size + 1, load.context_tokens + prompt_tokens + 1)


def fits(load: DecodeLoad, prompt_tokens: int) -> bool:
    return load.capacity_tokens is None or \
        load.context_tokens + prompt_tokens + 1 <= load.capacity_tokens


class PrefillPolicy(abc.ABC):
    @abc.abstractmethod
    def select(self, ctx: RouteContext) -> PrefillPlan:
        """Plan for one of `ctx.prefills` (never empty)."""


class DecodePolicy(abc.ABC):
    @abc.abstractmethod
    def select(self, ctx: RouteContext) -> DecodePlan:
        """Plan for one of `ctx.decodes` (never empty)."""


def prefix_hits(locations: Sequence[Sequence[Location]],
                instances: Sequence[tuple[str, str | None]]) -> dict[str, tuple[int, int]]:
    """instance id -> (device_blocks, local_blocks) from `KVIndex.longest_prefix` output.

    `instances`: (instance id, node id or None). A device location counts only for its own
    instance; host and SSD locations count for every instance on their node.
    """
    out: dict[str, tuple[int, int]] = {}
    for instance_id, node_id in instances:
        device = local = 0
        device_run = True
        for locs in locations:
            own_device = any(loc.tier == "device" and loc.instance_id == instance_id
                             for loc in locs)
            if device_run and own_device:
                device += 1
            else:
                device_run = False
            if own_device or (node_id is not None and any(
                    loc.tier != "device" and loc.node_id == node_id for loc in locs)):
                local += 1
            else:
                break
        out[instance_id] = (device, local)
    return out
