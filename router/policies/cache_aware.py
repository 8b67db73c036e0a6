"""Cache-aware policies: Mooncake FAST'25 §4 "local cache-aware" and Algorithm 1
("KVCache-centric", global cache-aware), plus decode selection by predicted TBT.

cache_aware      argmin over prefill instances p of T_queue(p) + T_load + T_prefill(uncached),
                 counting only the prefix p holds itself (its G1 and its node's tiers).
kvcache_centric  Algorithm 1: the same minimum, but p may also pull the longest prefix held
                 anywhere (`global_blocks`) from another node when that prefix is longer than
                 `balancing_threshold` × p's own and T_transfer + T_prefill(rest) beats
                 recomputing. Pulled blocks stay cached on p's node, so a hot prefix ends up
                 replicated where the load sends it (Mooncake Fig. 11: hot-spot replication).
                 Ties (within `tie_s`) go to the instance holding more of the prefix in G1,
                 then to the shorter queue, so equal options keep requests on their cache,
                 then by rendezvous hashing of the request id with the instance's: idle
                 instances share the requests, one that joins while the others are idle
                 gets its part at once, and gateway replicas that see the same loads make
                 the same choice.
"""

from __future__ import annotations

import hashlib

from pdcluster.router.policies.base import (DecodePlan, DecodePolicy, PrefillPlan, PrefillPolicy,
                                            RouteContext, estimate, fits, local_plan, predicted_tbt)

DEFAULT_BALANCING_THRESHOLD = 1.0
TIE_S = 1e-3
#: how much slower (relative predicted step time) a decode holding the request's prefix may be
DEFAULT_AFFINITY_SLACK = 0.25


def _best(ctx: RouteContext, plans: list[PrefillPlan], tie_s: float) -> PrefillPlan:
    lowest = min(p.ttft_s for p in plans)
    near = [i for i, p in enumerate(plans) if p.ttft_s <= lowest + tie_s]
    pick = min(near, key=lambda i: (-ctx.prefills[i].device_blocks, ctx.prefills[i].queue_s,
                                    plans[i].ttft_s,
                                    -_weight(ctx.request_id, ctx.prefills[i].instance_id), i))
    return plans[pick]


def _weight(request_id: str, instance_id: str) -> int:
    """Rendezvous (highest random weight) hashing's weight of an instance for a request: the
    same in every process (Python's str hash is salted per process)."""
    digest = hashlib.blake2b(f"{request_id}|{instance_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class CacheAwarePrefill(PrefillPolicy):
    """Mooncake's local cache-aware scheduling."""

    def __init__(self, tie_s: float = TIE_S) -> None:
        self.tie_s = tie_s

    def select(self, ctx: RouteContext) -> PrefillPlan:
        return _best(ctx, [local_plan(ctx, c) for c in ctx.prefills], self.tie_s)


class KVCacheCentricPrefill(PrefillPolicy):
    """Mooncake FAST'25 Algorithm 1 with global prefix pulls (see the module docstring)."""

    def __init__(self, balancing_threshold: float = DEFAULT_BALANCING_THRESHOLD,
                 tie_s: float = TIE_S) -> None:
        if balancing_threshold < 1.0:
            raise ValueError(f"balancing_threshold must be >= 1, got {balancing_threshold}")
        self.balancing_threshold = balancing_threshold
        self.tie_s = tie_s

    def select(self, ctx: RouteContext) -> PrefillPlan:
        best = min(ctx.global_blocks, ctx.max_hit_blocks)
        plans = []
        for cand in ctx.prefills:
            plan = local_plan(ctx, cand)
            # Alg. 1's "best_len / prefix_len > threshold", written so prefix_len may be 0
            if best > cand.local_blocks and best > self.balancing_threshold * cand.local_blocks:
                pulled = estimate(ctx, cand, best, best - cand.local_blocks)
                if pulled.exec_s < plan.exec_s:
                    plan = pulled
            plans.append(plan)
        return _best(ctx, plans, self.tie_s)


class TBTDecode(DecodePolicy):
    """The decode instance with the lowest predicted step time once the request joins, among
    those with room for its KV (all of them if none has room); ties to the smaller batch.

    Decode affinity: an instance holding the request's leading blocks in its own cache (the
    conversation's previous turn ran there) receives only the rest. It is chosen over the
    fastest when its predicted step time is within `affinity_slack` of the lowest (relative),
    the most cached blocks first: SGLang's cache-aware router keeps requests on their cache
    the same way until the load is too uneven.
    """

    def __init__(self, affinity_slack: float = DEFAULT_AFFINITY_SLACK) -> None:
        if affinity_slack < 0:
            raise ValueError(f"affinity_slack must be >= 0, got {affinity_slack}")
        self.affinity_slack = affinity_slack

    def select(self, ctx: RouteContext) -> DecodePlan:
        loads = [d for d in ctx.decodes if fits(d, ctx.num_tokens)] or list(ctx.decodes)
        tbt = {d.instance_id: predicted_tbt(ctx.cost, d, ctx.num_tokens) for d in loads}
        lowest = min(tbt.values())
        near = [d for d in loads if tbt[d.instance_id] <= lowest * (1 + self.affinity_slack)]
        best = min(near, key=lambda d: (-d.cached_blocks, tbt[d.instance_id], d.batch_size))
        return DecodePlan(best.instance_id, tbt[best.instance_id])
