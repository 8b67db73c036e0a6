"""Command-line options of `pdcluster bench run|sweep`, and the configs built from them once,
at the edge. Names follow `vllm bench serve` where it has an equivalent."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from pdcluster.loadtest.arrivals import parse_rate_steps, rate_arrivals, stepped_arrivals
from pdcluster.loadtest.client import ClientConfig
from pdcluster.loadtest.conversations import (ConversationSet, synthetic_conversations,
                                              trace_conversations)
from pdcluster.loadtest.metrics import parse_goodput
from pdcluster.loadtest.prefix import DENOMINATORS
from pdcluster.loadtest.runner import RunConfig, rate_label
from pdcluster.loadtest.synthetic import parse_length, synthetic_workload
from pdcluster.loadtest.tokens import TokenSpace, token_space_from_tokenizer
from pdcluster.loadtest.trace import read_trace, trace_workload
from pdcluster.loadtest.workload import Workload, with_arrivals


def positive_fraction(text: str) -> float:
    """"0.25", "1/64" → float > 0."""
    try:
        value = float(Fraction(text.strip()))
    except (ValueError, ZeroDivisionError) as exc:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from exc
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return value


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by `bench run` and `bench sweep`."""
    g = p.add_argument_group("endpoint")
    g.add_argument("--base-url", help="server URL (default http://HOST:PORT)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default="/v1/completions")
    g.add_argument("--model", help="model id (default: first model of /v1/models)")
    g.add_argument("--metrics-url", help="Prometheus endpoint (default BASE_URL/metrics; "
                                         "'none' to skip scraping)")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="client timeout per request, seconds (default 600)")
    g.add_argument("--header", nargs="*", default=[], metavar="KEY=VALUE")
    g.add_argument("--extra-body", type=json.loads, default=None,
                   help="JSON object merged into every request body")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos so each request generates exactly max_tokens")
    g.add_argument("--stream-usage", action=argparse.BooleanOptionalAction, default=True,
                   help="send stream_options.include_usage (usage chunk at the end)")
    g.add_argument("--return-token-ids", action="store_true",
                   help="send return_token_ids (pdcluster/vLLM extension; token counts from ids)")

    g = p.add_argument_group("workload")
    g.add_argument("--trace", help="Mooncake trace JSONL to replay (default: synthetic load)")
    g.add_argument("--start", type=int, default=0, help="first trace record (0-based)")
    g.add_argument("--num-requests", "--num-prompts", dest="num_requests", type=int,
                   help="requests: trace records from --start (default all), synthetic "
                        "(default 200)")
    g.add_argument("--time-scale", type=positive_fraction, default=1.0,
                   help="multiply the trace's gaps between arrivals (0.5 = twice as fast)")
    g.add_argument("--length-scale", type=positive_fraction, default=1.0,
                   help="scale trace input/output lengths and the 512-token block "
                        "(e.g. 1/64 → 8-token blocks)")
    g.add_argument("--max-model-len", type=int,
                   help="drop requests whose prompt + output exceed it (default: the "
                        "server's max_model_len from /v1/models, if it reports one)")
    g.add_argument("--input-len", default="128", help="synthetic: N, LO:HI or @HISTOGRAM")
    g.add_argument("--output-len", default="32", help="synthetic: N, LO:HI or @HISTOGRAM")
    g.add_argument("--shared-prefix-fraction", type=float, default=0.0,
                   help="synthetic: fraction of each prompt taken from a shared prefix")
    g.add_argument("--num-prefix-groups", type=int, default=1,
                   help="synthetic: number of distinct shared prefixes")
    g.add_argument("--tokenizer", help="HF tokenizer dir or tokenizer.json: the vocabulary "
                                       "prompt ids are drawn from (default: stories260K's)")
    g.add_argument("--seed", type=int, default=0)

    g = p.add_argument_group("multi-turn (--multi-turn)")
    g.add_argument("--multi-turn", action="store_true",
                   help="conversations: each turn sends the history, the server's actual "
                        "reply and a new user message (synthetic, or inferred from --trace)")
    g.add_argument("--num-conversations", type=int, default=32,
                   help="synthetic: conversations (default 32)")
    g.add_argument("--num-turns", type=int, default=4, help="synthetic: turns each (default 4)")
    g.add_argument("--user-len", default="16",
                   help="synthetic: tokens of each later user message: N, LO:HI or @HISTOGRAM")
    g.add_argument("--think-time", type=float, default=1.0,
                   help="synthetic: mean seconds between a reply and the next turn "
                        "(exponential; 0: none; default 1)")

    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=None,
                   help="requests/s (default: inf for synthetic; a trace follows its "
                        "timestamps unless this is given)")
    g.add_argument("--rate-steps", default=None, metavar="RATE:SECONDS,...",
                   help="a load that steps: RATE requests/s for SECONDS, then the next "
                        "(e.g. 1:60,4:60,1:60); sets the number of requests")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of arrival gaps (1 = Poisson)")
    g.add_argument("--max-concurrency", type=int, default=None)

    g = p.add_argument_group("metrics and output")
    g.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (names ttft, tpot, e2el)")
    g.add_argument("--metric-percentiles", default="90,99")
    g.add_argument("--block-size", type=int, default=16,
                   help="server KV block size, for the offline hit ratio")
    g.add_argument("--hit-denominator", choices=DENOMINATORS, default="prompt")
    g.add_argument("--hit-cap-last-token", action=argparse.BooleanOptionalAction, default=True,
                   help="offline hits leave the last prompt token computed (vLLM)")
    g.add_argument("--scrape-interval", type=float, default=2.0,
                   help="seconds between /metrics scrapes for hit ratio over time")
    g.add_argument("--result-dir", default="bench_results")
    g.add_argument("--result-filename", help="result JSON name (default LABEL-LOAD-DATE.json)")
    g.add_argument("--label", help="run label (default: trace or synthetic)")
    g.add_argument("--no-report", action="store_true", help="skip the Markdown/PNG report")
    g.add_argument("--disable-tqdm", action="store_true")


