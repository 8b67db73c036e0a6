"""The Conductor: picks the prefill and decode instance for every request, or refuses it.

Mooncake FAST'25 §4 (Algorithm 1) and arXiv 2407.00079v1 §6. Per request:

    block keys of the prompt ──▶ global index: longest cached prefix, per prefill instance,
                                 and per decode instance in its own device cache
    LoadSource ──▶ each prefill instance's predicted queue, each decode instance's load
    prefill policy ──▶ PrefillPlan (instance, reused/pulled prefix, predicted TTFT)
    DecodeForecast ──▶ decode loads as predicted for when that prefill finishes
    decode policy ──▶ DecodePlan (instance, predicted TBT)
    PD decider ──▶ disaggregated, or prefilled on the decode instance (router.pd_decider)
    admission ──▶ admit, or raise RequestRejected (HTTP 429 + Retry-After)

Everything the Conductor reads sits behind two small interfaces, a `KVIndex` and a `LoadSource`
(router.load_source), so the live gateway (`router.policies.live_loads`) and the simulator
(`loadtest.simulator`) run this same code. Policies are registered by name in
`router.policies.POLICIES`; `build_live_conductor` assembles the one `pdcluster serve` runs.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass, replace
from typing import AbstractSet, Callable, NamedTuple, Sequence

from pdcluster.engine.core.hashing import block_keys, make_namespace
from pdcluster.kvstore.errors import KVStoreError
from pdcluster.kvstore.handoff import PrefixPlan
from pdcluster.kvstore.index import KVIndex, open_index
from pdcluster.router.admission import SLO, Rejection, make_admission
from pdcluster.router.cost_model import DEFAULT_COST_MODEL, CostModel, load_cost_model
from pdcluster.router.load_source import LoadSource, RouteDecision
from pdcluster.router.pd_decider import PATHS, PDDecider
from pdcluster.router.policies import (DEFAULT_POLICY, PrefillCandidate, RouteContext, make_policy,
                                       prefix_hits)
from pdcluster.router.policies.forecast import DecodeForecast
from pdcluster.router.policies.live_loads import LedgerLoads, StatsPoller
from pdcluster.router.registry import Instance, InstanceRegistry  # noqa: F401 — re-exported

log = logging.getLogger(__name__)


class NoInstanceError(RuntimeError):
    """No live instance of the needed role is registered."""


class RequestRejected(NoInstanceError):
    """Admission control refused the request (answered 429 with Retry-After)."""

    def __init__(self, rejection: Rejection) -> None:
        super().__init__(rejection.message)
        self.rejection = rejection


@dataclass(frozen=True)
class RouteRequest:
    """What the Conductor looks at. block_keys: the prompt's full-block keys when the caller
    has them (the simulator); otherwise they are computed from the tokens (under the
    request's LoRA adapter, `lora_name`, and cache salt)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    cache_salt: str | None = None
    block_keys: tuple[bytes, ...] | None = None
    num_tokens: int | None = None
    lora_name: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return self.num_tokens if self.num_tokens is not None else len(self.prompt_token_ids)


class Route(NamedTuple):
    """Where a request goes (Conductor.route), and what its prefill reuses. local: the PD
    decider keeps it on `decode`, which prefills it too (`prefill` is not used)."""

    prefill: Instance
    decode: Instance
    kv_plan: PrefixPlan | None = None
    local: bool = False


def _without(instances: list[Instance], exclude: AbstractSet[str]) -> list[Instance]:
    """instances minus `exclude`, unless that leaves none."""
    kept = [i for i in instances if i.worker_id not in exclude]
    return kept or instances


class PrefixKeyer:
    """Prompt tokens -> chained block keys, as the workers key them (engine.core.hashing)."""

    def __init__(self, block_size: int, model_name: str) -> None:
        self.block_size = block_size
        self.model_name = model_name

    def __call__(self, request: RouteRequest) -> list[bytes]:
        if request.block_keys is not None:
            return list(request.block_keys)
        namespace = make_namespace(self.model_name, request.cache_salt, request.lora_name)
        return block_keys(request.prompt_token_ids, self.block_size, namespace)


class Conductor:
    """Routes each request to a (prefill, decode) pair, or raises RequestRejected.

    Args:
        registry: the live instances.
        policy: a name in router.policies.POLICIES.
        loads: the LoadSource (default: a ledger of this Conductor's own decisions).
        index: the global KV index (None: no prefix is known anywhere).
        keyer: block keys of a request (needed with an index unless requests carry keys).
        cost_model: a CostModel or a name/file for load_cost_model.
        admission: "none" | "arrival" | "prediction"; slo: the SLOs it enforces.
        pd_decider: a PDDecider or its spec ("always", the default here: every request is
            disaggregated; `pdcluster serve` defaults to "cost").

    Attributes:
        pd_decisions: admitted requests by path, "disaggregated" or "local".
    """

    def __init__(self, registry: InstanceRegistry, policy: str = DEFAULT_POLICY, *,
                 loads: LoadSource | None = None, index: KVIndex | None = None,
                 keyer: Callable[[RouteRequest], list[bytes]] | None = None,
                 cost_model: CostModel | str = DEFAULT_COST_MODEL, admission: str = "none",
                 slo: SLO = SLO(), forecast: DecodeForecast | None = None,
                 pd_decider: PDDecider | str = "always") -> None:
        self.registry = registry
        self.policy_name = policy
        self._prefill_policy, self._decode_policy = make_policy(policy)
        self.cost = cost_model if isinstance(cost_model, CostModel) else \
            load_cost_model(cost_model)
        self.admission = make_admission(admission, slo)
        self.slo = slo
        self.loads = loads if loads is not None else LedgerLoads(self.cost)
        self.index = index
        self.keyer = keyer
        self.block_size = getattr(keyer, "block_size", 16)
        self.forecast = forecast or DecodeForecast(self.cost)
        self.pd_decider = (pd_decider if isinstance(pd_decider, PDDecider)
                           else PDDecider.parse(pd_decider))
        self.pd_decisions: Counter[str] = Counter({path: 0 for path in PATHS})
        self._lock = threading.Lock()

    def route_decode(self, request: RouteRequest, exclude: AbstractSet[str] = frozenset()
                     ) -> Instance:
        """A decode instance alone (colocated mode), not one of `exclude` while another is
        live; the decode policy sees which instances hold the prompt's prefix. Raises
        NoInstanceError."""
        decodes = _without(self.registry.by_role("decode"), exclude)
        if not decodes:
            raise NoInstanceError("no decode instance is live")
        found = self._longest_prefix(self._keys(request))
        with self._lock:
            ctx = self._context(request, [], [d.worker_id for d in decodes], [], found=found)
            plan = self._decode_policy.select(ctx)
        return next(d for d in decodes if d.worker_id == plan.instance_id)

    def route(self, request: RouteRequest, exclude: AbstractSet[str] = frozenset()) -> Route:
        """Returns the Route (prefill, decode, the prefix plan for the prefill), avoiding the
        instance ids in `exclude` (ones that just failed the request) where another of the
        role is live. Raises NoInstanceError when a role has no live instance and
        RequestRejected when admission refuses the request."""
        prefills = _without(self.registry.by_role("prefill"), exclude)
        decodes = _without(self.registry.by_role("decode"), exclude)
        if not prefills or not decodes:
            raise NoInstanceError(f"{len(prefills)} prefill and {len(decodes)} decode "
                                  "instances are live")
        decision = self.decide(request, [p.worker_id for p in prefills],
                               [d.worker_id for d in decodes])
        return Route(next(p for p in prefills if p.worker_id == decision.prefill.instance_id),
                     next(d for d in decodes if d.worker_id == decision.decode.instance_id),
                     decision.kv_plan, decision.local)

    def decide(self, request: RouteRequest, prefill_ids: Sequence[str],
               decode_ids: Sequence[str]) -> RouteDecision:
        """The routing decision over the given instance ids (the simulator calls this
        directly). Raises RequestRejected; records an admitted decision in the ledgers."""
        keys = self._keys(request)
        found = self._longest_prefix(keys)
        locations = _prefill_visible(found, decode_ids)
        with self._lock:
            now = self.loads.now()
            ctx = self._context(request, prefill_ids, decode_ids, locations, now, found)
            prefill = self._prefill_policy.select(ctx)
            join_at = now + prefill.ttft_s
            self.forecast.expire(now)
            at_join = replace(ctx, decodes=self.forecast.loads_at(ctx.decodes, now, join_at))
            decode = self._decode_policy.select(at_join)
            rejection = self.admission.check(ctx, at_join, prefill, decode)
            if rejection is not None:
                raise RequestRejected(rejection)
            load = next(d for d in at_join.decodes if d.instance_id == decode.instance_id)
            local = self.pd_decider.local(at_join, prefill, load, self.slo)
            kv_plan = PrefixPlan(tuple(keys), tuple(tuple(locs) for locs in locations),
                                 prefill.cached_blocks) if keys and not local else None
            decision = RouteDecision(request.request_id, prefill, decode, ctx.num_tokens, now,
                                     kv_plan, local)
            # a local prefill starts on the decode now and takes no prefill instance's time
            self.forecast.add(request.request_id, decode.instance_id, now if local else join_at,
                              ctx.num_tokens)
            if not local:
                self.loads.on_routed(decision)
            self.pd_decisions[PATHS[local]] += 1
        return decision

    def prefill_done(self, request_id: str, ok: bool = True) -> None:
        """Feedback from the pipeline: the request's prefill ended (ok=False: failed)."""
        self.loads.on_prefill_done(request_id, ok)
        if not ok:
            self.forecast.discard(request_id)

    def _keys(self, request: RouteRequest) -> list[bytes]:
        if self.keyer is None:
            return list(request.block_keys or ())
        return self.keyer(request)

    def _longest_prefix(self, keys: list[bytes]) -> list:
        if self.index is None or not keys:
            return []
        try:
            return self.index.longest_prefix(keys)
        except KVStoreError as exc:  # the index is a hint: route without it
            log.warning("global index unavailable, routing without prefixes: %s", exc)
            return []

    def _context(self, request: RouteRequest, prefill_ids: Sequence[str],
                 decode_ids: Sequence[str], locations: list, now: float | None = None,
                 found: list | None = None) -> RouteContext:
        """`locations`: what prefills can load from; `found`: every location of the
        prompt's leading blocks, decode instances' device caches included."""
        nodes = [(p, self.loads.node_of(p)) for p in prefill_ids]
        hits = prefix_hits(locations, nodes) if locations else {}
        prefills = tuple(PrefillCandidate(p, node, self.loads.prefill_queue_s(p),
                                          *hits.get(p, (0, 0)), self.loads.exec_scale(p))
                         for p, node in nodes)
        held = prefix_hits(found, [(d, None) for d in decode_ids]) if found else {}
        decodes = tuple(replace(self.loads.decode_load(d),
                                cached_blocks=held.get(d, (0, 0))[0]) for d in decode_ids)
        return RouteContext(request.request_id, request.num_prompt_tokens, self.block_size,
                            len(locations), prefills, decodes, self.cost,
                            self.loads.now() if now is None else now)


def _prefill_visible(locations: list, decode_ids: Sequence[str]) -> list:
    """The index's locations without decode instances' device caches, which no prefill
    loads from, cut at the first block left with none."""
    decodes = set(decode_ids)
    visible = []
    for locs in locations:
        kept = [loc for loc in locs if not (loc.tier == "device" and loc.instance_id in decodes)]
        if not kept:
            break
        visible.append(kept)
    return visible


def build_live_conductor(registry: InstanceRegistry, *, policy: str, admission: str,
                         slo: SLO, cost_model: CostModel | str, block_size: int,
                         model_name: str, index_url: str | None,
                         poll_interval_s: float = 0.25,
                         pd_decider: PDDecider | str = "always",
                         share_decisions: bool = True
                         ) -> tuple[Conductor, StatsPoller]:
    """The Conductor `pdcluster serve` runs: the global index at `index_url` (None: none),
    block keys as the workers compute them, LedgerLoads fed by a started StatsPoller and,
    with `share_decisions`, by the other gateways' routing decisions (router.decision_board,
    beside the index). Returns (conductor, poller); stop the poller at shutdown."""
    cost = cost_model if isinstance(cost_model, CostModel) else load_cost_model(cost_model)
    loads = LedgerLoads(cost, block_size)
    conductor = Conductor(registry, policy, loads=loads,
                          index=open_index(index_url) if index_url else None,
                          keyer=PrefixKeyer(block_size, model_name), cost_model=cost,
                          admission=admission, slo=slo, pd_decider=pd_decider)
    board = None
    if share_decisions:
        from pdcluster.router.decision_board import open_board

        board = open_board(index_url, lambda d: loads.add_peer_decision(d.instance_id,
                                                                        d.exec_s))
        loads.publish = board.publish
    poller = StatsPoller(registry, loads, poll_interval_s, board=board)
    poller.poll_once()
    return conductor, poller.start()
