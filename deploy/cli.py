"""The `pdcluster` command line.

    pdcluster serve [--model PATH] [--host H] [--port P] [--prefill-instances N]
                    [--decode-instances M] [--address ADDR] [--config FILE] ...

    pdcluster cluster up|down|status ...           (workers that outlive their gateways)
    pdcluster gateway [--port P] ...               (a gateway attached to a running cluster)
    pdcluster bench run|sweep|compare|report ...   (load tests; see loadtest/README.md)
    pdcluster simulate --trace FILE ...             (trace-driven cluster simulation)
    pdcluster plan --trace FILE --slo-ttft-s ...    (the cheapest cluster meeting SLOs)
    pdcluster profile ...                           (fit a cost model on the real engine)

With no flags, `serve` serves the bundled stories260K model on 127.0.0.1:8000 on a local Ray with
one prefill and one decode actor, and needs no other service.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdcluster.deploy.config import ServeConfig

log = logging.getLogger(__name__)


def _gib(value: str) -> int:
    """A size in GiB (float) as bytes."""
    return int(float(value) * (1 << 30))


def _seconds(value: str) -> float:
    """A positive number of seconds (argparse's usage error otherwise)."""
    with contextlib.suppress(ValueError):
        if float(value) > 0:  # false for nan too
            return float(value)
    raise argparse.ArgumentTypeError(f"{value}: not a positive number of seconds")


# (flag, config path, type, help) — flags follow vLLM's names where vLLM has one. The help
# never states a default: `pdcluster serve --help` appends ServeConfig's (_ServeHelpFormatter).
_SERVE_FLAGS = [
    ("--model", "engine.model", str, "HF model directory whose config.json names a served "
                                      "architecture (README's model table)"),
    ("--served-model-name", "served_model_name", str, "model id in the API"),
    ("--host", "host", str, "gateway bind address"),
    ("--port", "port", int, "gateway port"),
    ("--prefill-instances", "prefill_instances", int, "prefill instances"),
    ("--decode-instances", "decode_instances", int, "decode instances"),
    ("--tensor-parallel-size", "engine.tensor_parallel_size", int,
     "tensor parallel size of every prefill and decode instance"),
    ("--prefill-tp", "prefill_tp", int, "tensor parallel size of each prefill instance"),
    ("--decode-tp", "decode_tp", int, "tensor parallel size of each decode instance"),
    ("--address", "address", str, "join this Ray cluster (e.g. auto) instead of starting a "
                                  "local one"),
    ("--ray-namespace", "ray_namespace", str,
     "the deployment's Ray namespace: where its named actors are"),
    ("--block-size", "engine.block_size", int, "tokens per KV block"),
    ("--dtype", "engine.dtype", str, "float32 | bfloat16 | float16"),
    ("--max-model-len", "engine.max_model_len", int, "context length (prompt + max_tokens)"),
    ("--num-kv-blocks", "engine.num_kv_blocks", int, "paged-cache blocks per worker"),
    ("--torch-threads", "engine.torch_threads", int, "torch threads per worker actor"),
    ("--kernel-backend", "engine.kernel_backend", str,
     "auto (Triton on CUDA, torch elsewhere) | triton (interpreted on CPU) | torch"),
    ("--preemption-mode", "engine.preemption_mode", str,
     "recompute | swap: how a full decode cache makes room"),
    ("--scheduling-policy", "engine.scheduling_policy", str,
     "fcfs | priority: requests queue, run and are preempted by their `priority` "
     "(lower first), in the workers and the gateway's queue"),
    ("--max-cudagraph-capture-size", "engine.max_cudagraph_capture_size", int,
     "on CUDA, capture decode batches up to this many sequences as CUDA graphs "
     "(0: none; --enforce-eager: none)"),
    ("--max-num-batched-tokens", "engine.max_num_batched_tokens", int,
     "token budget of one forward step, decode rows and prompt chunks together; prompts "
     "prefill in chunks of what is left"),
    ("--max-num-seqs", "engine.max_num_seqs", int,
     "requests a worker runs at once (so at most this many decode rows a step)"),
    ("--max-lora-rank", "engine.max_lora_rank", int,
     "highest rank of a --lora-modules adapter"),
    ("--quantization", "engine.quantization", str,
     "the checkpoint's quantization method (vLLM's names; default: its config.json's "
     "quantization_config): fp8 | compressed-tensors"),
    ("--prefill-compute-bound-tokens", "engine.prefill_compute_bound_tokens", int,
     "a prefill worker's step takes no further prompt once it holds this many tokens"),
    ("--ray-num-cpus", "ray_num_cpus", int, "logical CPUs of the local Ray"),
    ("--actor-num-cpus", "actor_num_cpus", float, "logical CPUs per worker actor"),
    ("--actor-num-gpus", "actor_num_gpus", float, "GPUs per worker actor"),
    ("--cpu-bind", "cpu_bind", str, "auto | none | a cpu list like 0-7: cores the CPU "
                                     "workers pin their torch threads to"),
    ("--worker-preload", "worker_preload", str, "auto | none: start the workers with "
                                                 "tcmalloc preloaded where installed"),
    ("--worker-huge-pages", "worker_huge_pages", str,
     "auto | none: start the workers with torch's large CPU tensors on transparent huge "
     "pages where the kernel grants them"),
    ("--placement", "placement", str, "auto | resources | none: place workers by the Ray "
                                      "custom resources prefill/decode"),
    ("--kv-bind", "kvstore.host", str, "KV store gRPC bind address (a node's routable "
                                        "address in a multi-node cluster)"),
    ("--kv-transfer", "transfer.backend", str, "KV data plane prefill -> decode: grpc | torch "
                                               "(torch.distributed pairs: gloo/NCCL) | "
                                               "mooncake (Mooncake's Transfer Engine)"),
    ("--kv-transfer-bind", "transfer.bind_host", str, "torch / mooncake transfer: address a "
                                                      "worker's pair store or Transfer Engine "
                                                      "binds (a routable one across nodes)"),
    ("--kv-mooncake-protocol", "transfer.kv_connector_extra_config.protocol", str,
     "mooncake transfer: TE transport, tcp | rdma"),
    ("--kv-transfer-buffer-bytes", "transfer.kv_connector_extra_config.source_buffer_bytes", int,
     "mooncake transfer: host memory per prefill worker registered with TE for KV waiting "
     "to be read"),
    ("--kv-receive-buffer-bytes", "transfer.kv_connector_extra_config.receive_buffer_bytes",
     int,
     "mooncake transfer: host memory per decode worker kept registered with TE for staged "
     "reads of scattered blocks"),
    ("--kv-streaming", "transfer.streaming", str, "request: decode pulls a request's KV after "
                                                  "prefill | layer: layer by layer, "
                                                  "overlapping prefill compute"),
    ("--kv-cache-layout", "engine.kv_cache_layout", str,
     "auto: cross-layer with --kv-transfer mooncake and request streaming, else layer | "
     "layer: a tensor per layer and K|V | cross-layer: every layer of a block together"),
    ("--block-run-window", "engine.block_run_window", int,
     "how a request's KV blocks are picked: 0 in LRU order (vLLM's) | N: the longest runs of "
     "consecutive blocks among the N x n least recently freed"),
    ("--kv-load-failure-policy", "transfer.load_failure_policy", str,
     "recompute: a failed KV load is recomputed, counted and logged | fail: the request "
     "ends with an error"),
    ("--drain-timeout", "drain_timeout_s", float, "on SIGTERM: stop admitting, let in-flight "
                                                  "requests finish for this many seconds"),
    ("--kv-token", "kvstore.token", str, "shared token of the KV plane: its gRPC calls and "
                                         "torch pairs"),
    ("--kv-tls-cert", "kvstore.tls.cert_file", str, "PEM certificate chain of the KV gRPC "
                                                     "plane (TLS on when given, with the key)"),
    ("--kv-tls-key", "kvstore.tls.key_file", str, "PEM private key of --kv-tls-cert"),
    ("--kv-tls-ca", "kvstore.tls.ca_file", str, "PEM CA bundle: clients verify stores against "
                                                "it, stores require client certs (mutual TLS)"),
    ("--kv-tail-capacity-bytes", "kvstore.tail_capacity_bytes", int,
     "bytes per node for per-request tail blocks in flight"),
    ("--dram-cache-gb", "kvpool.dram_cache_bytes", _gib, "G2 shared-memory arena per node, GiB"),
    ("--ssd-cache-dir", "kvpool.ssd_cache_dir", str, "G3 slab directory"),
    ("--ssd-cache-gb", "kvpool.ssd_cache_bytes", _gib, "G3 capacity per node, GiB"),
    ("--index-url", "kvpool.index_url", str, "global KV index: ray://NAME (embedded) or "
                                             "redis://host:port/db"),
    ("--node-lease-s", "kvpool.node_lease_s", float, "node liveness lease in the index, "
                                                     "seconds (<= 10)"),
    ("--kv-pool", "kvpool.backend", str, "prefix cache and index: pdcluster (node stores, "
                                         "--index-url) | mooncake-store"),
    ("--mooncake-master", "kvpool.mooncake_master", str,
     "--kv-pool mooncake-store: the mooncake_master's RPC address, HOST:PORT"),
    ("--mooncake-store-protocol", "kvpool.mooncake_protocol", str,
     "--kv-pool mooncake-store: its Transfer Engine transport, tcp | rdma"),
    ("--policy", "policy", str, "Conductor policy: kvcache_centric | cache_aware | "
                                "least_loaded | round_robin | random"),
    ("--pd-decider", "pd_decider", str,
     "per request: disaggregate, or prefill on the decode instance: cost | always "
     "(disaggregate every request) | never (prefill on the decode) | threshold:N (local when "
     "at most N prompt tokens are not in the decode's cache)"),
    ("--kv-decode-publish-interval", "transfer.decode_publish_interval", int,
     "with --kv-decode-publish: also publish a running sequence's blocks every N full blocks "
     "(0: when it ends), so a request moved off a dead decode loads them"),
    ("--admission", "admission", str, "SLO admission: none | arrival | prediction"),
    ("--slo-ttft-s", "slo_ttft_s", float, "TTFT SLO admission enforces, seconds"),
    ("--slo-tbt-ms", "slo_tbt_ms", float, "TBT SLO admission enforces, milliseconds"),
    ("--cost-model", "cost_model", str, "Conductor cost model: stories260k-cpu | mooncake-70b "
                                        "| a `pdcluster profile` file"),
    ("--max-inflight-requests", "max_inflight_requests", int,
     "sequences in flight through the gateway; more wait in its fair queue"),
    ("--max-queued-sequences", "max_queued_sequences", int,
     "sequences waiting for the gate; past it 503 + Retry-After"),
    ("--max-seqs-per-request", "max_seqs_per_request", int,
     "prompts x n one request may run; over it 400"),
    ("--header-timeout-s", "header_timeout_s", float,
     "close connections that send no complete request head within this many seconds"),
    ("--body-timeout-s", "body_timeout_s", float,
     "close connections whose request body stops arriving for this many seconds"),
    ("--keep-alive-timeout-s", "keep_alive_timeout_s", float,
     "close connections idle this many seconds between requests"),
    ("--max-connections", "max_connections", int,
     "connections open at once; past it the longest idle one is closed, or with none idle "
     "the new one is answered 503"),
    ("--log-level", "log_level", str, "debug | info | warning"),
    ("--log-format", "log_format", str, "text | json: one JSON object per line, with "
                                        "request_id on records about a request"),
    ("--worker-stall-timeout", "worker_stall_timeout_s", float,
     "seconds a worker running requests may take no step before it is restarted and its "
     "requests migrate (0: off)"),
    ("--autoscale", "autoscale", str,
     "prefill=MIN:MAX,decode=MIN:MAX: scale each role on its SLO (TTFT, TBT), queues and KV "
     "usage; scale-down drains (router/planner.py)"),
    ("--autoscale-interval-s", "autoscale_interval_s", float,
     "seconds between two --autoscale decisions (the report interval)"),
    ("--tool-call-parser", "tool_call_parser", str,
     "how tool calls are read out of the model's text: hermes | llama3_json"),
    ("--reasoning-parser", "reasoning_parser", str,
     "how a reasoning model's thinking is split from its answer (the chat message's "
     "reasoning field): deepseek_r1 | qwen3"),
]


# (flag, config path, help) for on/off switches: --X and --no-X.
_SERVE_SWITCHES = [
    ("--colocated", "colocated", "prefill and decode in the same worker, no KV transfer"),
    ("--enable-lora", "engine.enable_lora",
     "serve LoRA adapters (--lora-modules): a request names one as its model"),
    ("--enable-prefix-caching", "engine.enable_prefix_caching",
     "reuse cached prompt prefixes (--no-enable-prefix-caching for A/B runs)"),
    ("--enforce-eager", "engine.enforce_eager",
     "run the model eager (--no-enforce-eager: compile it with torch.compile)"),
    ("--kv-decode-publish", "transfer.decode_publish",
     "decode workers publish the full blocks of finished sequences, prompt and reply, to the "
     "KV pool, for a conversation's next turn"),
    ("--enable-auto-tool-choice", "enable_auto_tool_choice",
     'serve tool_choice "auto" (the model decides; needs --tool-call-parser)'),
    ("--kv-incremental-transfer", "transfer.incremental_transfer",
     "a decode worker holding a prompt's leading blocks in its own cache fetches only the "
     "rest"),
]

# The default `serve --help` shows where ServeConfig's is None (resolved later) or says less
# than these words; every other flag shows ServeConfig's own (_config_default).
_DEFAULT_TEXT = {
    "config": "none",
    "engine.model": "the bundled stories260K",
    "served_model_name": "the model directory's name",
    "prefill_tp": "--tensor-parallel-size",
    "decode_tp": "--tensor-parallel-size",
    "address": "none: start a local Ray",
    "engine.max_model_len": "the model's",
    "engine.prefill_compute_bound_tokens": "{cpu_compute_bound} on CPU, none on GPU",
    "ray_num_cpus": "the worker actors' CPUs + 2",
    "actor_num_gpus": "1 when engine.device is cuda, else 0",
    "engine.block_run_window": "{cross_layer_run_window} with a cross-layer cache, else 0",
    "engine.enforce_eager": "eager on CPU, compiled on CUDA",
    "kvstore.token": "random per gateway start",
    "kvstore.tls.cert_file": "none: plaintext",
    "kvstore.tls.key_file": "none",
    "kvstore.tls.ca_file": "none: the system's roots",
    "kvpool.ssd_cache_dir": "none: no G3",
    "kvpool.mooncake_master": "none",
    "max_queued_sequences": "4 x --max-inflight-requests",
    "max_connections": "--max-inflight-requests + --max-queued-sequences + 256",
    "max_seqs_per_request": "{max_seqs}, at most half of --max-inflight-requests",
    "api_keys": "none",
    "api_key_file": "none",
    "tool_call_parser": "none",
    "reasoning_parser": "none",
}


def _config_default(path: str):
    """ServeConfig's default of the field at dotted `path` (nested models walked; the
    transfer's section is the Mooncake transport's, whose flags are the only ones there)."""
    from pdcluster.deploy.config import ServeConfig

    section, _, name = path.rpartition(".")
    if section == "transfer.kv_connector_extra_config":
        from pdcluster.kvstore.transport.mooncake.settings import MooncakeSettings

        return MooncakeSettings.model_fields[name].get_default(call_default_factory=True)
    model = ServeConfig
    *parents, leaf = path.split(".")
    for name in parents:
        model = model.model_fields[name].annotation
    return model.model_fields[leaf].get_default(call_default_factory=True)


def _shown_default(path: str, typ=None) -> str:
    """A serve flag's default as its help shows it."""
    if path in _DEFAULT_TEXT:
        from pdcluster.deploy.config import DEFAULT_MAX_SEQS_PER_REQUEST
        from pdcluster.engine.config import CPU_COMPUTE_BOUND_TOKENS, CROSS_LAYER_RUN_WINDOW

        return _DEFAULT_TEXT[path].format(cpu_compute_bound=CPU_COMPUTE_BOUND_TOKENS,
                                          cross_layer_run_window=CROSS_LAYER_RUN_WINDOW,
                                          max_seqs=DEFAULT_MAX_SEQS_PER_REQUEST)
    value = _config_default(path)
    if isinstance(value, bool):
        return "on" if value else "off"
    if typ is _gib:
        return f"{value / (1 << 30):g}"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int) and path.endswith("_bytes") and value >= 1 << 20:
        unit, size = ("GiB", value / (1 << 30)) if value >= 1 << 30 else \
            ("MiB", value / (1 << 20))
        return f"{value} ({size:g} {unit})"
    return str(value)


