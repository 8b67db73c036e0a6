"""SLO-aware admission: early rejection, and prediction-based early rejection.

Mooncake (arXiv 2407.00079v1 §6): under overload a request should be refused *before* its
prefill runs, since a prefill whose request the decode side then cannot take is wasted work.

    none        admit everything.
    arrival     reject when the predicted TTFT exceeds the TTFT SLO, or when the decode instance,
                as loaded *now*, plus this request would exceed the TBT SLO or its KV capacity
                (§6.2 "early rejection").
    prediction  the same TTFT test, but the decode test uses the decode load predicted for the
                moment this request's prefill finishes (§6.4): requests routed there that will
                have joined by then are added, and running ones are expected to have left
                as their age and the observed decode times predict (router.policies.forecast;
                no per-request output length is known). Checking against the load at arrival
                instead causes the prefill/decode oscillation of §6.3.

A request the decode side cannot admit within the TBT SLO after its prefill finished has had
its prefill *wasted* (the simulator counts those prefill-seconds).
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass

from pdcluster.router.cost_model import CostModel
from pdcluster.router.policies.base import (DecodeLoad, DecodePlan, PrefillPlan, RouteContext, fits,
                                            predicted_tbt)


@dataclass(frozen=True)
class SLO:
    """ttft_s: time to first token; tbt_s: time between tokens (a decode step)."""

    ttft_s: float = 30.0
    tbt_s: float = 0.1


@dataclass(frozen=True)
class Rejection:
    """reason: a metric label (`ttft_slo`, `tbt_slo`, `decode_kv_full`); retry_after_s: when a
    retry may succeed (the HTTP Retry-After)."""

    reason: str
    message: str
    retry_after_s: float


def decode_rejection(cost: CostModel, load: DecodeLoad, prompt_tokens: int,
                     slo: SLO) -> Rejection | None:
    """Whether `load`'s decode instance can take a sequence of `prompt_tokens` within the
    TBT SLO: its KV must fit and the step time with it must stay <= slo.tbt_s."""
    if not fits(load, prompt_tokens):
        return Rejection("decode_kv_full", f"decode {load.instance_id} holds "
                         f"{load.context_tokens} of {load.capacity_tokens} KV tokens", 1.0)
    tbt = predicted_tbt(cost, load, prompt_tokens)
    if tbt > slo.tbt_s:
        return Rejection("tbt_slo", f"predicted TBT {tbt * 1e3:.1f} ms exceeds the SLO "
                         f"{slo.tbt_s * 1e3:.1f} ms", 1.0)
    return None


def ttft_rejection(plan: PrefillPlan, slo: SLO) -> Rejection | None:
    if plan.ttft_s <= slo.ttft_s:
        return None
    return Rejection("ttft_slo", f"predicted TTFT {plan.ttft_s:.2f} s exceeds the SLO "
                     f"{slo.ttft_s:.2f} s", max(1.0, math.ceil(plan.ttft_s - slo.ttft_s)))


class Admission(abc.ABC):
    name: str

    def __init__(self, slo: SLO) -> None:
        self.slo = slo

    @abc.abstractmethod
    def check(self, ctx: RouteContext, at_join: RouteContext, prefill: PrefillPlan,
              decode: DecodePlan) -> Rejection | None:
        """`ctx`: decode loads as observed now; `at_join`: as forecast for when the prefill
        finishes. None admits the request."""


def _load(ctx: RouteContext, instance_id: str) -> DecodeLoad:
    return next(d for d in ctx.decodes if d.instance_id == instance_id)


class AdmitAll(Admission):
    name = "none"

    def check(self, ctx, at_join, prefill, decode) -> Rejection | None:
        return None


class ArrivalAdmission(Admission):
    name = "arrival"

    def check(self, ctx, at_join, prefill, decode) -> Rejection | None:
        return ttft_rejection(prefill, self.slo) or decode_rejection(
            ctx.cost, _load(ctx, decode.instance_id), ctx.num_tokens, self.slo)


class PredictionAdmission(Admission):
    name = "prediction"

    def check(self, ctx, at_join, prefill, decode) -> Rejection | None:
        return ttft_rejection(prefill, self.slo) or decode_rejection(
            ctx.cost, _load(at_join, decode.instance_id), ctx.num_tokens, self.slo)


ADMISSIONS: dict[str, type[Admission]] = {
    cls.name: cls for cls in (AdmitAll, ArrivalAdmission, PredictionAdmission)}


def make_admission(name: str, slo: SLO) -> Admission:
    """Raises ValueError for an unknown name."""
    if name not in ADMISSIONS:
        raise ValueError(f"unknown admission {name!r}; choose from {sorted(ADMISSIONS)}")
    return ADMISSIONS[name](slo)
