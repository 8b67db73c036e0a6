"""What the Conductor reads about instance load, and the decisions it reports back.

A `LoadSource` answers for each instance: its predicted prefill queue, its decode load, its
node; the Conductor tells it every `RouteDecision` and every prefill's end, so a ledger can
predict queues (Mooncake FAST'25 §4). The live cluster's source is
`router.policies.live_loads.LedgerLoads`; the simulator's is its simulated instances
(`loadtest.simulator`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from pdcluster.kvstore.handoff import PrefixPlan
from pdcluster.router.policies.base import DecodeLoad, DecodePlan, PrefillPlan


@dataclass(frozen=True)
class RouteDecision:
    """One admitted request's plans: where it prefills and decodes, its prompt length in
    tokens, and `routed_at` (seconds on the LoadSource's clock). local: the PD decider keeps
    it on its decode instance, which prefills it (the prefill plan was the alternative)."""

    request_id: str
    prefill: PrefillPlan
    decode: DecodePlan
    num_tokens: int
    routed_at: float
    kv_plan: PrefixPlan | None = None  # what the prefill worker reuses, and from where
    local: bool = False


class LoadSource(abc.ABC):
    """The Conductor's view of instance load (live: load reports plus its own ledger; in the
    simulator: the simulated instances)."""

    @abc.abstractmethod
    def now(self) -> float:
        """Seconds on the clock every time here is measured on."""

    @abc.abstractmethod
    def prefill_queue_s(self, instance_id: str) -> float:
        """Predicted seconds until a request routed now to `instance_id` could start."""

    @abc.abstractmethod
    def decode_load(self, instance_id: str) -> DecodeLoad:
        """`instance_id`'s current decode load."""

    def node_of(self, instance_id: str) -> str | None:
        """The node an instance runs on (None: unknown; its node-level cache then is too)."""
        return None

    def exec_scale(self, instance_id: str) -> float:
        """Factor on the cost model's prefill estimate for this instance (live calibration)."""
        return 1.0

    def on_routed(self, decision: RouteDecision) -> None:
        """A request was admitted and routed (ledgers update here)."""

    def on_prefill_done(self, request_id: str, ok: bool = True) -> None:
        """The request's prefill ended (or failed/aborted)."""