class _ServeHelpFormatter(argparse.HelpFormatter):
    """`serve --help`: each flag's text, then its default. The flags default to SUPPRESS (only
    the flags given override the config), so the default shown is ServeConfig's, looked up
    when help is printed."""

    _types = {path: typ for _, path, typ, _ in _SERVE_FLAGS}

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.dest == "help":
            return text
        shown = _shown_default(action.dest, self._types.get(action.dest))
        return f"{text} (default: {shown.replace('%', '%%')})"


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Append argparse's `(default: ...)` to every option of `parser` and its subcommands
    whose help does not already give one (the subcommands other than `serve`)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action.choices.values():
                _show_defaults(choice)
            continue
        if (not action.option_strings or action.default in (None, argparse.SUPPRESS)
                or isinstance(action, (argparse._HelpAction, argparse._StoreConstAction,
                                       argparse._StoreTrueAction, argparse._StoreFalseAction,
                                       argparse._CountAction, argparse._VersionAction))):
            continue
        text = action.help or ""
        if text == argparse.SUPPRESS or "default" in text:
            continue
        action.help = f"{text} (default: %(default)s)" if text else "default: %(default)s"


def _metavar(flag: str) -> str:
    return flag.lstrip("-").upper().replace("-", "_")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdcluster", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve", help="serve a model through the OpenAI API", formatter_class=_ServeHelpFormatter,
        description="Serve a model through the OpenAI API. Defaults are ServeConfig's "
                    "(deploy/config.py); a --config YAML file sets any of them, flags win.")
    _add_serve_flags(serve)
    cluster = sub.add_parser(
        "cluster", help="a cluster of workers that outlives its gateways (deploy/cluster_cli.py)")
    actions = cluster.add_subparsers(dest="action", required=True)
    up = actions.add_parser(
        "up", formatter_class=_ServeHelpFormatter,
        help="start the workers, KV stores and index as detached actors, then exit",
        description="Start the workers as `serve` would, detached: they run until `pdcluster "
                    "cluster down`. With no --address, on a local Ray started for them.")
    _add_serve_flags(up)
    for name, text in (("down", "stop every actor of the cluster (and the local Ray up "
                                "started)"),
                       ("status", "each worker's role, instance, pid, node, state, and "
                                  "running / waiting requests")):
        action = actions.add_parser(name, help=text, description=text)
        action.add_argument("--address", help="the Ray cluster (default: the local one "
                                              "`cluster up` started)")
        action.add_argument("--ray-namespace", default="pdcluster",
                            help="the deployment's Ray namespace")
        if name == "status":
            action.add_argument("--json", action="store_true", help="one JSON object")
            action.add_argument("--watch", type=_seconds, metavar="S",
                                help="again every S seconds until interrupted (with --json, "
                                     "one line each)")
    gateway = sub.add_parser(
        "gateway", formatter_class=_ServeHelpFormatter,
        help="serve the OpenAI API over a running cluster (`pdcluster cluster up`)",
        description="Attach to a running cluster and serve; any number of gateways may run. "
                    "Only gateway settings are taken from flags and --config (deploy/"
                    "cluster_cli.py GATEWAY_FIELDS; a config file's other keys are the "
                    "cluster's and ignored); the rest are the cluster's.")
    _add_serve_flags(gateway)
    from pdcluster.deploy.profile import add_profile_parser
    from pdcluster.loadtest.cli import add_bench_parser
    from pdcluster.loadtest.simulator.cli import add_simulate_parser
    from pdcluster.loadtest.simulator.plan import add_plan_parser

    add_bench_parser(sub)
    add_simulate_parser(sub)
    add_plan_parser(sub)
    add_profile_parser(sub)
    for name, choice in sub.choices.items():
        if name not in ("serve", "gateway"):
            _show_defaults(choice)
    return parser


