"""`pdcluster plan`: the cheapest cluster that meets the SLOs on a trace, found by simulation.

    pdcluster plan --trace conversation_trace.jsonl --time-scale 0.6 --slo-ttft-s 30 \\
        --slo-tbt-ms 100 --cost-model mooncake-70b --tp 4,8 --target-attainment 0.99

The search (DistServe §4's per-phase placement search, on this simulator):

1. Per tensor-parallel size t (`--tp`; the cost model's figures moved to t by
   `CostModel.at_tensor_parallel`), the fewest prefill instances whose TTFT attainment (TTFT
   <= SLO over all requests) reaches the target with decode ample, and the fewest decode
   instances whose TBT attainment does with prefill ample: TTFT depends on the prefill side
   and TBT on the decode side, and each is monotone in its count, so each is a binary search.
2. Every (prefill t, decode t') pair gives a candidate; they are simulated together,
   cheapest first (devices × hours per 1k requests), until one meets the target on both SLOs
   at once; a candidate that fails is followed by its neighbours with one more instance of
   either role.
3. The next-cheaper configuration is the costliest one below the plan among the candidates
   that failed and the plan less one instance of either role; it is simulated and reported
   with the attainment that fails.

Instance-hours per 1k requests: instances × the trace's arrival span / (requests / 1000), what
the shape costs at the trace's rate (a shape too small for it also runs on after the last
arrival; that is its failing, not its price); GPU-hours count each instance's tensor-parallel
devices. The result JSON holds every run.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from pdcluster.loadtest.simulator.engine import SimConfig, Simulation
from pdcluster.loadtest.simulator.results import summarize
from pdcluster.loadtest.simulator.cli import add_trace_arguments, trace_requests
from pdcluster.router.admission import SLO
from pdcluster.router.cost_model import CostModel, load_cost_model
from pdcluster.router.policies import DEFAULT_POLICY


@dataclass(frozen=True, order=True)
class Shape:
    """A static cluster: counts and tensor-parallel sizes per role."""

    prefill: int
    decode: int
    prefill_tp: int
    decode_tp: int

    @property
    def devices(self) -> int:
        return self.prefill * self.prefill_tp + self.decode * self.decode_tp

    def __str__(self) -> str:
        return (f"{self.prefill} prefill x TP{self.prefill_tp} + "
                f"{self.decode} decode x TP{self.decode_tp}")


@dataclass
class Outcome:
    """One simulated shape: attainments (fractions of all requests) and cost."""

    shape: Shape
    attainment: float
    ttft_attainment: float
    tbt_attainment: float
    instance_hours_per_1k: float
    gpu_hours_per_1k: float
    mean_ttft_s: float
    p90_tbt_ms: float

    def meets(self, target: float) -> bool:
        return self.attainment >= target

    def why_not(self, target: float) -> str:
        misses = [f"{name} attainment {value:.2%} < {target:.2%}" for name, value in
                  (("TTFT", self.ttft_attainment), ("TBT", self.tbt_attainment),
                   ("joint", self.attainment)) if value < target]
        return "; ".join(misses) or "meets the target"

    def row(self) -> dict:
        return {"shape": str(self.shape), **self.shape.__dict__,
                **{k: v for k, v in self.__dict__.items() if k != "shape"}}


class PlanSearch:
    """Runs and caches simulations of static shapes over one trace."""

    def __init__(self, requests, cost: CostModel, slo: SLO, target: float,
                 policy: str = DEFAULT_POLICY, pd_decider: str = "always",
                 tp_efficiency: float = 0.85, log=print) -> None:
        self.requests, self.cost, self.slo, self.target = requests, cost, slo, target
        self.policy, self.pd_decider, self.tp_efficiency = policy, pd_decider, tp_efficiency
        self.log = log
        self.runs: dict[Shape, Outcome] = {}

    def cost_at(self, tp: int) -> CostModel:
        return self.cost.at_tensor_parallel(tp, self.tp_efficiency)

    def run(self, shape: Shape) -> Outcome:
        if shape in self.runs:
            return self.runs[shape]
        prefill_cost, decode_cost = self.cost_at(shape.prefill_tp), self.cost_at(shape.decode_tp)
        # one simulation has one cost model: the prefill side's, with the decode side's step
        # times and KV room (the only decode figures it reads)
        cost = replace(prefill_cost, name=f"{prefill_cost.name}+{decode_cost.name}",
                       step_base_s=decode_cost.step_base_s,
                       step_per_context_token_s=decode_cost.step_per_context_token_s,
                       step_per_sequence_s=decode_cost.step_per_sequence_s,
                       decode_kv_tokens=decode_cost.decode_kv_tokens)
        sim = Simulation(SimConfig(cost, shape.prefill, shape.decode, policy=self.policy,
                                   slo=self.slo, pd_decider=self.pd_decider),
                         self.requests).run()
        summary = summarize(sim, include_samples=False)
        n = max(1, len(sim.results))
        ttft_ok = tbt_ok = 0
        for r in sim.results:
            if r.status != "ok":
                continue
            ttft_ok += r.first_token_s - r.request.arrival_s <= self.slo.ttft_s
            tbt_ok += r.request.output_tokens <= 1 or (r.end_s - r.first_token_s) / (
                r.request.output_tokens - 1) <= self.slo.tbt_s
        span_h = (self.requests[-1].arrival_s - self.requests[0].arrival_s) / 3600
        outcome = Outcome(shape, summary["slo_attainment"], ttft_ok / n, tbt_ok / n,
                          (shape.prefill + shape.decode) * span_h * 1000 / n,
                          shape.devices * span_h * 1000 / n, summary["mean_ttft_ms"] / 1000,
                          summary["p90_tbt_ms"])
        self.runs[shape] = outcome
        self.log(f"  {shape}: attainment {outcome.attainment:.2%} (TTFT "
                 f"{outcome.ttft_attainment:.2%}, TBT {outcome.tbt_attainment:.2%}), "
                 f"{outcome.gpu_hours_per_1k:.3f} GPU-h / 1k")
        return outcome

    def fewest(self, role: str, tp: int, ample: Shape, limit: int) -> int | None:
        """The fewest instances of `role` at `tp` whose own SLO's attainment reaches the
        target, the other role as in `ample`; None if not even `limit` do."""
        def ok(n: int) -> bool:
            shape = (replace(ample, prefill=n, prefill_tp=tp) if role == "prefill"
                     else replace(ample, decode=n, decode_tp=tp))
            out = self.run(shape)
            return (out.ttft_attainment if role == "prefill" else out.tbt_attainment) \
                >= self.target

        if not ok(limit):
            return None
        lo, hi = 1, limit  # ok(hi)
        while lo < hi:
            mid = (lo + hi) // 2
            if ok(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def search(self, tps: list[int], max_prefill: int, max_decode: int) -> dict:
        """{"plan", "next_cheaper"} Outcomes (plan None when nothing in range meets the target),
        and "candidates" tried."""
        top = max(tps)
        ample = Shape(max_prefill, max_decode, top, top)
        fewest_p = {t: self.fewest("prefill", t, ample, max_prefill) for t in tps}
        fewest_d = {t: self.fewest("decode", t, ample, max_decode) for t in tps}
        heap = [(Shape(p, d, tp_p, tp_d).devices, Shape(p, d, tp_p, tp_d))
                for tp_p, p in fewest_p.items() if p for tp_d, d in fewest_d.items() if d]
        heapq.heapify(heap)
        seen, failed, plan = {s for _, s in heap}, [], None
        while heap and plan is None:
            _, shape = heapq.heappop(heap)
            outcome = self.run(shape)
            if outcome.meets(self.target):
                plan = outcome
                break
            failed.append(outcome)
            for more in (replace(shape, prefill=shape.prefill + 1),
                         replace(shape, decode=shape.decode + 1)):
                if more.prefill <= max_prefill and more.decode <= max_decode \
                        and more not in seen:
                    seen.add(more)
                    heapq.heappush(heap, (more.devices, more))
        next_cheaper = None
        if plan is not None:
            s = plan.shape
            below = [o.shape for o in failed] + [
                x for x in (replace(s, prefill=s.prefill - 1), replace(s, decode=s.decode - 1))
                if x.prefill >= 1 and x.decode >= 1]
            below = [x for x in below if x.devices < s.devices]
            if below:
                next_cheaper = self.run(max(below, key=lambda x: (x.devices, x)))
        return {"plan": plan, "next_cheaper": next_cheaper, "fewest_prefill": fewest_p,
                "fewest_decode": fewest_d}


def add_plan_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `plan` on a `pdcluster` subparsers object."""
    p = subparsers.add_parser("plan", help="the cheapest cluster meeting the SLOs on a trace",
                              description=__doc__.split("\n")[0])
    add_trace_arguments(p)
    p.add_argument("--target-attainment", type=float, default=0.99,
                   help="fraction of requests meeting both SLOs (default 0.99)")
    p.add_argument("--tp", default=None,
                   help="tensor-parallel sizes to consider, e.g. 4,8 (default: the cost "
                        "model's own)")
    p.add_argument("--tp-efficiency", type=float, default=0.85,
                   help="fraction of linear speed-up kept per TP doubling (default 0.85)")
    p.add_argument("--max-prefill", type=int, default=32)
    p.add_argument("--max-decode", type=int, default=32)
    p.add_argument("--policy", default=DEFAULT_POLICY)
    p.add_argument("--pd-decider", default="always")
    p.add_argument("--output", default="plan.json", help="result JSON path")


