"""`pdcluster simulate`: replay a trace on a simulated cluster under the real Conductor.

    pdcluster simulate --trace conversation_trace.jsonl --prefill-instances 8 \\
        --decode-instances 8 --time-scale 0.6 --policy all --output sim.json

`--policy all` runs every policy on the same trace and writes
{"policies": {name: {"mean_ttft_ms", "p99_ttft_ms", "slo_attainment", "goodput",
"hit_ratio", ...}}, "runs": {name: full summary}}; `--admission all` does the same over
admission modes under "admissions". One run writes its full summary (results.summarize).

`--pd-decider all` runs always, never and cost (router.pd_decider) under "pd_deciders" the same
way, with each decider's `local_fraction` (requests prefilled on their decode instance).

`--autoscale prefill=MIN:MAX,decode=MIN:MAX` runs the SLO planner (router.planner, through
loadtest.simulator.autoscale) every `--planner-interval-s`; the summary then has its
decisions under "autoscale", and every run has its instance-hours and goodput per
instance-hour. `--rate-profile 1,2,1` doubles the arrival rate over the trace's middle third.

`--measured-transfer FILE` (a `pdcluster profile --kv-transfer` file) runs the same again
with the cost model's transfer figures replaced by the file's measured ones per path (the
``pd`` path: `--kv-transfer`'s connector), and writes both under "assumed" and "measured",
with each one's ranking (best SLO attainment first, then lowest mean TTFT).
Plots go next to --output unless --no-plots. The same command also runs as
`python -m loadtest.simulator.cli ...`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pdcluster.loadtest.simulator.engine import REPLICA_INPUTS, SimConfig, Simulation
from pdcluster.loadtest.simulator.results import POLICY_KEYS, policy_row, summarize
from pdcluster.loadtest.simulator.workload import load_requests, vary_rate
from pdcluster.router.admission import ADMISSIONS, SLO
from pdcluster.router.cost_model import DEFAULT_COST_MODEL, CostModel, load_cost_model
from pdcluster.router.pd_decider import PDDecider
from pdcluster.router.planner import AutoscaleRange
from pdcluster.router.policies import DEFAULT_POLICY, POLICIES

_TABLE_KEYS = (*POLICY_KEYS, "mean_tbt_ms", "rejected", "wasted_prefill_s", "local_fraction")
PD_DECIDERS = ("always", "never", "cost")


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    """The trace, its selection and pace, the cost model and the SLOs (simulate, plan)."""
    p.add_argument("--trace", required=True, help="Mooncake-format trace (JSONL)")
    p.add_argument("--start", type=int, default=0, help="first record (0-based)")
    p.add_argument("--num-requests", type=int, help="records to replay (default: all)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply the trace's inter-arrival gaps (0.5 = twice as fast)")
    p.add_argument("--rate-profile",
                   help="multiply the arrival rate over equal spans of the trace, e.g. 1,2,1")
    p.add_argument("--cost-model", default=DEFAULT_COST_MODEL,
                   help="built-in name or a file from `pdcluster profile`")
    p.add_argument("--slo-ttft-s", type=float, default=30.0)
    p.add_argument("--slo-tbt-ms", type=float, default=100.0)


def trace_requests(args: argparse.Namespace) -> list:
    """The SimRequests `add_trace_arguments`' flags select. Raises ValueError for an empty
    selection or a bad profile, OSError for an unreadable trace."""
    requests = load_requests(args.trace, args.time_scale, args.start, args.num_requests)
    if args.rate_profile:
        requests = vary_rate(requests, [float(f) for f in args.rate_profile.split(",")])
    if not requests:
        raise ValueError("the trace selection holds no request")
    return requests


def add_simulate_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `simulate` on a `pdcluster` subparsers object."""
    p = subparsers.add_parser("simulate", help="trace-driven simulation of a cluster",
                              description=__doc__.split("\n")[0])
    add_trace_arguments(p)
    p.add_argument("--prefill-instances", type=int, default=8)
    p.add_argument("--decode-instances", type=int, default=8)
    p.add_argument("--policy", default=DEFAULT_POLICY,
                   help=f"{' | '.join(POLICIES)} | all (default {DEFAULT_POLICY})")
    p.add_argument("--admission", default="none", help=f"{' | '.join(ADMISSIONS)} | all")
    p.add_argument("--pd-decider", default="always",
                   help="always (default) | never | cost | threshold:N | all (the first three)")
    p.add_argument("--device-cache-tokens", type=int, default=0,
                   help="G1 prefix cache per prefill instance (default 0)")
    p.add_argument("--dram-cache-tokens", type=int,
                   help="G2 host-DRAM cache per prefill node (default: the cost model's)")
    p.add_argument("--ssd-cache-tokens", type=int, default=0, help="G3 per prefill node")
    p.add_argument("--decode-kv-tokens", type=int,
                   help="KV capacity per decode instance (default: the cost model's)")
    p.add_argument("--sample-interval-s", type=float, default=10.0,
                   help="simulated seconds between load samples")
    p.add_argument("--output", default="simulation.json", help="result JSON path")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--measured-transfer",
                   help="a `pdcluster profile --kv-transfer` file: also run with its measured "
                        "transfer figures and compare the rankings")
    p.add_argument("--conductors", type=int, default=1,
                   help="gateway replicas routing in turn (request i to replica i mod n)")
    p.add_argument("--conductor-inputs", default="shared", choices=REPLICA_INPUTS,
                   help="with several, what each knows of the prefill queues: private (its "
                        "own decisions), reports (plus the workers' queue reports every "
                        "0.25 s) or shared (plus every replica's decisions, as soon as made)")
    p.add_argument("--autoscale", metavar="prefill=MIN:MAX,decode=MIN:MAX",
                   help="the SLO planner (router/planner.py) scales each role within the "
                        "range; --prefill/--decode-instances are the counts at start")
    p.add_argument("--planner-interval-s", type=float, default=30.0,
                   help="simulated seconds between two planner decisions")
    p.add_argument("--instance-startup-s", type=float, default=60.0,
                   help="simulated seconds from an instance's start to its first request")
    p.add_argument("--kv-transfer", default="grpc",
                   help="the connector whose measured prefill -> decode figures apply "
                        "(default grpc)")


