"""The CPU linear's GEMM against vLLM's: our oneDNN-packed linear (kernels.cpu_gemm) and vLLM's
`onednn_mm` (its CPU backend's unquantized linear), at the 100M model's four projections and
prefill-sized row counts, float32 or bfloat16, in one invocation on the same machine.

    .venv/bin/python benchmarks/gemm_vs_vllm.py [--rows 512,1024,1800] [--threads 2]
        [--repeats 10] [--dtype float32] [--skip-vllm-install]

Each side runs in its own process and venv (vLLM's in benchmarks/.venv-vllm, made on first use
as benchmarks/vs_vllm.py makes it): this script times ours, then runs itself under vLLM's Python
with `--side vllm` in the environment its server gets (benchmarks/vs_vllm.py `vllm_env`: threads
bound, tcmalloc and Intel OpenMP preloaded). Both draw the same random x [rows, in] and weight
[out, in] (torch seed 0), pack the weight once, warm up twice and take the median of `--repeats`
calls. Prints, per row
count, each projection's ms and GFLOP/s (2·rows·out·in per call) and the sum over the four, ours
over vLLM's. Where our prefill is slower than vLLM's, this says whether the GEMM is why.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

def projections(shape: dict) -> list[tuple[str, int, int]]:
    """(name, out, in) of a Llama shape's linears (benchmarks/throughput.py's dicts): q+k+v
    fused, o, gate+up fused, down."""
    hidden, heads, kv_heads = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim, inter = hidden // heads, shape["intermediate_size"]
    return [("qkv", (heads + 2 * kv_heads) * head_dim, hidden), ("o", hidden, heads * head_dim),
            ("gate_up", 2 * inter, hidden), ("down", hidden, inter)]


def median_ms(fn, repeats: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1000


def time_side(side: str, rows: list[int], linears: list, threads: int, repeats: int,
              dtype_name: str = "float32") -> dict[str, float]:
    """{"rows/name": median ms} of each (name, out, in) of `linears` for `side` ("ours" |
    "vllm"), in this process, x and weight of `dtype_name`."""
    import torch

    dtype = getattr(torch, dtype_name)

    torch.set_num_threads(threads)
    if side == "vllm":
        import vllm._custom_ops as ops

        def packed(weight):
            handler = ops.create_onednn_mm(weight.t(), 32)
            return lambda x: ops.onednn_mm(handler, x, None)
    else:
        from pdcluster.kernels import cpu_gemm

        def packed(weight):  # both copies, as the model holds them (the tile GEMM's in bf16)
            skinny = cpu_gemm.pack_skinny(weight) if cpu_gemm.can_pack_skinny(weight) else None
            weight = cpu_gemm.pack(weight)
            return lambda x: cpu_gemm.linear(x, weight, skinny=skinny)
    torch.manual_seed(0)
    warm = packed(torch.randn(1024, 1024, dtype=dtype))  # the first GEMMs start the thread pool
    median_ms(lambda: warm(torch.randn(512, 1024, dtype=dtype)), 3)
    out = {}
    for n in rows:
        for name, n_out, n_in in linears:
            x, weight = torch.randn(n, n_in, dtype=dtype), torch.randn(n_out, n_in, dtype=dtype)
            out[f"{n}/{name}"] = median_ms(lambda f=packed(weight), x=x: f(x), repeats)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="512,1024,1800")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--skip-vllm-install", action="store_true",
                        help="use benchmarks/.venv-vllm as it is; fail if it is missing")
    parser.add_argument("--side", choices=("ours", "vllm"), help=argparse.SUPPRESS)
    parser.add_argument("--linears", help=argparse.SUPPRESS)  # the child's: JSON of projections()
    args = parser.parse_args()
    rows = [int(n) for n in args.rows.split(",")]
    if args.side:  # the child: one side's times as JSON
        print(json.dumps(time_side(args.side, rows, json.loads(args.linears), args.threads,
                                   args.repeats, args.dtype)))
        return 0
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from throughput import FULL
    from vs_vllm import VLLM_VENV, setup_vllm, vllm_env

    linears = projections(FULL)

    python = VLLM_VENV / "bin" / "python"
    if args.skip_vllm_install and not python.exists():
        parser.error(f"--skip-vllm-install: no {VLLM_VENV}")
    if not args.skip_vllm_install:
        setup_vllm()
    ours = time_side("ours", rows, linears, args.threads, args.repeats, args.dtype)
    child = subprocess.run([str(python), __file__, "--side", "vllm", "--rows", args.rows,
                            "--linears", json.dumps(linears),
                            "--threads", str(args.threads), "--repeats", str(args.repeats),
                            "--dtype", args.dtype],
                           capture_output=True, text=True, check=True,
                           env=vllm_env(args.threads))
    vllm = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"{args.dtype}, {args.threads} threads, median of {args.repeats}; ms (GFLOP/s)\n")
    print("| rows | projection | ours | vLLM onednn_mm | ours / vLLM |\n|---:|---|---:|---:|---:|")
    for n in rows:
        for name, n_out, n_in in linears:
            key, gflop = f"{n}/{name}", 2 * n * n_out * n_in / 1e9
            print(f"| {n} | {name} | {ours[key]:.2f} ({gflop / ours[key] * 1000:.0f}) | "
                  f"{vllm[key]:.2f} ({gflop / vllm[key] * 1000:.0f}) | "
                  f"{ours[key] / vllm[key]:.2f} |")
        total_ours = sum(ours[f"{n}/{p[0]}"] for p in linears)
        total_vllm = sum(vllm[f"{n}/{p[0]}"] for p in linears)
        print(f"| {n} | **all four** | {total_ours:.1f} | {total_vllm:.1f} | "
              f"**{total_ours / total_vllm:.2f}** |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
