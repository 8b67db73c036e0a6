"""`pdcluster profile`: fit the Conductor's cost model on the real engine and write it to a file
that `pdcluster serve --cost-model FILE` and `pdcluster simulate --cost-model FILE` load.

It builds one ModelRunner in this process (the engine a worker runs) and times, median of
`--repeats`:

    prefill  chunked forwards of `new` tokens over `cached` ones already in the cache
             (the prefill worker's path) → least squares on [1, new, new·(cached + new/2)]
    decode   one step of `batch` sequences of `ctx` tokens each → on [1, batch·ctx, batch]
    transfer reading n KV blocks out of the paged cache and writing them back (a tier load's
             memory traffic) → on [1, bytes]: the model's own T_transfer, and path ``local``
    connectors with `--kv-transfer NAME[,NAME...]`: moving n blocks from a source process on
             this node into the paged cache over each connector (deploy.profile_transfer)
             → on [1, bytes]: path ``pd:NAME``; grpc's is also path ``remote`` (a pull from
             another node's store takes the same path; measured here over loopback)

Coefficients are clamped at >= 0 (refitting without a term that came out negative), so a
prediction never falls below what the terms that remain say. Capacities come from the config:
the G2 arena bytes / KV bytes per token, and a worker's paged cache in tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from pdcluster.kvstore.errors import KVStoreError
from pdcluster.router.cost_model import CostModel, save_cost_model


def add_profile_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("profile", help="fit the Conductor's cost model on this engine",
                              description=__doc__.split("\n")[0])
    p.add_argument("--model", help="HF model directory (default: bundled stories260K)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dram-cache-gb", type=float, default=0.25, help="G2 arena per node")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kv-transfer", default="",
                   help="connectors to measure prefill -> decode: grpc,torch,mooncake "
                        "(default: none)")
    p.add_argument("--kv-pool", default="",
                   help="also measure loading a prefix from this pool backend: mooncake-store "
                        "(needs --mooncake-master)")
    p.add_argument("--mooncake-master", help="the mooncake_master's RPC address, HOST:PORT")
    p.add_argument("--name", help="cost model name (default: profiled-<model dir>)")
    p.add_argument("--output", default="cost_model.json")


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples)


def fit_nonnegative(features: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: terms that come out negative are dropped and
    the rest refit (an active-set pass; enough for 2-3 terms)."""
    active = list(range(features.shape[1]))
    coef = np.zeros(features.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(features[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


def profile_engine(runner, repeats: int = 5) -> dict:
    """Timings and fits on `runner` (an engine.runner.ModelRunner). Returns {"prefill":
    [(new, cached, s)], "decode": [(batch, ctx, s)], "transfer": [(bytes, s)], "coef": ...}."""
    from pdcluster.engine.runner import SequenceChunk

    cfg, cache = runner.engine_config, runner.kv_cache
    bs, budget = cfg.block_size, cfg.max_num_batched_tokens
    max_len = min(runner.max_model_len, (cfg.num_kv_blocks // 2) * bs)
    table = list(range(-(-max_len // bs)))

    def prefill(new: int, cached: int) -> None:
        start = cached
        while start < cached + new:
            end = min(cached + new, start + budget)
            runner.execute([SequenceChunk([5] * (end - start), start, table)])
            start = end

    lengths = sorted({n for n in (8, 32, 64, 128, 256, 384, 512, 1024, 2048) if n < max_len})
    prefill_rows = [(new, cached, _time(lambda: prefill(new, cached), repeats))
                    for cached in (0, max_len // 4, max_len // 2) for new in lengths
                    if new + cached <= max_len]
    decode_rows = []
    for ctx in sorted({16, max_len // 4, max_len // 2}):
        per_seq = -(-(ctx + 1) // bs)
        for batch in (1, 2, 4, 8, 16, 32):
            if batch * per_seq > cfg.num_kv_blocks:
                continue
            chunks = [SequenceChunk([5], ctx, list(range(i * per_seq, (i + 1) * per_seq)))
                      for i in range(batch)]
            decode_rows.append((batch, ctx, _time(lambda: runner.execute(chunks), repeats)))
    block_bytes = cache.read_blocks([0]).numel() * cache.read_blocks([0]).element_size()
    transfer_rows = []
    for n in (1, 4, 16, 64, 256):
        if n <= cfg.num_kv_blocks:
            ids = list(range(n))
            transfer_rows.append((n * block_bytes, _time(
                lambda: cache.write_blocks(ids, cache.read_blocks(ids)), repeats)))
    pf = np.array([[1.0, n, n * (c + n / 2)] for n, c, _ in prefill_rows])
    df = np.array([[1.0, b * c, b] for b, c, _ in decode_rows])
    tf = np.array([[1.0, b] for b, _ in transfer_rows])
    return {"prefill": prefill_rows, "decode": decode_rows, "transfer": transfer_rows,
            "block_bytes": block_bytes,
            "prefill_coef": fit_nonnegative(pf, np.array([r[2] for r in prefill_rows])),
            "decode_coef": fit_nonnegative(df, np.array([r[2] for r in decode_rows])),
            "transfer_coef": fit_nonnegative(tf, np.array([r[1] for r in transfer_rows]))}


def transfer_figures(rows: list[tuple[int, float]]) -> dict[str, float]:
    """{"latency_s", "bytes_per_s"} fitted on [(bytes, seconds)] (at least two sizes)."""
    features = np.array([[1.0, b] for b, _ in rows])
    lat, per_byte = fit_nonnegative(features, np.array([s for _, s in rows]))
    return {"latency_s": float(lat), "bytes_per_s": 1.0 / per_byte if per_byte > 0 else 1e15}


def cost_model_from_profile(name: str, prof: dict, block_size: int, dram_cache_bytes: int,
                            num_kv_blocks: int) -> CostModel:
    a, b, c = (float(x) for x in prof["prefill_coef"])
    d, e, f = (float(x) for x in prof["decode_coef"])
    lat, per_byte = (float(x) for x in prof["transfer_coef"])
    kv_per_token = prof["block_bytes"] // block_size
    paths = {"local": transfer_figures(prof["transfer"])}
    for connector, rows in prof.get("connectors", {}).items():
        paths[f"pd:{connector}"] = transfer_figures(rows)
        if connector == "grpc":
            paths["remote"] = paths["pd:grpc"]
    for backend, rows in prof.get("pools", {}).items():
        paths[f"pool:{backend}"] = transfer_figures(rows)
    return CostModel(
        name=name, prefill_base_s=a, prefill_per_token_s=b, prefill_attention_s=c,
        step_base_s=d, step_per_context_token_s=e, step_per_sequence_s=f,
        kv_bytes_per_token=int(kv_per_token),
        transfer_bytes_per_s=1.0 / per_byte if per_byte > 0 else 1e15,
        transfer_latency_s=lat, dram_cache_tokens=int(dram_cache_bytes // kv_per_token),
        decode_kv_tokens=num_kv_blocks * block_size, source="pdcluster profile",
        transfer_paths=paths)


def run_profile(args: argparse.Namespace) -> int:
    """Run `pdcluster profile`; returns the exit status."""
    from pdcluster.deploy.profile_transfer import CONNECTORS, POOLS, measure_connector, measure_pool
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.runner import ModelRunner

    try:
        fields = {"dtype": args.dtype, "block_size": args.block_size,
                  "num_kv_blocks": args.num_kv_blocks, "device": args.device,
                  "max_num_batched_tokens": args.max_num_batched_tokens,
                  "torch_threads": args.torch_threads}
        if args.model:
            fields["model"] = args.model
        engine = EngineConfig(**fields)
        connectors = [c for c in args.kv_transfer.split(",") if c]
        unknown = set(connectors) - set(CONNECTORS)
        if unknown:
            raise ValueError(f"--kv-transfer: unknown {sorted(unknown)}; one of "
                             f"{', '.join(CONNECTORS)}")
        if args.kv_pool and args.kv_pool not in POOLS:
            raise ValueError(f"--kv-pool: one of {', '.join(POOLS)}")
        if args.kv_pool and not args.mooncake_master:
            raise ValueError("--kv-pool mooncake-store needs --mooncake-master HOST:PORT")
        runner = ModelRunner(engine)
        prof = profile_engine(runner, args.repeats)
        prof["connectors"] = {c: measure_connector(c, runner.kv_cache, args.repeats)
                              for c in connectors}
        prof["pools"] = ({args.kv_pool: measure_pool(args.kv_pool, runner.kv_cache,
                                                     args.mooncake_master, args.repeats)}
                         if args.kv_pool else {})
        name = args.name or f"profiled-{Path(engine.model).name}"
        model = cost_model_from_profile(name, prof, engine.block_size,
                                        int(args.dram_cache_gb * (1 << 30)), engine.num_kv_blocks)
        save_cost_model(model, args.output, {
            "engine": engine.model_dump(),
            "samples": {k: prof[k] for k in ("prefill", "decode", "transfer", "connectors",
                                             "pools")}})
    except (ValueError, OSError, KVStoreError) as exc:
        print(f"pdcluster profile: {exc}", file=sys.stderr)
        return 2
    print(f"cost model {model.name}: T_prefill = {model.prefill_base_s:.3g} + "
          f"{model.prefill_per_token_s:.3g}·new + {model.prefill_attention_s:.3g}·new·(cached"
          f" + new/2); T_step = {model.step_base_s:.3g} + {model.step_per_context_token_s:.3g}"
          f"·ctx + {model.step_per_sequence_s:.3g}·batch; T_transfer = "
          f"{model.transfer_latency_s:.3g} + bytes / {model.transfer_bytes_per_s:.3g}")
    for path, figures in model.transfer_paths.items():
        print(f"  T_transfer[{path}] = {figures['latency_s']:.3g} + bytes / "
              f"{figures['bytes_per_s']:.3g}")
    print(f"written: {args.output}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m deploy.profile ARGS` ≡ `pdcluster profile ARGS`."""
    parser = argparse.ArgumentParser(prog="pdcluster")
    add_profile_parser(parser.add_subparsers(dest="command", required=True))
    return run_profile(parser.parse_args(["profile", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
