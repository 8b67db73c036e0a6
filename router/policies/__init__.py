"""Scheduling policies of the Conductor, by name.

    random           uniformly random prefill and decode instances
    round_robin      each role in turn
    least_loaded     shortest predicted prefill queue; decode with the fewest context tokens
    cache_aware      Mooncake's local cache-aware: min T_queue + T_prefill(own uncached)
    kvcache_centric  Mooncake FAST'25 Algorithm 1 with global prefix pulls (the default)

`make_policy(name)` returns a fresh (prefill, decode) pair; each keeps its own state (a random
stream, a round-robin counter).
"""

from __future__ import annotations

from typing import Callable

from pdcluster.router.policies.base import (DecodeLoad, DecodePlan, DecodePolicy, PrefillCandidate,
                                            PrefillPlan, PrefillPolicy, RouteContext, estimate,
                                            prefix_hits)
from pdcluster.router.policies.cache_aware import (CacheAwarePrefill, KVCacheCentricPrefill,
                                                   TBTDecode)
from pdcluster.router.policies.simple import (LeastLoadedDecode, LeastLoadedPrefill, RandomDecode,
                                              RandomPrefill, RoundRobinDecode, RoundRobinPrefill)

PolicyPair = tuple[PrefillPolicy, DecodePolicy]

POLICIES: dict[str, Callable[[], PolicyPair]] = {
    "random": lambda: (RandomPrefill(), RandomDecode()),
    "round_robin": lambda: (RoundRobinPrefill(), RoundRobinDecode()),
    "least_loaded": lambda: (LeastLoadedPrefill(), LeastLoadedDecode()),
    "cache_aware": lambda: (CacheAwarePrefill(), TBTDecode()),
    "kvcache_centric": lambda: (KVCacheCentricPrefill(), TBTDecode()),
}
DEFAULT_POLICY = "kvcache_centric"


def make_policy(name: str) -> PolicyPair:
    """Raises ValueError for an unknown name."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}")
    return factory()


__all__ = ["DEFAULT_POLICY", "POLICIES", "DecodeLoad", "DecodePlan", "DecodePolicy",
           "PrefillCandidate", "PrefillPlan", "PrefillPolicy", "RouteContext", "estimate",
           "make_policy", "prefix_hits"]
