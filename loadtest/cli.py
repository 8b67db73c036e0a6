"""`pdcluster bench`: load-test an OpenAI-compatible endpoint (pdcluster's or any other).

    pdcluster bench run     [--trace FILE | synthetic flags] [load flags] ...   one run
    pdcluster bench run     --multi-turn [--trace FILE | conversation flags]    conversations
    pdcluster bench sweep   --request-rates 1,2,4 | --max-concurrencies 1,4,16  one run per point
    pdcluster bench compare A.json B.json                                     B/A per metric
    pdcluster bench report  RESULT.json                                       re-draw the report

The same commands also run as `python -m loadtest.cli ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import sys
from pathlib import Path

import aiohttp

from pdcluster.loadtest.client import list_models
from pdcluster.loadtest.compare import compare_rows, format_compare, load_result
from pdcluster.loadtest.options import (Endpoint, add_run_arguments, base_url, build_conversations,
                                        build_workload, client_config, run_config)
from pdcluster.loadtest.runner import rate_label, run_benchmark, save_json, sweep_rows


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `bench` and its subcommands on a `pdcluster` subparsers object."""
    bench = subparsers.add_parser("bench", help="load-test a serving endpoint",
                                  description=__doc__.split("\n")[0])
    sub = bench.add_subparsers(dest="bench_command", required=True)
    run = sub.add_parser("run", help="one benchmark run (trace replay or synthetic load)")
    add_run_arguments(run)
    sweep = sub.add_parser("sweep", help="runs over request rates or concurrencies")
    add_run_arguments(sweep)
    axis = sweep.add_mutually_exclusive_group(required=True)
    axis.add_argument("--request-rates", help="comma-separated, e.g. 1,2,4,inf")
    axis.add_argument("--max-concurrencies", help="comma-separated, e.g. 1,4,16")
    compare = sub.add_parser("compare", help="ratio of every headline metric of two results")
    compare.add_argument("a", help="baseline result JSON")
    compare.add_argument("b", help="result JSON compared against A")
    compare.add_argument("--output", help="also write the table to this Markdown file")
    report = sub.add_parser("report", help="write the Markdown/PNG report of a result JSON")
    report.add_argument("result")
    report.add_argument("--result-dir", help="where to write (default: next to the JSON)")


def run_bench(args: argparse.Namespace) -> int:
    """Run the `bench` subcommand in `args`; returns the exit status."""
    try:
        if args.bench_command == "run":
            return asyncio.run(_run(args))
        if args.bench_command == "sweep":
            return asyncio.run(_sweep(args))
        if args.bench_command == "compare":
            return _compare(args)
        if args.bench_command == "report":
            return _report(args)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"pdcluster bench: {exc}", file=sys.stderr)
        return 2
    return 2


async def _endpoint(args: argparse.Namespace) -> Endpoint:
    """Model id and max_model_len: from the flags, else from /v1/models."""
    if args.model is not None and args.max_model_len is not None:
        return Endpoint(args.model, args.max_model_len)
    async with aiohttp.ClientSession(trust_env=False,
                                     timeout=aiohttp.ClientTimeout(total=30)) as session:
        try:
            models = await list_models(session, base_url(args))
        except RuntimeError:
            if args.model is None:
                raise
            return Endpoint(args.model, args.max_model_len)
    card = next((m for m in models if m.get("id") == args.model), models[0])
    return Endpoint(args.model or card["id"], card.get("max_model_len"))


def _stem(args: argparse.Namespace, load: str) -> str:
    if args.result_filename:
        return Path(args.result_filename).stem
    label = args.label or ("trace" if args.trace else "synthetic")
    if args.multi_turn and not args.label:
        label = f"multiturn-{label}"
    return f"{label}-{load}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"


async def _one(args, endpoint: Endpoint, rate: float | None, concurrency: int | None,
               stem: str, report: bool) -> dict:
    if args.multi_turn:
        return await _conversations(args, endpoint, rate, concurrency, stem, report)
    workload = build_workload(args, endpoint, rate)
    if not workload.requests:
        raise ValueError(f"no request to send ({workload.dropped} dropped as over "
                         "--max-model-len)")
    print(f"{workload.description}: {len(workload.requests)} requests, "
          f"{workload.dropped} dropped", file=sys.stderr)
    metadata = {"label": args.label or stem,
                "request_rate": workload.params.get("request_rate"),
                "burstiness": args.burstiness}
    result = await run_benchmark(workload, client_config(args, endpoint),
                                 run_config(args, concurrency), metadata)
    return _save(args, result, stem, report)