def base_url(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


@dataclass(frozen=True)
class Endpoint:
    """What the CLI learned from the server before building the workload."""

    model: str
    max_model_len: int | None


def client_config(args: argparse.Namespace, endpoint: Endpoint) -> ClientConfig:
    headers = {}
    for item in args.header:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--header {item!r}: expected KEY=VALUE")
        headers[key.strip()] = value.strip()
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    return ClientConfig(api_url=base_url(args) + args.endpoint, model=endpoint.model,
                        timeout_s=args.request_timeout, ignore_eos=args.ignore_eos,
                        stream_usage=args.stream_usage, return_token_ids=args.return_token_ids,
                        temperature=args.temperature, extra_body=args.extra_body or {},
                        headers=headers)


def run_config(args: argparse.Namespace, max_concurrency: int | None) -> RunConfig:
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    metrics_url = args.metrics_url or f"{base_url(args)}/metrics"
    percentiles = tuple(float(p) for p in args.metric_percentiles.split(",") if p.strip())
    return RunConfig(max_concurrency=max_concurrency, goodput_slos_ms=parse_goodput(args.goodput),
                     percentiles=percentiles,
                     metrics_url=None if metrics_url.lower() == "none" else metrics_url,
                     scrape_interval_s=args.scrape_interval, block_size=args.block_size,
                     hit_denominator=args.hit_denominator,
                     hit_cap_last_token=args.hit_cap_last_token, progress=not args.disable_tqdm)


def build_conversations(args: argparse.Namespace, endpoint: Endpoint,
                        request_rate: float | None) -> ConversationSet:
    """The conversations of a --multi-turn run; `request_rate` paces synthetic conversation
    starts (None: all at once) and is refused with a trace, whose timestamps pace it."""
    space = token_space_from_tokenizer(args.tokenizer) if args.tokenizer else TokenSpace()
    max_len = args.max_model_len if args.max_model_len is not None else endpoint.max_model_len
    if args.trace:
        if request_rate is not None:
            raise ValueError("--multi-turn with --trace follows the trace's timestamps "
                             "(scale them with --time-scale), not --request-rate")
        records = read_trace(args.trace, args.start, args.num_requests)
        return trace_conversations(records, space, length_scale=args.length_scale,
                                   time_scale=args.time_scale, max_model_len=max_len,
                                   seed=args.seed, source=args.trace.rsplit("/", 1)[-1])
    rng = np.random.default_rng(args.seed)
    n = args.num_conversations
    rate = math.inf if request_rate is None else request_rate
    conversations = synthetic_conversations(
        n, args.num_turns, parse_length(args.input_len), parse_length(args.user_len),
        parse_length(args.output_len), space, think_time_s=args.think_time,
        starts_s=rate_arrivals(n, rate, args.burstiness, rng),
        shared_prefix_fraction=args.shared_prefix_fraction,
        num_prefix_groups=args.num_prefix_groups, max_model_len=max_len, seed=args.seed)
    conversations.params.update({"request_rate": rate_label(rate),
                                 "burstiness": args.burstiness})
    return conversations


def build_workload(args: argparse.Namespace, endpoint: Endpoint,
                   request_rate: float | None) -> Workload:
    """The requests of one run; `request_rate` None means: trace timestamps, or inf."""
    space = token_space_from_tokenizer(args.tokenizer) if args.tokenizer else TokenSpace()
    max_len = args.max_model_len if args.max_model_len is not None else endpoint.max_model_len
    rng = np.random.default_rng(args.seed)
    steps = (stepped_arrivals(parse_rate_steps(args.rate_steps), args.burstiness, rng)
             if getattr(args, "rate_steps", None) else None)
    if args.trace:
        records = read_trace(args.trace, args.start, args.num_requests)
        workload = trace_workload(records, space, length_scale=args.length_scale,
                                  time_scale=args.time_scale, max_model_len=max_len,
                                  seed=args.seed, source=args.trace.rsplit("/", 1)[-1])
        if steps is not None:
            raise ValueError("--rate-steps paces synthetic load (a trace has its timestamps; "
                             "--time-scale stretches them)")
        if request_rate is not None:
            workload = with_arrivals(workload, rate_arrivals(
                len(workload.requests), request_rate, args.burstiness, rng))
    else:
        n = args.num_requests if args.num_requests is not None else 200
        rate = math.inf if request_rate is None else request_rate
        arrivals = rate_arrivals(n, rate, args.burstiness, rng) if steps is None else steps
        workload = synthetic_workload(
            len(arrivals), parse_length(args.input_len), parse_length(args.output_len), space,
            arrivals_s=arrivals,
            shared_prefix_fraction=args.shared_prefix_fraction,
            num_prefix_groups=args.num_prefix_groups, max_model_len=max_len, seed=args.seed)
    workload.params.update({"request_rate": f"steps {args.rate_steps}" if steps is not None
                            else rate_label(request_rate) if request_rate is not None
                            else ("trace" if args.trace else "inf"),
                            "burstiness": args.burstiness})
    return workload
