"""How much KV transfer time layer-wise streaming hides.

    .venv/bin/python benchmarks/layer_streaming.py [--lengths 256,512,1024] [--reps 3]
        [--kv-transfer grpc|mooncake] [--output results.json] [--small]

For each mode (`--kv-streaming request`, then `layer`) a real local cluster (launcher: Ray,
one KV store, one prefill and one decode actor, 1 torch thread each, every request
disaggregated) serves the same prompts (random token ids, max_tokens 2) one at a time through
the Pipeline. `--kv-transfer mooncake` moves both modes over Mooncake's Transfer Engine (whole
regions, or each layer's piece as it is written), `grpc` over the prefill node's store. Per
request, from the workers' own timestamps (time.time(), one machine):

    compute_end  the prefill's last forward ended          (PrefillResult.extra)
    admitted     the decode had the whole KV and admitted the request to run (kv_timings)

    returned     the prefill's result (output token 0) reached the client (Pipeline)

    exposed = admitted - compute_end: transfer time left on the critical path
    hidden  = exposed(request) - exposed(layer)
    after_return = admitted - returned: the decode's part of it (the rest, returned -
        compute_end, is the prefill publishing the blocks to the store, sampling and replying:
        the decode cannot admit a request before the Pipeline hands it over)
    last_piece = last layer piece landed - compute_end (layer streaming)

The model is a random-weight Llama in HF format written to a temp dir: hidden 768, 12 layers,
12 heads, 12 KV heads (MHA: 72 KiB of fp32 KV per token, 72 MiB for 1024 tokens), vocab 32000,
about 115M parameters (460 MB). `--small` shrinks it for a smoke run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))

from benchmarks.throughput import write_model  # noqa: E402
from pdcluster.deploy.config import ServeConfig  # noqa: E402
from pdcluster.deploy.launcher import Cluster  # noqa: E402
from pdcluster.engine.config import EngineConfig  # noqa: E402
from pdcluster.engine.protocol import SamplingParams  # noqa: E402
from pdcluster.kvstore.config import KVTransferConfig  # noqa: E402
from tests.faults import FAULTY  # noqa: E402 — decode workers that keep kv_timings

MODEL = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
             num_attention_heads=12, num_key_value_heads=12, vocab_size=32000,
             max_position_embeddings=2048)
SMALL = dict(MODEL, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=4, vocab_size=2000)


def run_mode(model_dir: Path, streaming: str, prompts: list[list[int]],
             backend: str = "grpc") -> list[dict]:
    config = ServeConfig(
        ray_num_cpus=4, ray_namespace=f"pdc-bench-{streaming}", pd_decider="always",
        engine=EngineConfig(model=str(model_dir), num_kv_blocks=256),
        transfer=KVTransferConfig(backend=backend, streaming=streaming, timeout_s=60))
    rows = []
    with Cluster(config, actors=FAULTY) as cluster:
        decode = cluster.decode[0].handle
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

        async def one(rid: str, prompt: list[int]) -> tuple[float, float]:
            start, returned = time.time(), None
            async for _ in cluster.pipeline.generate(rid, prompt, params):
                returned = returned or time.time()
            return start, returned

        asyncio.run(one(f"{streaming}-warmup", prompts[0][:64]))
        for i, prompt in enumerate(prompts):
            rid = f"{streaming}-{i}"
            start, returned = asyncio.run(one(rid, prompt))
            t = ray.get(decode.kv_timings.remote(rid))
            compute_end = t["prefill_extra"]["compute_end_s"]
            last_piece = max((a[2] for a in t["arrivals"]), default=None)
            rows.append({"mode": streaming, "prompt_tokens": len(prompt), "paths": t["paths"],
                         "prefill_s": compute_end - start,
                         "exposed_s": t["admitted_s"] - compute_end,
                         "after_return_s": t["admitted_s"] - returned,
                         "last_piece_s": None if last_piece is None else last_piece - compute_end,
                         "start_to_admitted_s": t["admitted_s"] - start})
            print(json.dumps(rows[-1]), flush=True)
    ray.shutdown()
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for n in sorted({r["prompt_tokens"] for r in rows}):
        med = {mode: {k: statistics.median(r[k] for r in rows
                                           if r["mode"] == mode and r["prompt_tokens"] == n)
                      for k in ("prefill_s", "exposed_s", "after_return_s",
                                "start_to_admitted_s")}
               for mode in ("request", "layer")}
        out.append({"prompt_tokens": n, **{f"{m}_{k}": v for m, d in med.items()
                                          for k, v in d.items()},
                    "hidden_s": med["request"]["exposed_s"] - med["layer"]["exposed_s"]})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="256,512,1024")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--kv-transfer", default="grpc", choices=["grpc", "mooncake"])
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    shape = SMALL if args.small else MODEL
    rng = random.Random(0)
    lengths = [int(x) for x in args.lengths.split(",")]
    prompts = [[rng.randrange(3, shape["vocab_size"]) for _ in range(n)]
               for n in lengths for _ in range(args.reps)]
    with tempfile.TemporaryDirectory() as tmp:
        params = write_model(Path(tmp), shape, seed=0)
        print(f"model: {params / 1e6:.1f}M parameters", flush=True)
        rows = (run_mode(Path(tmp), "request", prompts, args.kv_transfer)
                + run_mode(Path(tmp), "layer", prompts, args.kv_transfer))
    summary = summarize(rows)
    print("medians, ms: exposed (of it after the prefill returned) by mode; hidden")
    for s in summary:
        print(f"{s['prompt_tokens']:>5} tokens  prefill {1000 * s['request_prefill_s']:7.0f}  "
              f"request {1000 * s['request_exposed_s']:6.1f} "
              f"({1000 * s['request_after_return_s']:5.1f})  "
              f"layer {1000 * s['layer_exposed_s']:6.1f} ({1000 * s['layer_after_return_s']:5.1f})"
              f"  hidden {1000 * s['hidden_s']:6.1f}")
    if args.output:
        args.output.write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