def _save(args: argparse.Namespace, result: dict, stem: str, report: bool) -> dict:
    """Writes the result JSON (and the report), prints the summary; returns `result`."""
    from pdcluster.loadtest.report import format_summary, write_report  # matplotlib: only when used

    out_dir = Path(args.result_dir)
    save_json(result, out_dir / f"{stem}.json")
    print(format_summary(result))
    print(f"result: {out_dir / f'{stem}.json'}", file=sys.stderr)
    if report:
        print(f"report: {write_report(result, out_dir, stem)}", file=sys.stderr)
    return result


async def _conversations(args, endpoint: Endpoint, rate: float | None,
                         concurrency: int | None, stem: str, report: bool) -> dict:
    from pdcluster.loadtest.multiturn import run_conversations

    conversations = build_conversations(args, endpoint, rate)
    if not conversations.conversations:
        raise ValueError(f"no conversation to run ({conversations.dropped_turns} turns "
                         "dropped as over --max-model-len)")
    print(f"{conversations.description}: {len(conversations.conversations)} conversations, "
          f"{conversations.num_turns} turns, {conversations.dropped_turns} dropped",
          file=sys.stderr)
    metadata = {"label": args.label or stem, "request_rate": conversations.params.get(
        "request_rate"), "burstiness": args.burstiness}
    result = await run_conversations(conversations, client_config(args, endpoint),
                                     run_config(args, concurrency), metadata)
    return _save(args, result, stem, report)


async def _run(args: argparse.Namespace) -> int:
    endpoint = await _endpoint(args)
    load = (f"{args.request_rate:g}qps" if args.request_rate is not None
            else ("timed" if args.trace else "infqps"))
    if args.max_concurrency:
        load += f"-concurrency{args.max_concurrency}"
    await _one(args, endpoint, args.request_rate, args.max_concurrency, _stem(args, load),
               not args.no_report)
    return 0


async def _sweep(args: argparse.Namespace) -> int:
    endpoint = await _endpoint(args)
    if args.request_rates:
        axis, values = "request_rate", [float(v) for v in args.request_rates.split(",")]
    else:
        axis, values = "max_concurrency", [int(v) for v in args.max_concurrencies.split(",")]
    stem = _stem(args, f"sweep-{axis}")
    results = []
    for value in values:
        rate = value if axis == "request_rate" else args.request_rate
        concurrency = int(value) if axis == "max_concurrency" else args.max_concurrency
        point = f"{stem}-{axis}{value:g}"
        print(f"--- {axis} = {value} ---", file=sys.stderr)
        result = await _one(args, endpoint, rate, concurrency, point, report=False)
        result[axis] = rate_label(value) if isinstance(value, float) else value
        results.append(result)
    out_dir = Path(args.result_dir)
    save_json({"axis": axis, "points": sweep_rows(results, axis)}, out_dir / f"{stem}.json")
    if not args.no_report:
        from pdcluster.loadtest.report import write_sweep_report

        print(f"report: {write_sweep_report(results, axis, out_dir, stem)}", file=sys.stderr)
    return 0


def _compare(args: argparse.Namespace) -> int:
    table = format_compare(compare_rows(load_result(args.a), load_result(args.b)),
                           args.a, args.b)
    print(table)
    if args.output:
        Path(args.output).write_text(table + "\n", encoding="utf-8")
    return 0


def _report(args: argparse.Namespace) -> int:
    from pdcluster.loadtest.report import format_summary, write_report

    path = Path(args.result)
    result = load_result(path)
    out_dir = Path(args.result_dir) if args.result_dir else path.parent
    print(format_summary(result))
    print(f"report: {write_report(result, out_dir, path.stem)}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m loadtest.cli ARGS` ≡ `pdcluster bench ARGS`."""
    parser = argparse.ArgumentParser(prog="pdcluster")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
