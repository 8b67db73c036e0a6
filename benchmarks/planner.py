"""The SLO planner against static clusters, in the simulator, on a rate that doubles and halves.

Replays Mooncake's conversation trace (`--time-scale`, then `--rate-profile`: by default the
middle third twice as fast) once with the planner (router.planner through
loadtest.simulator.autoscale, `--autoscale`, starting at `--start P,D`) and once per static
split of the planner's peak size (P + D = max prefill + max decode), and prints for each the
SLO attainment, instance-hours, goodput (good requests) per instance-hour, and the planner's
ratio to the best static split. Simulated time; the same cost model and SLOs for all.

    python benchmarks/planner.py
    python benchmarks/planner.py --autoscale prefill=1:16,decode=1:4 --start 8,2 \\
        --time-scale 0.6 --rate-profile 1,2,1 --output planner.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))

from pdcluster.loadtest.simulator.engine import SimConfig, Simulation  # noqa: E402
from pdcluster.loadtest.simulator.results import summarize  # noqa: E402
from pdcluster.loadtest.simulator.workload import load_requests, vary_rate  # noqa: E402
from pdcluster.router.admission import SLO  # noqa: E402
from pdcluster.router.cost_model import load_cost_model  # noqa: E402
from pdcluster.router.planner import AutoscaleRange  # noqa: E402

TRACE = REPO.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"


def run(config: SimConfig, requests) -> dict:
    began = time.perf_counter()
    s = summarize(Simulation(config, requests).run(), include_samples=False)
    return {"prefill": config.prefill_instances, "decode": config.decode_instances,
            "attainment": s["slo_attainment"], "mean_ttft_s": s["mean_ttft_ms"] / 1000,
            "instance_hours": sum(s["instance_hours"].values()),
            "goodput_per_instance_hour": s["goodput_per_instance_hour"],
            "decisions": s.get("autoscale", {}).get("decisions", []),
            "wall_s": time.perf_counter() - began}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--time-scale", type=float, default=0.6)
    p.add_argument("--rate-profile", default="1,2,1")
    p.add_argument("--autoscale", default="prefill=1:16,decode=1:4")
    p.add_argument("--start", default="8,2", help="the planner's counts at start: P,D")
    p.add_argument("--cost-model", default="mooncake-70b")
    p.add_argument("--slo-ttft-s", type=float, default=30.0)
    p.add_argument("--slo-tbt-ms", type=float, default=100.0)
    p.add_argument("--planner-interval-s", type=float, default=30.0)
    p.add_argument("--instance-startup-s", type=float, default=60.0)
    p.add_argument("--output", help="write every run as JSON here")
    args = p.parse_args()
    scale = AutoscaleRange.parse(args.autoscale)
    requests = vary_rate(load_requests(args.trace, args.time_scale),
                         [float(f) for f in args.rate_profile.split(",")])
    base = dict(cost=load_cost_model(args.cost_model),
                slo=SLO(args.slo_ttft_s, args.slo_tbt_ms / 1000))
    start_p, start_d = (int(x) for x in args.start.split(","))
    planner = run(SimConfig(prefill_instances=start_p, decode_instances=start_d,
                            autoscale=scale, planner_interval_s=args.planner_interval_s,
                            instance_startup_s=args.instance_startup_s, **base), requests)
    peak = scale.prefill.maximum + scale.decode.maximum
    static = [run(SimConfig(prefill_instances=n, decode_instances=peak - n, **base), requests)
              for n in range(1, peak)]
    best = max(static, key=lambda r: r["goodput_per_instance_hour"])
    print(f"{len(requests)} requests, --time-scale {args.time_scale}, rate x "
          f"{args.rate_profile}, {args.cost_model}, SLO TTFT {args.slo_ttft_s:g} s / TBT "
          f"{args.slo_tbt_ms:g} ms; planner {scale} from {args.start}, every "
          f"{args.planner_interval_s:g} s, start-up {args.instance_startup_s:g} s\n")
    print("| cluster | attainment | mean TTFT (s) | instance-hours | good req / instance-hour |")
    print("|---|---:|---:|---:|---:|")
    ups = sum(d["delta"] > 0 for d in planner["decisions"])
    downs = len(planner["decisions"]) - ups
    rows = [(f"planner ({ups} up, {downs} down)", planner)] + [
        (f"static {r['prefill']}P + {r['decode']}D" + (" (best)" if r is best else ""), r)
        for r in static]
    for name, r in rows:
        print(f"| {name} | {r['attainment']:.2%} | {r['mean_ttft_s']:.2f} | "
              f"{r['instance_hours']:.2f} | {r['goodput_per_instance_hour']:.1f} |")
    ratio = planner["goodput_per_instance_hour"] / best["goodput_per_instance_hour"]
    print(f"\nplanner / best static of peak size {peak}: {ratio:.2f}x goodput per "
          f"instance-hour")
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "planner": planner,
                                                 "static": static, "ratio": ratio}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
