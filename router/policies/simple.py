"""Cache-blind baselines (Mooncake FAST'25 Fig. 9: "random" and "load balancing").

Each reuses whatever prefix its pick holds locally (the engine would), but never chooses by it.
"""

from __future__ import annotations

import itertools
import random

from pdcluster.router.policies.base import (DecodePlan, DecodePolicy, PrefillPlan, PrefillPolicy,
                                            RouteContext, local_plan, predicted_tbt)


def _decode_plan(ctx: RouteContext, index: int) -> DecodePlan:
    load = ctx.decodes[index]
    return DecodePlan(load.instance_id, predicted_tbt(ctx.cost, load, ctx.num_tokens))


class RandomPrefill(PrefillPolicy):
    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def select(self, ctx: RouteContext) -> PrefillPlan:
        return local_plan(ctx, ctx.prefills[self._rng.randrange(len(ctx.prefills))])


class RandomDecode(DecodePolicy):
    def __init__(self, seed: int = 1) -> None:
        self._rng = random.Random(seed)

    def select(self, ctx: RouteContext) -> DecodePlan:
        return _decode_plan(ctx, self._rng.randrange(len(ctx.decodes)))


class RoundRobinPrefill(PrefillPolicy):
    """Cycles through the candidates in registration order."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(self, ctx: RouteContext) -> PrefillPlan:
        return local_plan(ctx, ctx.prefills[next(self._counter) % len(ctx.prefills)])


class RoundRobinDecode(DecodePolicy):
    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(self, ctx: RouteContext) -> DecodePlan:
        return _decode_plan(ctx, next(self._counter) % len(ctx.decodes))


class LeastLoadedPrefill(PrefillPolicy):
    """The shortest predicted queue; ties go to the first registered."""

    def select(self, ctx: RouteContext) -> PrefillPlan:
        best = min(range(len(ctx.prefills)), key=lambda i: (ctx.prefills[i].queue_s, i))
        return local_plan(ctx, ctx.prefills[best])


class LeastLoadedDecode(DecodePolicy):
    """The fewest context tokens, then the smallest batch."""

    def select(self, ctx: RouteContext) -> DecodePlan:
        best = min(range(len(ctx.decodes)),
                   key=lambda i: (ctx.decodes[i].context_tokens, ctx.decodes[i].batch_size, i))
        return _decode_plan(ctx, best)