def _config(args: argparse.Namespace, policy: str, admission: str,
            cost: CostModel | None = None, pd_decider: str | None = None) -> SimConfig:
    if args.prefill_instances < 1 or args.decode_instances < 1 or args.conductors < 1:
        raise ValueError("--prefill-instances, --decode-instances and --conductors must be "
                         ">= 1")
    return SimConfig(cost=cost or load_cost_model(args.cost_model),
                     prefill_instances=args.prefill_instances,
                     decode_instances=args.decode_instances, policy=policy,
                     admission=admission, slo=SLO(args.slo_ttft_s, args.slo_tbt_ms / 1000),
                     device_cache_tokens=args.device_cache_tokens,
                     dram_cache_tokens=args.dram_cache_tokens,
                     ssd_cache_tokens=args.ssd_cache_tokens,
                     decode_kv_tokens=args.decode_kv_tokens,
                     sample_interval_s=args.sample_interval_s,
                     pd_decider=pd_decider or args.pd_decider,
                     conductors=args.conductors, inputs=args.conductor_inputs,
                     autoscale=AutoscaleRange.parse(args.autoscale) if args.autoscale else None,
                     planner_interval_s=args.planner_interval_s,
                     instance_startup_s=args.instance_startup_s)


def _one(config: SimConfig, requests) -> tuple[dict, list[float]]:
    began = time.perf_counter()
    sim = Simulation(config, requests).run()
    summary = summarize(sim)
    summary["wall_s"] = time.perf_counter() - began
    ttfts = [r.first_token_s - r.request.arrival_s for r in sim.results if r.status == "ok"]
    print(f"{config.policy}/{config.admission}/{config.pd_decider}: {len(requests)} requests "
          f"simulated in "
          f"{summary['wall_s']:.1f} s", file=sys.stderr)
    return summary, ttfts


def _cell(key: str, value) -> str:
    if key.endswith("_ms") or key.endswith("_s"):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.1f}"
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def format_table(rows: dict[str, dict], axis: str) -> str:
    """A Markdown table: one row per run."""
    lines = [f"| {axis} | " + " | ".join(_TABLE_KEYS) + " |",
             "|---" + "|---:" * len(_TABLE_KEYS) + "|"]
    for name, row in rows.items():
        lines.append(f"| {name} | " + " | ".join(_cell(k, row[k]) for k in _TABLE_KEYS) + " |")
    return "\n".join(lines)


def ranking(rows: dict[str, dict]) -> list[str]:
    """Run names, best first: highest SLO attainment, then lowest mean TTFT."""
    return sorted(rows, key=lambda n: (-rows[n]["slo_attainment"], rows[n]["mean_ttft_ms"]))