def _add_serve_flags(parser: argparse.ArgumentParser, config_file: bool = True) -> None:
    """`serve`'s flags (and --config FILE) on `parser`: only the flags given override."""
    if config_file:
        parser.add_argument("--config", metavar="FILE",
                            help="YAML file with a ServeConfig (flags override it)")
    for flag, path, typ, help_text in _SERVE_FLAGS:
        parser.add_argument(flag, dest=path, type=typ, default=argparse.SUPPRESS,
                            help=help_text, metavar=_metavar(flag))
    parser.add_argument("--api-key", dest="api_keys", action="append",
                        default=argparse.SUPPRESS, metavar="KEY",
                        help="require this key (repeatable); env PDCLUSTER_API_KEY also counts")
    parser.add_argument("--lora-modules", dest="engine.lora_modules", nargs="+",
                        type=_lora_module, default=argparse.SUPPRESS, metavar="NAME=PATH",
                        help="LoRA adapters (PEFT directories) served under these model names "
                             "(with --enable-lora)")
    parser.add_argument("--api-key-file", dest="api_key_file", default=argparse.SUPPRESS,
                        metavar="FILE", help="file with one API key per line")
    for flag, path, help_text in _SERVE_SWITCHES:
        parser.add_argument(flag, dest=path, action=argparse.BooleanOptionalAction,
                            default=argparse.SUPPRESS, help=help_text)