def _describe(label: str, o: Outcome, target: float) -> str:
    return (f"{label}: {o.shape} = {o.shape.devices} devices; "
            f"{o.instance_hours_per_1k:.3f} instance-h, {o.gpu_hours_per_1k:.3f} GPU-h per 1k "
            f"requests; attainment {o.attainment:.2%} (TTFT {o.ttft_attainment:.2%}, TBT "
            f"{o.tbt_attainment:.2%}); mean TTFT {o.mean_ttft_s:.2f} s, p90 TBT "
            f"{o.p90_tbt_ms:.1f} ms" + ("" if o.meets(target) else
                                       f" -- fails: {o.why_not(target)}"))


def run_plan(args: argparse.Namespace) -> int:
    """Run the `plan` subcommand in `args`; returns the exit status (1: no plan in range)."""
    try:
        if not 0 < args.target_attainment <= 1:
            raise ValueError("--target-attainment must be in (0, 1]")
        if args.max_prefill < 1 or args.max_decode < 1:
            raise ValueError("--max-prefill and --max-decode must be >= 1")
        cost = load_cost_model(args.cost_model)
        tps = ([int(t) for t in args.tp.split(",")] if args.tp
               else [cost.tensor_parallel_size])
        for tp in tps:
            cost.at_tensor_parallel(tp, args.tp_efficiency)  # a clear error before any run
        requests = trace_requests(args)
        search = PlanSearch(requests, cost, SLO(args.slo_ttft_s, args.slo_tbt_ms / 1000),
                            args.target_attainment, args.policy, args.pd_decider,
                            args.tp_efficiency, log=lambda m: print(m, file=sys.stderr))
        result = search.search(tps, args.max_prefill, args.max_decode)
    except (ValueError, OSError) as exc:
        print(f"pdcluster plan: {exc}", file=sys.stderr)
        return 2
    plan, cheaper, target = result["plan"], result["next_cheaper"], args.target_attainment
    if plan is None:
        print(f"no configuration up to {args.max_prefill} prefill and {args.max_decode} decode "
              f"instances meets {target:.2%} attainment")
    else:
        print(_describe("plan", plan, target))
        if cheaper is not None:
            print(_describe("next cheaper", cheaper, target))
    out = {"args": {k: v for k, v in vars(args).items()
                    if isinstance(v, (str, int, float, bool, type(None)))},
           "plan": plan.row() if plan else None,
           "next_cheaper": cheaper.row() if cheaper else None,
           "fewest_prefill": result["fewest_prefill"], "fewest_decode": result["fewest_decode"],
           "runs": [o.row() for o in search.runs.values()]}
    path = Path(args.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(f"result: {path}", file=sys.stderr)
    return 0 if plan is not None else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m loadtest.simulator.plan ARGS` ≡ `pdcluster plan ARGS`."""
    parser = argparse.ArgumentParser(prog="pdcluster")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    return run_plan(parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