def _compare_measured(args: argparse.Namespace, policies: list[str], admissions: list[str],
                      requests, assumed: dict[str, dict], axis: str) -> dict:
    """The runs again under the measured transfer figures; {"assumed": ..., "measured": ...}
    with each one's rows and ranking."""
    measured_paths = load_cost_model(args.measured_transfer).transfer_paths
    if not measured_paths:
        raise ValueError(f"{args.measured_transfer} has no measured transfer paths: write it "
                         f"with `pdcluster profile --kv-transfer ...`")
    cost = load_cost_model(args.cost_model).with_transfer_paths(measured_paths) \
        .for_connector(args.kv_transfer)
    measured = {}
    for config in (_config(args, p, a, cost) for p in policies for a in admissions):
        name = config.policy if len(policies) > 1 else config.admission
        measured[name] = policy_row(_one(config, requests)[0])
    out = {"paths": cost.transfer_paths,
           "assumed": {axis: assumed, "ranking": ranking(assumed)},
           "measured": {axis: measured, "ranking": ranking(measured)}}
    print(f"\nwith the measured transfer figures ({args.measured_transfer}, "
          f"pd = {args.kv_transfer}):")
    print(format_table(measured, "policy" if axis == "policies" else "admission"))
    print(f"ranking, assumed:  {' > '.join(out['assumed']['ranking'])}")
    print(f"ranking, measured: {' > '.join(out['measured']['ranking'])}")
    return out


def run_simulate(args: argparse.Namespace) -> int:
    """Run the `simulate` subcommand in `args`; returns the exit status."""
    try:
        policies = list(POLICIES) if args.policy == "all" else [args.policy]
        admissions = list(ADMISSIONS) if args.admission == "all" else [args.admission]
        deciders = list(PD_DECIDERS) if args.pd_decider == "all" else [args.pd_decider]
        if sum(len(x) > 1 for x in (policies, admissions, deciders)) > 1:
            raise ValueError("only one of --policy all, --admission all and --pd-decider all")
        for decider in deciders:
            PDDecider.parse(decider)
        configs = [_config(args, p, a, pd_decider=d)
                   for p in policies for a in admissions for d in deciders]
        if args.measured_transfer and len(deciders) > 1:
            raise ValueError("--measured-transfer compares policies or admissions, not "
                             "--pd-decider all")
        if args.measured_transfer and len(configs) == 1:
            raise ValueError("--measured-transfer compares rankings: give --policy all or "
                             "--admission all")
        requests = trace_requests(args)
        out = Path(args.output)
        stem = out.stem
        runs = {}
        ttfts = {}
        axis, label = (("policies", "policy") if len(policies) > 1
                       else ("pd_deciders", "pd decider") if len(deciders) > 1
                       else ("admissions", "admission"))
        for config in configs:
            name = {"policies": config.policy, "pd_deciders": config.pd_decider,
                    "admissions": config.admission}[axis]
            runs[name], ttfts[name] = _one(config, requests)
        if len(configs) == 1:
            result = next(iter(runs.values()))
        else:
            result = {axis: {n: policy_row(s) for n, s in runs.items()},
                      "runs": {n: {k: v for k, v in s.items() if k != "samples"}
                               for n, s in runs.items()}}
            print(format_table(result[axis], label))
            if args.measured_transfer:
                result["transfer_comparison"] = _compare_measured(
                    args, policies, admissions, requests, result[axis], axis)
        result["args"] = {k: v for k, v in vars(args).items()
                          if isinstance(v, (str, int, float, bool, type(None)))}
        result["trace"] = {"path": str(args.trace), "start": args.start,
                           "num_requests": len(requests), "time_scale": args.time_scale}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(f"result: {out}", file=sys.stderr)
        if not args.no_plots:
            from pdcluster.loadtest.simulator.plots import write_compare_plot, write_run_plots

            if len(configs) == 1:
                write_run_plots(result, next(iter(ttfts.values())), out.parent, stem)
            else:
                write_compare_plot(ttfts, args.slo_ttft_s, out.parent, stem)
    except (ValueError, OSError) as exc:
        print(f"pdcluster simulate: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m loadtest.simulator.cli ARGS` ≡ `pdcluster simulate ARGS`."""
    parser = argparse.ArgumentParser(prog="pdcluster")
    add_simulate_parser(parser.add_subparsers(dest="command", required=True))
    return run_simulate(parser.parse_args(["simulate", *(sys.argv[1:] if argv is None
                                                          else argv)]))


if __name__ == "__main__":
    sys.exit(main())