def _lora_module(value: str) -> tuple[str, str]:
    """NAME=PATH (vLLM's --lora-modules form) -> (name, path)."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


def _overrides(args: argparse.Namespace) -> dict:
    out: dict = {}
    paths = [f[1] for f in _SERVE_FLAGS] + [f[1] for f in _SERVE_SWITCHES] + \
        ["api_keys", "api_key_file", "engine.lora_modules"]
    for path in paths:
        if hasattr(args, path):
            node = out
            *parents, leaf = path.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            value = getattr(args, path)
            node[leaf] = dict(value) if path == "engine.lora_modules" else value
    return out


def _serve(config: ServeConfig) -> int:
    """`pdcluster serve`: Ray starts on this thread while the gateway's imports load on
    another. Both are seconds of CPU work (Ray's daemons and helper processes; torch and the
    actor classes), on different cores where the node has two or more."""
    from pdcluster.deploy.ray_session import RaySession

    pool = ThreadPoolExecutor(1, thread_name_prefix="gateway-imports")
    imported = pool.submit(importlib.import_module, "pdcluster.deploy.serve")
    pool.shutdown(wait=False)  # the import still runs; nothing more is submitted
    # on the main thread: ray.init sets its SIGTERM handler only there
    session = RaySession.open(config)
    try:
        serve = imported.result().serve  # raises what the import raised
    except BaseException:
        session.close()
        raise
    return serve(config, session)


def _serve_overrides(args: argparse.Namespace) -> dict:
    overrides = _overrides(args)
    if os.environ.get("PDCLUSTER_API_KEY"):  # env read only here, at the CLI edge
        overrides["api_keys"] = overrides.get("api_keys", []) + [os.environ["PDCLUSTER_API_KEY"]]
    return overrides


def _serve_config(args: argparse.Namespace) -> "ServeConfig | None":
    """The ServeConfig of `serve` / `cluster up` (logging set up from it); None, with the
    error printed, when it is invalid, or its model directory is (a missing or unsupported
    config.json, a quantization format not served or not the one `--quantization` names)."""
    from pdcluster.deploy.config import load_config

    from pdcluster.engine.model_config import ModelConfig
    from pdcluster.engine.quantization import check_quantization

    try:
        config = load_config(args.config, _serve_overrides(args))
        # the model directory and --quantization against it, before Ray starts
        model = ModelConfig.from_pretrained(config.engine.model)
        check_quantization(model.quantization, config.engine.quantization)
    except (ValueError, OSError) as exc:
        print(f"pdcluster: invalid configuration: {exc}", file=sys.stderr)
        return None
    from pdcluster.engine.logs import configure_logging

    configure_logging(config.log_level, config.log_format)
    return config


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        config = _serve_config(args)
        return 2 if config is None else _serve(config)
    if args.command == "cluster":
        from pdcluster.deploy import cluster_cli

        if args.action == "up":
            config = _serve_config(args)
            return 2 if config is None else cluster_cli.cluster_up(config)
        logging.basicConfig(level=logging.WARNING)
        if args.action == "down":
            return cluster_cli.cluster_down(args.address, args.ray_namespace)
        return cluster_cli.cluster_status(args.address, args.ray_namespace, args.json,
                                          args.watch)
    if args.command == "gateway":
        from pdcluster.deploy import cluster_cli

        return cluster_cli.gateway(_serve_overrides(args), args.config)
    if args.command == "bench":
        from pdcluster.loadtest.cli import run_bench

        return run_bench(args)
    if args.command == "simulate":
        from pdcluster.loadtest.simulator.cli import run_simulate

        return run_simulate(args)
    if args.command == "plan":
        from pdcluster.loadtest.simulator.plan import run_plan

        return run_plan(args)
    if args.command == "profile":
        from pdcluster.deploy.profile import run_profile

        return run_profile(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
